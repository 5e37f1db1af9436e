"""Request-body checks at the API boundary: wrong input becomes a 4xx naming the field.

What the proxy itself depends on is checked (model, messages/prompt, stream,
token limits, speculative_depth, the SLO fields it routes by and forwards), and
what OpenAI checks the same way for every worker, so that a client sees one API
whichever worker serves it: the body is JSON (``Content-Type`` absent,
``application/json`` or ``application/*+json``, as vLLM's FastAPI server reads it;
anything else is a 400), message roles and content parts, and the ranges of the
sampling fields (temperature 0-2, top_p (0, 1], penalties -2..2, n, logprobs,
top_logprobs 0-20). Every other field passes through to the worker untouched, and
the worker judges it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from polyinfer.capabilities import REMOVED_GUIDED_FIELDS
from proxy.errors import ContextTooLong, InvalidRequest

CHAT = "chat/completions"
COMPLETIONS = "completions"
MAX_SPEC_DEPTH = 16
MAX_MODEL_NAME_CHARS = 256  # the name lands in traces and error messages
MAX_N = 128  # OpenAI's bound on n
MAX_TOP_LOGPROBS = 20
ROLES = ("system", "user", "assistant", "tool", "developer", "function")
CONTENT_PART_TYPES = ("text", "image_url", "input_audio", "file", "refusal")


# NOTE: orjson re-encodes at most 254 levels (and parses 1,024): a body nested deeper would
# parse and then fail on its way to the worker.
MAX_JSON_DEPTH = 254


def check_content_type(value: str | None) -> None:
    """A body is JSON only when it says so (or says nothing): a ``text/plain`` or form body
    is refused with a 400, as vLLM's server does, never parsed as JSON by accident."""
    if not value:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/")
                                       and media.endswith("+json")):
        return
    raise InvalidRequest(f"Content-Type must be application/json, got {media[:64]!r}")


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def encode_body(body: dict[str, Any]) -> bytes:
    """``body`` as JSON for the worker; :class:`InvalidRequest` for one nested past
    :data:`MAX_JSON_DEPTH` (the only thing a parsed body can fail on)."""
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError as e:
        raise InvalidRequest(f"request body nested deeper than {MAX_JSON_DEPTH} levels") from e


def describe(value: Any) -> str:
    """What a bad field's value is, never the value itself: error messages are logged and
    traced, and the value can be the client's text (or megabytes of it)."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number out of range" if _is_number(value) else "a number"
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    if isinstance(value, list):
        return f"an array of {len(value)} items"
    if isinstance(value, dict):
        return f"an object of {len(value)} keys"
    return type(value).__name__


def check_body(body: dict[str, Any], endpoint: str) -> None:
    """Raise :class:`InvalidRequest` naming the first bad field."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string", param="model")
    if len(model) > MAX_MODEL_NAME_CHARS or not model.isprintable():
        raise InvalidRequest(f"'model' must be a model name (printable, at most "
                             f"{MAX_MODEL_NAME_CHARS} characters), got {describe(model)}",
                             param="model")
    if endpoint == CHAT:
        _check_messages(body.get("messages"))
    else:
        _check_prompt(body.get("prompt"))
    for name in () if body.keys().isdisjoint(REMOVED_GUIDED_FIELDS) else REMOVED_GUIDED_FIELDS:
        if body.get(name) is not None:
            # NOTE: vLLM (0.32) ignores these with a warning and answers free text with a 200
            raise InvalidRequest(f"'{name}' was removed from vLLM's API (its output would not "
                                 f"be constrained); use 'structured_outputs' or "
                                 f"'response_format'", param=name)
    checks = _CHAT_FIELD_CHECKS if endpoint == CHAT else _COMPLETION_FIELD_CHECKS
    for name, value in body.items():
        check = checks.get(name)
        if check is not None and value is not None and not check[0](value):
            raise InvalidRequest(f"'{name}' must be {check[1]}, got {describe(value)}",
                                 param=name)
    if endpoint == CHAT and body.get("top_logprobs") and body.get("logprobs") is not True:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' is required and must be a non-empty array",
                             param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"'messages[{i}]' must be an object with a string 'role'",
                                 param=f"messages[{i}]")
        if m["role"] not in ROLES:
            raise InvalidRequest(f"'messages[{i}].role' must be one of {', '.join(ROLES)}, "
                                 f"got {describe(m['role'])}", param=f"messages[{i}].role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequest(f"'messages[{i}].content' must be a string or an array",
                                 param=f"messages[{i}].content")
        if isinstance(content, list):
            _check_parts(content, f"messages[{i}].content")


def _check_parts(parts: list[Any], where: str) -> None:
    for j, part in enumerate(parts):
        ok = isinstance(part, dict) and part.get("type") in CONTENT_PART_TYPES
        if not ok:
            raise InvalidRequest(f"'{where}[{j}]' must be a content part with a 'type' of "
                                 f"{', '.join(CONTENT_PART_TYPES)}", param=f"{where}[{j}]")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise InvalidRequest(f"'{where}[{j}].text' must be a string",
                                 param=f"{where}[{j}].text")


