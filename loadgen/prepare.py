"""Turn scheduled trace records into ready-to-send requests with precomputed bodies.

All tokenizer work (counting, synthesis) happens here, before the run, so the
send loop only writes bytes.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import orjson

from loadgen.config import ClientConfig, LengthConfig
from loadgen.lengths import LengthStats, fit_lengths
from loadgen.request import PreparedRequest, TraceRequest
from loadgen.synth import PromptSynthesizer
from loadgen.tokenizer import TokenCounter

logger = logging.getLogger(__name__)

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class PrepareStats:
    lengths: LengthStats = field(default_factory=LengthStats)
    num_synthesized: int = 0  # prompts built from the corpus
    num_text: int = 0  # prompts taken from the trace
    num_truncated_text: int = 0  # trace prompts cut to fit the length policy
    tokens_exact: bool = True  # expected prompt lengths are the target tokenizer's


class RequestBuilder:
    """Builds one :class:`PreparedRequest` per scheduled record."""

    def __init__(self, client: ClientConfig, model: str, lengths: LengthConfig,
                 counter: TokenCounter, synth: PromptSynthesizer | None) -> None:
        self.client = client
        self.model = model
        self.lengths = lengths
        self.counter = counter
        self.synth = synth
        self.stats = PrepareStats(tokens_exact=counter.exact)
        self._chat_overhead: int | None = None
        # NOTE: text from the trace is never scaled (its words are the point),
        # only clipped to fit.
        self._text_lengths = dataclasses.replace(lengths, prompt_scale=1.0)

    def build(self, index: int, offset_s: float, record: TraceRequest) -> PreparedRequest:
        if record.prompt is None and record.messages is None:
            return self._synthetic(index, offset_s, record)
        return self._text(index, offset_s, record)

    def _endpoint(self, has_messages: bool) -> str:
        if self.client.endpoint != "auto":
            return self.client.endpoint
        return "chat" if has_messages else "completions"

    def _synthetic(self, index: int, offset_s: float, record: TraceRequest) -> PreparedRequest:
        assert self.synth is not None, "records without text need a synthesizer"
        recorded_out = record.output_tokens
        if recorded_out is None:
            recorded_out = self.lengths.default_output_tokens
        prompt_len, out_len = fit_lengths(record.prompt_tokens or 0, recorded_out,
                                          self.lengths, self.stats.lengths)
        self.stats.num_synthesized += 1
        endpoint = self._endpoint(False)
        block = None if record.block_tokens is None else self.lengths.scale_block(record.block_tokens)
        if endpoint == "chat":
            overhead = self._template_overhead()
            text = self.synth.prompt(max(prompt_len - overhead, 1), index, record.hash_ids, block)
            payload: dict[str, object] = {"messages": [{"role": "user", "content": text}]}
        else:
            text = self.synth.prompt(prompt_len, index, record.hash_ids, block)
            payload = {"prompt": text}
        return self._request(index, offset_s, record, endpoint, payload, prompt_len, out_len)

    def _text(self, index: int, offset_s: float, record: TraceRequest) -> PreparedRequest:
        self.stats.num_text += 1
        endpoint = self._endpoint(record.messages is not None)
        messages = list(record.messages or ({"role": "user", "content": record.prompt or ""},))
        recorded_prompt = self._count_prompt(endpoint, messages)
        recorded_out = record.output_tokens
        if recorded_out is None and record.reference_output is not None:
            recorded_out = self.counter.count(record.reference_output)
        if recorded_out is None:
            recorded_out = self.lengths.default_output_tokens
        prompt_len, out_len = fit_lengths(recorded_prompt, recorded_out, self._text_lengths,
                                          self.stats.lengths)
        if prompt_len < recorded_prompt:
            messages = self._truncated(messages, recorded_prompt - prompt_len)
            prompt_len = self._count_prompt(endpoint, messages)
        payload: dict[str, object]
        if endpoint == "chat":
            payload = {"messages": messages}
        else:
            payload = {"prompt": "\n".join(m["content"] for m in messages)}
        return self._request(index, offset_s, record, endpoint, payload, prompt_len, out_len)

    def _count_prompt(self, endpoint: str, messages: list[dict[str, str]]) -> int:
        """Prompt tokens as the server will see them (chat template applied when known)."""
        templated = self.counter.chat_prompt(messages) if endpoint == "chat" else None
        if templated is None:
            return self.counter.count("\n".join(m["content"] for m in messages))
        return self.counter.count(templated)

    def _truncated(self, messages: list[dict[str, str]], num_drop: int) -> list[dict[str, str]]:
        """Drop ``num_drop`` tokens from the end of the last message's content."""
        self.stats.num_truncated_text += 1
        last = messages[-1]["content"]
        keep = max(self.counter.count(last) - num_drop, 1)
        cut = self.counter.truncate(last, keep)
        return [*messages[:-1], {"role": messages[-1]["role"], "content": cut}]

    def _template_overhead(self) -> int:
        if self._chat_overhead is None:
            templated = self.counter.chat_prompt([{"role": "user", "content": ""}])
            self._chat_overhead = 0 if templated is None else self.counter.count(templated)
        return self._chat_overhead

    def _request(self, index: int, offset_s: float, record: TraceRequest, endpoint: str,
                 payload: dict[str, object], prompt_len: int, out_len: int) -> PreparedRequest:
        body: dict[str, object] = {"model": self.model, **payload, "max_tokens": out_len,
                                   "stream": self.client.stream}
        if self.client.stream:
            body["stream_options"] = {"include_usage": True}
        if self.client.ignore_eos:
            body["ignore_eos"] = True
        return PreparedRequest(index=index, line=record.line, arrival_s=offset_s,
                               path=PATHS[endpoint], body=orjson.dumps(body),
                               prompt_tokens=prompt_len, max_tokens=out_len,
                               domain=record.domain)
