"""OpenAI request bodies in, engine inputs out; engine outputs in, OpenAI JSON out.

Parsing is strict about types and ranges (every problem is a
:class:`~engine.errors.RequestError` naming the field; OpenAI's ranges) and explicit
about what is not implemented: an option that would change the output
(``best_of``, ``echo``, ``tools``, vLLM's removed ``guided_*`` fields...) is refused
with a 400 ``unsupported_option`` rather than silently ignored. Served: ``n``,
``logprobs`` / ``top_logprobs``, ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``logit_bias``, ``min_tokens``, ``min_p``, ``seed``, ``stop``,
``stop_token_ids``, and structured output (engine.grammar): ``response_format``
``json_object`` / ``json_schema`` and vLLM's ``structured_outputs`` ``json`` /
``json_object`` / ``regex`` / ``choice`` / ``grammar`` (EBNF); a schema, regex or grammar
that cannot compile is a 400 naming its field.
Unknown fields are ignored, as vLLM does, so a proxy may add its own. A prompt that
cannot fit the context is refused from its length in characters (or messages, or ids)
before it is rendered or tokenized: an 8 MB prompt costs a length check, not seconds of
tokenizing and a heap that stays grown. Beside OpenAI's,
the engine reads ``speculative_depth``, ``slo_tpot_s`` and ``slo_ttft_s`` (the request's
SLOs in seconds: a TPOT SLO paces the prompt chunks beside it, a TTFT SLO sets the least pace
of its own prompt; engine.pacing).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.errors import (
    ContextLengthError,
    InvalidRequestError,
    ModelNotFoundError,
    UnsupportedOptionError,
)
from engine.grammar import GrammarError, GrammarSpec, grammars_for
from engine.sequence import GenerationParams
from engine.tokenizer import TextTokenizer
from polyinfer.capabilities import (
    ENGINE_SERVES,
    REMOVED_GUIDED_FIELDS,
    STRUCTURED_CONSTRAINTS,
    requested_options,
)
from polyinfer.config import CompiledConfig
from polyinfer.sampling import SamplingParams, derive_seed

MAX_STOP_STRINGS = 16
MAX_N = 128  # OpenAI's bound on n
MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound (vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 300  # OpenAI: at most 300 biased tokens
# what each kind of grammar is called in a compile error, and the field it came from
_GRAMMAR_FIELDS = {"json_object": ("schema", "response_format"),
                   "json_schema": ("schema", "response_format"),
                   "regex": ("regex", "structured_outputs.regex"),
                   "choice": ("choice", "structured_outputs.choice"),
                   "grammar": ("grammar", "structured_outputs.grammar")}
ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})


@dataclass(frozen=True)
class ParsedRequest:
    chat: bool
    prompt_ids: list[int]
    params: GenerationParams
    stream: bool
    include_usage: bool
    n: int = 1  # samples of the prompt (choices); sample i seeds with derive_seed(seed, i)

    def sample_params(self, index: int) -> GenerationParams:
        """The parameters of choice ``index``: its own seed when the request has one."""
        sampling = self.params.sampling
        if index == 0 or sampling.seed is None:
            return self.params
        return dataclasses.replace(self.params, sampling=dataclasses.replace(
            sampling, seed=derive_seed(sampling.seed, index)))


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


def _check_unsupported(body: Mapping[str, Any], chat: bool) -> None:
    """Refuse what this engine does not serve: the table the proxy routes by
    (polyinfer.capabilities), so a worker does what its backend declares."""
    for key in REMOVED_GUIDED_FIELDS:
        if body.get(key) is not None:
            raise UnsupportedOptionError(key, "removed from vLLM's API: use structured_outputs")
    for key in sorted(requested_options(body, chat) - ENGINE_SERVES):
        raise UnsupportedOptionError(key, "not implemented")


def _grammar(body: Mapping[str, Any]) -> GrammarSpec | None:
    """The grammar ``response_format`` or ``structured_outputs`` asks for; None for text."""
    fmt = _field(body, "response_format", dict, None, "an object")
    so = _field(body, "structured_outputs", dict, None, "an object")
    if fmt is not None and fmt.get("type") != "text" and so:
        raise InvalidRequestError("use one of 'response_format' and 'structured_outputs'",
                                  "structured_outputs")
    if so:
        # NOTE: its structural_tag was refused by the table (_check_unsupported); its other
        # keys (whitespace, fallback switches) change no validity
        used = [k for k in STRUCTURED_CONSTRAINTS if so.get(k) is not None
                and so.get(k) is not False]
        if len(used) > 1:
            raise InvalidRequestError("'structured_outputs' takes one of "
                                      f"{', '.join(map(repr, STRUCTURED_CONSTRAINTS))}; "
                                      f"got {', '.join(map(repr, used))}", "structured_outputs")
        return _structured_output(so, used[0]) if used else None
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind != "json_schema":
        raise InvalidRequestError("'response_format.type' must be one of 'text', "
                                  f"'json_object' and 'json_schema', got {kind!r}",
                                  "response_format.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InvalidRequestError("'response_format.json_schema' must be an object with a "
                                  "string 'name'", "response_format.json_schema")
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError("'response_format.json_schema.schema' must be an object",
                                  "response_format.json_schema.schema")
    return GrammarSpec.json_schema(schema)


def _structured_output(so: Mapping[str, Any], key: str) -> GrammarSpec:
    """The grammar of ``structured_outputs[key]``: a type check here, compiling later."""
    value, param = so[key], f"structured_outputs.{key}"
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise InvalidRequestError(f"'{param}' is not valid JSON", param) from None
        if not isinstance(value, (dict, bool)):
            raise InvalidRequestError(f"'{param}' must be a JSON schema", param)
        return GrammarSpec.json_schema(value)
    if key == "json_object":
        return GrammarSpec.json_object()
    if key == "choice":
        if not isinstance(value, list) or not value or not all(
                isinstance(c, str) and c for c in value):
            raise InvalidRequestError(f"'{param}' must be a non-empty list of non-empty "
                                      "strings", param)
        return GrammarSpec.choice(value)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"'{param}' must be a non-empty string", param)
    return GrammarSpec.regex(value) if key == "regex" else GrammarSpec.grammar(value)


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
        self.logits_width = vocab_size or tokenizer.vocab_size  # what a grammar mask covers
        self._text_past_vocab = self.vocab < tokenizer.vocab_size
        # a text of more characters has more than max_model_len tokens
        self.max_prompt_chars = max_model_len * tokenizer.max_token_chars

    def parse(self, body: Any, chat: bool) -> ParsedRequest:
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        model = _field(body, "model", str, self.config.model_name, "a string")
        if model != self.config.model_name:
            raise ModelNotFoundError(model, self.config.model_name)
        _check_unsupported(body, chat)
        prompt_ids = self._chat_prompt(body) if chat else self._completion_prompt(body)
        if self._text_past_vocab and max(prompt_ids, default=0) >= self.vocab:
            raise InvalidRequestError(f"the prompt has token ids outside the model's "
                                      f"vocabulary [0, {self.vocab})",
                                      "messages" if chat else "prompt")
        stream, include_usage = _stream_flags(body)
        params = self._params(body, chat, len(prompt_ids))
        n = _field(body, "n", int, 1, "an integer")
        if not 1 <= n <= MAX_N:
            raise InvalidRequestError(f"'n' must be in [1, {MAX_N}], got {n}", "n")
        return ParsedRequest(chat, prompt_ids, params, stream, include_usage, n)

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
            logprobs=_logprobs(body, chat),
            grammar=self._grammar(body),
        )

    def _grammar(self, body: Mapping[str, Any]) -> GrammarSpec | None:
        """The request's grammar, compiled once here so that one that cannot compile is a
        400 (the core's compile of it is then a cache hit, engine.grammar)."""
        spec = _grammar(body)
        if spec is not None:
            try:
                grammars_for(self.tokenizer, self.logits_width).compile(spec)
            except GrammarError as e:
                what, param = _GRAMMAR_FIELDS[spec.kind]
                if spec.kind.startswith("json") and body.get("structured_outputs"):
                    param = "structured_outputs"
                raise InvalidRequestError(f"the {what} cannot be compiled: {e}",
                                          param) from None
        return spec

    def _sampling(self, body: Mapping[str, Any]) -> SamplingParams:
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
        top_k = _field(body, "top_k", int, 0, "an integer")
        if top_k < -1:
            raise InvalidRequestError(f"'top_k' must be -1, 0 (off) or positive, got {top_k}",
                                      "top_k")
        seed = _field(body, "seed", int, None, "an integer")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        min_tokens = _field(body, "min_tokens", int, 0, "an integer")
        if min_tokens < 0 or (isinstance(max_tokens, int) and min_tokens > max_tokens):
            raise InvalidRequestError(f"'min_tokens' must be in [0, max_tokens], got "
                                      f"{min_tokens}", "min_tokens")
        return SamplingParams(
            temperature, top_p, max(top_k, 0), seed,
            min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
            presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 1e9, lo_open=True),
            logit_bias=self._logit_bias(body), min_tokens=min_tokens)

    def _logit_bias(self, body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
        bias = _field(body, "logit_bias", dict, {}, "an object of token id -> bias")
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens",
                                      "logit_bias")
        out = []
        for key, value in bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise InvalidRequestError("'logit_bias' keys must be token ids",
                                          "logit_bias") from None
            if not 0 <= token < self.vocab:
                raise InvalidRequestError(f"'logit_bias' has token id {token} outside "
                                          f"[0, {self.vocab})", "logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not -100 <= value <= 100:
                raise InvalidRequestError("'logit_bias' values must be numbers in [-100, 100]",
                                          "logit_bias")
            out.append((token, float(value)))
        return tuple(out)

    def _spec_depth(self, body: Mapping[str, Any]) -> int:
        cfg = self.config.engine
        depth = _field(body, "speculative_depth", int, cfg.spec_default_depth, "an integer")
        if depth < 0:
            raise InvalidRequestError(f"'speculative_depth' must be >= 0, got {depth}",
                                      "speculative_depth")
        return 0 if cfg.spec_method == "none" else min(depth, cfg.spec_max_depth)


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    """None (off) or how many alternatives per token: chat's ``logprobs: true`` with
    ``top_logprobs``, completions' ``logprobs: <int>``."""
    if chat:
        on = _field(body, "logprobs", bool, False, "true or false")
        top = _field(body, "top_logprobs", int, None, "an integer")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise InvalidRequestError(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got "
                                      f"{top}", "top_logprobs")
        if top and not on:
            raise InvalidRequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if on else None
    num = _field(body, "logprobs", int, None, "an integer")
    if num is not None and not 0 <= num <= MAX_LOGPROBS:
        raise InvalidRequestError(f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {num}",
                                  "logprobs")
    return num


def _message(m: Any, i: int) -> dict[str, str]:
    key = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise InvalidRequestError(f"'{key}' must be an object with a string 'role'", key)
    if m["role"] not in ROLES:
        raise InvalidRequestError(f"'{key}.role' must be one of {sorted(ROLES)}, got "
                                  f"{m['role'][:32]!r}", f"{key}.role")
    content = m.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            where = f"{key}.content[{j}]"
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise InvalidRequestError(f"'{where}' must be an object with a 'type'", where)
            if part["type"] != "text":
                raise UnsupportedOptionError(f"{key}.content", "only text content parts")
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"'{where}.text' must be a string", f"{where}.text")
            parts.append(part["text"])
        content = "".join(parts)
    elif not isinstance(content, str):
        raise InvalidRequestError(f"'{key}.content' must be a string or a list of parts", key)
    return {"role": m["role"], "content": content}
