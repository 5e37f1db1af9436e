"""Engine outputs in, OpenAI JSON out: choices, chunks, usage and logprobs in OpenAI's shapes.

Chat logprobs are ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``;
completions' are ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}``. A token's text is its own decoding (special tokens included), as
vLLM reports it. With ``n`` > 1 every choice carries its ``index``; usage counts the
prompt once and the completion tokens of every choice.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.sequence import TokenLogprob
from engine.tokenizer import TextTokenizer


def usage(num_prompt: int, num_output: int, num_draft: int, num_accepted: int,
          num_cached: int = 0) -> dict[str, Any]:
    """OpenAI usage; ``prompt_tokens_details.cached_tokens`` = prompt tokens the prefix cache
    served (always present, 0 with caching off; vLLM sends it with
    ``--enable-prompt-tokens-details``), ``spec_decode`` = this engine's speculation counts."""
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output,
            "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": num_cached},
            "spec_decode": {"num_draft_tokens": num_draft, "num_accepted_tokens": num_accepted}}


@dataclass
class Choice:
    """One choice as it accumulates (non-streaming) or is sent (streaming)."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    stop_reason: Any = None
    logprobs: list[TokenLogprob] | None = None
    num_output: int = 0
    num_draft: int = 0
    num_accepted: int = 0
    text_offset: int = 0  # characters of the text before this chunk's tokens (completions)
    parts: list[str] = field(default_factory=list)


def total_usage(choices: Sequence[Choice], num_prompt: int, num_cached: int) -> dict[str, Any]:
    return usage(num_prompt, sum(c.num_output for c in choices),
                 sum(c.num_draft for c in choices), sum(c.num_accepted for c in choices),
                 num_cached)


class LogprobFormatter:
    """Token texts (cached per id) and the two OpenAI logprobs shapes."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer.tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = str(
                self._tokenizer.decode([token_id], skip_special_tokens=False))
        return text

    def chat(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        return {"content": [self._chat_entry(lp) for lp in logprobs], "refusal": None}

    def _chat_entry(self, lp: TokenLogprob) -> dict[str, Any]:
        entry = self._chat_token(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [self._chat_token(t, v) for t, v in lp.top]
        return entry

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    def completion(self, logprobs: Sequence[TokenLogprob], text_offset: int) -> dict[str, Any]:
        tokens = [self.text(lp.token_id) for lp in logprobs]
        offsets = []
        for t in tokens:
            offsets.append(text_offset)
            text_offset += len(t)
        # NOTE: as OpenAI's (and vLLM's) legacy completions, the sampled token is among its
        # top_logprobs, first: up to logprobs + 1 entries
        return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
                "top_logprobs": [{self.text(lp.token_id): _finite(lp.logprob)}
                                 | {self.text(t): _finite(v) for t, v in lp.top
                                    if t != lp.token_id}
                                 for lp in logprobs],
                "text_offset": offsets}


def _finite(logprob: float) -> float:
    """JSON has no -inf: a masked token's logprob is reported as OpenAI's floor, -9999."""
    return logprob if logprob > -9999.0 else -9999.0


def choice_body(chat: bool, choice: Choice, text: str, fmt: LogprobFormatter | None,
                logprobs: Sequence[TokenLogprob] | None, delta: bool = False,
                role: bool = False, final: bool = True) -> dict[str, Any]:
    """A choice of a body (``delta=False``) or of a chunk: text, finish and logprobs."""
    body: dict[str, Any] = {"index": choice.index, "logprobs": None,
                            "finish_reason": choice.finish_reason if final else None}
    if final:
        body["stop_reason"] = choice.stop_reason
    if fmt is not None and logprobs is not None:
        body["logprobs"] = fmt.chat(logprobs) if chat else fmt.completion(logprobs,
                                                                          choice.text_offset)
    if not chat:
        body["text"] = text
    elif delta:
        d: dict[str, Any] = {"role": "assistant"} if role else {}
        if text or role:
            d["content"] = text
        body["delta"] = d
    else:
        body["message"] = {"role": "assistant", "content": text}
    return body


def completion_body(rid: str, model: str, chat: bool, choices: list[dict[str, Any]],
                    usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, "usage": usage_}


def chunk_body(rid: str, model: str, chat: bool, created: int,
               choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": choices}


def usage_chunk(rid: str, model: str, chat: bool, created: int,
                usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage_}