def _check_prompt(prompt: Any) -> None:
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list) and bool(prompt) and (
            all(isinstance(p, str) for p in prompt)
            or all(_is_int(t) for t in prompt)
            or all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt)))
    if not ok:
        raise InvalidRequest("'prompt' is required: a string, an array of strings or of token ids",
                             param="prompt")


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_positive_int(v: Any) -> bool:
    return _is_int(v) and v >= 1


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_spec_depth(v: Any) -> bool:
    return _is_int(v) and 0 <= v <= MAX_SPEC_DEPTH


def _is_seconds(v: Any) -> bool:
    return _is_number(v) and 0 < v < float("inf")


def _is_object(v: Any) -> bool:
    return isinstance(v, dict)


def _in(lo: float, hi: float, lo_open: bool = False) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        return _is_number(v) and (lo < v if lo_open else lo <= v) and v <= hi
    return check


def _is_n(v: Any) -> bool:
    return _is_int(v) and 1 <= v <= MAX_N


def _is_top_logprobs(v: Any) -> bool:
    return _is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS


def _is_logit_bias(v: Any) -> bool:
    return isinstance(v, dict) and all(
        k.lstrip("-").isdigit() and _in(-100, 100)(b) for k, b in v.items())


# field -> (check, what was expected); None values are always allowed.
_FIELD_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "stream": (_is_bool, "a boolean"),
    "max_tokens": (_is_positive_int, "a positive integer"),
    "max_completion_tokens": (_is_positive_int, "a positive integer"),
    "n": (_is_n, f"an integer 1..{MAX_N}"),
    "temperature": (_in(0.0, 2.0), "a number in [0, 2]"),
    "top_p": (_in(0.0, 1.0, lo_open=True), "a number in (0, 1]"),
    "presence_penalty": (_in(-2.0, 2.0), "a number in [-2, 2]"),
    "frequency_penalty": (_in(-2.0, 2.0), "a number in [-2, 2]"),
    "seed": (_is_int, "an integer"),
    "logit_bias": (_is_logit_bias, "an object of token id -> number in [-100, 100]"),
    "stream_options": (_is_object, "an object"),
    "speculative_depth": (_is_spec_depth, f"an integer 0..{MAX_SPEC_DEPTH}"),
    "slo_ttft_s": (_is_seconds, "a positive number of seconds"),
    "slo_tpot_s": (_is_seconds, "a positive number of seconds"),
}


# A token stands for at most this many characters of text (the longest tokens of common
# vocabularies are runs of spaces or symbols, well under it): a prompt of more characters
# than this times a context cannot fit that context, whatever the tokenizer.
MAX_CHARS_PER_TOKEN = 128
# A shape estimate this many times past the context is too long whatever its error.
ESTIMATE_SLACK = 2


def prompt_chars(body: dict[str, Any], endpoint: str) -> int:
    """The prompt's length in characters (token ids count as one each), from a body
    :func:`check_body` accepted: the lengths of its strings, no rendering. A chat message
    counts as ``MAX_CHARS_PER_TOKEN`` characters at least: it renders to a token or more."""
    if endpoint != CHAT:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return len(prompt)
        if not prompt:
            return 0
        return sum(len(p) for p in prompt) if isinstance(prompt[0], (str, list)) else len(prompt)
    total = MAX_CHARS_PER_TOKEN * len(body["messages"])
    for m in body["messages"]:
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text") or "") for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
    return total


def check_fits(num_chars: int, prompt_tokens: int | None, context_tokens: int | None,
               param: str) -> None:
    """Raise :class:`ContextTooLong` when a prompt cannot fit ``context_tokens`` (the
    longest any worker of the model holds; None: unknown, nothing checked): by its
    characters (before the shape is estimated), or by the estimated ``prompt_tokens``."""
    if context_tokens is None:
        return
    if num_chars > context_tokens * MAX_CHARS_PER_TOKEN:
        raise ContextTooLong(f"the prompt has {num_chars} characters: more than the "
                             f"{context_tokens} tokens the model's workers hold", param=param)
    if prompt_tokens is not None and prompt_tokens > context_tokens * ESTIMATE_SLACK:
        raise ContextTooLong(f"the prompt has about {prompt_tokens} tokens: more than the "
                             f"{context_tokens} the model's workers hold", param=param)


# chat's logprobs is a flag with top_logprobs beside it; completions' is a count
_CHAT_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logprobs": (_is_bool, "a boolean"),
    "top_logprobs": (_is_top_logprobs, f"an integer 0..{MAX_TOP_LOGPROBS}"),
}
_COMPLETION_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logprobs": (_is_top_logprobs, f"an integer 0..{MAX_TOP_LOGPROBS}"),
}


def wants_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and opts.get("include_usage") is True


# the checks of an endpoint's fields in one table (a field's own check first): one lookup a field
_CHAT_FIELD_CHECKS = {**_CHAT_CHECKS, **_FIELD_CHECKS}
_COMPLETION_FIELD_CHECKS = {**_COMPLETION_CHECKS, **_FIELD_CHECKS}
