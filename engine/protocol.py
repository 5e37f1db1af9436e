"""OpenAI request bodies in, engine inputs out; engine outputs in, OpenAI JSON out.

Parsing is strict about types and ranges (every problem is a
:class:`~engine.errors.RequestError` naming the field) and explicit about what
is not implemented: an option that would change the output (``n > 1``,
``logprobs``, penalties...) is refused with a 400 rather than silently ignored.
Unknown fields are ignored, as vLLM does, so a proxy may add its own. A prompt that
cannot fit the context is refused from its length in characters (or messages, or ids)
before it is rendered or tokenized: an 8 MB prompt costs a length check, not seconds of
tokenizing and a heap that stays grown. Beside OpenAI's,
the engine reads ``speculative_depth``, ``slo_tpot_s`` and ``slo_ttft_s`` (the request's
SLOs in seconds: a TPOT SLO paces the prompt chunks beside it, a TTFT SLO sets the least pace
of its own prompt; engine.pacing).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import (
    ContextLengthError,
    InvalidRequestError,
    ModelNotFoundError,
    UnsupportedOptionError,
)
from engine.sequence import GenerationParams
from engine.tokenizer import TextTokenizer
from polyinfer.config import CompiledConfig
from polyinfer.sampling import SamplingParams

MAX_STOP_STRINGS = 16
# option -> value(s) that mean "off"; anything else is refused as unsupported
NEUTRAL_OPTIONS: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "logprobs": (False, 0), "top_logprobs": (0,), "echo": (False,),
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logit_bias": ({},), "suffix": ("",), "min_tokens": (0,), "min_p": (0, 0.0),
    "tools": ([],), "functions": ([],), "prompt_logprobs": (0,), "use_beam_search": (False,),
    "skip_special_tokens": (True,),
}


@dataclass(frozen=True)
class ParsedRequest:
    chat: bool
    prompt_ids: list[int]
    params: GenerationParams
    stream: bool
    include_usage: bool


def _field(body: Mapping[str, Any], key: str, types: type | tuple[type, ...], default: Any,
           what: str) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    bad_bool = isinstance(value, bool) and bool not in (types if isinstance(types, tuple)
                                                        else (types,))
    if bad_bool or not isinstance(value, types):
        raise InvalidRequestError(f"'{key}' must be {what}, got {value!r}", key)
    return value


def _number(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float,
            lo_open: bool = False) -> float:
    value = float(_field(body, key, (int, float), default, "a number"))
    if not (lo < value if lo_open else lo <= value) or value > hi:
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise InvalidRequestError(f"'{key}' must be in {bound}, got {value}", key)
    return value


def _slo(body: Mapping[str, Any], key: str) -> float | None:
    """A positive, finite number of seconds, or None when absent."""
    value = _field(body, key, (int, float), None, "a number of seconds")
    if value is None:
        return None
    if not 0 < value < math.inf:
        raise InvalidRequestError(f"'{key}' must be a positive number of seconds, got {value}",
                                  key)
    return float(value)


def _check_unsupported(body: Mapping[str, Any]) -> None:
    for key, neutral in NEUTRAL_OPTIONS.items():
        value = body.get(key)
        if value is not None and value not in neutral:
            raise UnsupportedOptionError(key, f"only {neutral[0]!r} is supported, got {value!r}")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise UnsupportedOptionError("response_format", "only {'type': 'text'} is supported")


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequestError("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(s for s in stop if s)


def _token_list(value: Any, key: str, vocab: int) -> list[int]:
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidRequestError(f"'{key}' must be a list of token ids", key)
    if any(not 0 <= t < vocab for t in value):
        raise InvalidRequestError(f"'{key}' has token ids outside [0, {vocab})", key)
    return list(value)


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = _field(body, "stream", bool, False, "true or false")
    options = _field(body, "stream_options", dict, {}, "an object")
    include_usage = _field(options, "include_usage", bool, False, "true or false")
    if options and not stream:
        raise InvalidRequestError("'stream_options' is only allowed with 'stream': true",
                                  "stream_options")
    return stream, include_usage


class RequestParser:
    """Turns bodies into :class:`ParsedRequest`; holds what it needs from the live config."""

    def __init__(self, config: CompiledConfig, tokenizer: TextTokenizer,
                 max_model_len: int, vocab_size: int | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # token ids the model can embed: a checkpoint's tokenizer may know more than its model,
        # and then text can encode to ids past it (token-id prompts are checked as they are read)
        self.vocab = min(tokenizer.vocab_size, vocab_size or tokenizer.vocab_size)
        self._text_past_vocab = self.vocab < tokenizer.vocab_size
        # a text of more characters has more than max_model_len tokens
        self.max_prompt_chars = max_model_len * tokenizer.max_token_chars

    def parse(self, body: Any, chat: bool) -> ParsedRequest:
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        model = _field(body, "model", str, self.config.model_name, "a string")
        if model != self.config.model_name:
            raise ModelNotFoundError(model, self.config.model_name)
        _check_unsupported(body)
        prompt_ids = self._chat_prompt(body) if chat else self._completion_prompt(body)
        if self._text_past_vocab and max(prompt_ids, default=0) >= self.vocab:
            raise InvalidRequestError(f"the prompt has token ids outside the model's "
                                      f"vocabulary [0, {self.vocab})",
                                      "messages" if chat else "prompt")
        stream, include_usage = _stream_flags(body)
        params = self._params(body, chat, len(prompt_ids))
        return ParsedRequest(chat, prompt_ids, params, stream, include_usage)

    def _completion_prompt(self, body: Mapping[str, Any]) -> list[int]:
        if "prompt" not in body or body["prompt"] is None:
            raise InvalidRequestError("'prompt' is required", "prompt")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            raise UnsupportedOptionError("prompt", "one prompt per request (no batches)")
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            if isinstance(prompt, list) and len(prompt) >= self.max_model_len:
                self._too_long(f"{len(prompt)} tokens", "prompt")
            ids = _token_list(prompt, "prompt", self.vocab)
        if not ids:
            raise InvalidRequestError("'prompt' must not be empty", "prompt")
        return ids

    def _chat_prompt(self, body: Mapping[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("'messages' must be a non-empty list", "messages")
        if len(messages) >= self.max_model_len:  # a message renders to a token at least
            self._too_long(f"{len(messages)} messages", "messages")
        plain = [_message(m, i) for i, m in enumerate(messages)]
        self._check_chars(sum(len(m["content"]) for m in plain), "messages")
        add_gen = _field(body, "add_generation_prompt", bool, True, "true or false")
        text = self.tokenizer.apply_chat_template(plain, add_gen)
        self._check_chars(len(text), "messages")
        return self.tokenizer.encode(text)

    def _check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            self._too_long(f"{num_chars} characters (more than {self.max_model_len} tokens of "
                           f"at most {self.tokenizer.max_token_chars} characters)", param)

    def _too_long(self, what: str, param: str) -> None:
        raise ContextLengthError(f"This model's maximum context length is {self.max_model_len} "
                                 f"tokens; the prompt has {what}.", param)

    def _params(self, body: Mapping[str, Any], chat: bool, num_prompt: int) -> GenerationParams:
        room = self.max_model_len - num_prompt
        if room <= 0:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {num_prompt} tokens.", "messages" if chat else "prompt")
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
            else "max_tokens"
        max_tokens = _field(body, key, int, room if chat else 16, "an integer")
        if max_tokens < 1:
            raise InvalidRequestError(f"'{key}' must be at least 1, got {max_tokens}", key)
        if max_tokens > room:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens; you "
                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                f"{max_tokens} for the completion).", key)
        return GenerationParams(
            max_tokens=max_tokens,
            sampling=self._sampling(body),
            stop=_stop(body),
            stop_token_ids=tuple(_token_list(body.get("stop_token_ids") or [], "stop_token_ids",
                                             self.vocab)),
            ignore_eos=_field(body, "ignore_eos", bool, False, "true or false"),
            spec_depth=self._spec_depth(body),
            include_stop_str_in_output=_field(body, "include_stop_str_in_output", bool, False,
                                              "true or false"),
            slo_tpot_s=_slo(body, "slo_tpot_s"),
            slo_ttft_s=_slo(body, "slo_ttft_s"),
        )

    def _sampling(self, body: Mapping[str, Any]) -> SamplingParams:
        temperature = _number(body, "temperature", 1.0, 0.0, 100.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
        top_k = _field(body, "top_k", int, 0, "an integer")
        if top_k < -1:
            raise InvalidRequestError(f"'top_k' must be -1, 0 (off) or positive, got {top_k}",
                                      "top_k")
        seed = _field(body, "seed", int, None, "an integer")
        generator = None
        if seed is not None and temperature > 0:
            generator = torch.Generator()
            generator.manual_seed(seed % (1 << 63))
        return SamplingParams(temperature, top_p, max(top_k, 0), generator)

    def _spec_depth(self, body: Mapping[str, Any]) -> int:
        cfg = self.config.engine
        depth = _field(body, "speculative_depth", int, cfg.spec_default_depth, "an integer")
        if depth < 0:
            raise InvalidRequestError(f"'speculative_depth' must be >= 0, got {depth}",
                                      "speculative_depth")
        return 0 if cfg.spec_method == "none" else min(depth, cfg.spec_max_depth)


def _message(m: Any, i: int) -> dict[str, str]:
    key = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise InvalidRequestError(f"'{key}' must be an object with a string 'role'", key)
    content = m.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise UnsupportedOptionError(f"{key}.content", "only text content parts")
            parts.append(part["text"])
        content = "".join(parts)
    elif not isinstance(content, str):
        raise InvalidRequestError(f"'{key}.content' must be a string or a list of parts", key)
    return {"role": m["role"], "content": content}


# -- responses ------------------------------------------------------------------------------


def usage(num_prompt: int, num_output: int, num_draft: int, num_accepted: int,
          num_cached: int = 0) -> dict[str, Any]:
    """OpenAI usage; ``prompt_tokens_details.cached_tokens`` = prompt tokens the prefix cache
    served (always present, 0 with caching off; vLLM sends it with
    ``--enable-prompt-tokens-details``), ``spec_decode`` = this engine's speculation counts."""
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output,
            "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": num_cached},
            "spec_decode": {"num_draft_tokens": num_draft, "num_accepted_tokens": num_accepted}}


def completion_body(rid: str, model: str, chat: bool, text: str, finish_reason: str | None,
                    stop_reason: Any, usage_: dict[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason,
                              "stop_reason": stop_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice], "usage": usage_}


def chunk_body(rid: str, model: str, chat: bool, created: int, text: str | None,
               finish_reason: str | None = None, stop_reason: Any = None,
               role: bool = False) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, chat: bool, created: int,
                usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage_}
