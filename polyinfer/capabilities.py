"""Which request options a body uses, and which of them each backend serves.

The proxy routes a request only to workers whose backend serves every option it
uses (:func:`requested_options`), and the built-in engine refuses the options it
does not serve with this same table, so what a worker declares is what it does::

    needs = requested_options(body, chat=True)     # {"n", "logprobs"}
    declared_unsupported("engine") & needs         # frozenset(): an engine can serve it

An option is *used* when its value is not one of its neutral values (``n: 1``,
``presence_penalty: 0``, ``response_format: {"type": "text"}``...). vLLM serves
every option here (its unsupported ones are learned from the 400s it answers);
an ``external`` server declares nothing and is learned the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# option -> neutral values (a value equal to one of them does not use the option)
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",),
    "top_logprobs": (0,), "presence_penalty": (0,), "frequency_penalty": (0,),
    "repetition_penalty": (1,), "logit_bias": ({},), "min_tokens": (0,), "min_p": (0,),
    "stop_token_ids": ([],), "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"), "prompt_logprobs": (0,), "use_beam_search": (False,),
    "skip_special_tokens": (True,), "response_format": ({"type": "text"},),
    "structured_outputs": (),
}
_NEUTRAL_KEYS = frozenset(_NEUTRAL)
# vLLM's guided-decoding fields, removed from its API (vLLM 0.32 ignores them with a
# warning and answers free text with a 200): refused by the proxy, naming the replacement
REMOVED_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                         "guided_decoding_backend", "guided_whitespace_pattern")
# vLLM's structured_outputs constraints, each an option of its own ("structured_outputs.json"):
# a worker may serve some of them (its other keys, whitespace and fallback switches, are not
# options)
STRUCTURED_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
OPTIONS = frozenset(_NEUTRAL) | {"logprobs", "seed"} | {
    f"structured_outputs.{k}" for k in STRUCTURED_CONSTRAINTS}

# what the built-in engine serves (engine.protocol refuses the rest of OPTIONS)
ENGINE_SERVES = frozenset({
    "n", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "min_tokens", "min_p", "seed", "stop_token_ids",
    # structured output: JSON (an object, or a schema), a regex, a choice, an EBNF grammar;
    # not structured_outputs' structural_tag
    "response_format", "structured_outputs", "structured_outputs.json",
    "structured_outputs.json_object", "structured_outputs.regex", "structured_outputs.choice",
    "structured_outputs.grammar",
})
_DECLARED_UNSUPPORTED = {"engine": OPTIONS - ENGINE_SERVES}


def requested_options(body: Mapping[str, Any], chat: bool) -> frozenset[str]:
    """The options of :data:`OPTIONS` that ``body`` uses."""
    # NOTE: only the keys the body has are looked at (a set intersection; most bodies use
    # none of these options): this runs for every request
    used = {k for k in body.keys() & _NEUTRAL_KEYS
            if (v := body[k]) is not None and not any(_same(v, n) for n in _NEUTRAL[k])}
    logprobs = body.get("logprobs")
    # chat's logprobs is a flag; completions' a count, where 0 still asks for the
    # chosen token's logprob
    if (logprobs is True) if chat else (logprobs is not None and logprobs is not False):
        used.add("logprobs")
    if body.get("seed") is not None:
        used.add("seed")
    structured = body.get("structured_outputs")
    if isinstance(structured, Mapping):
        used.update(f"structured_outputs.{k}" for k in STRUCTURED_CONSTRAINTS
                    if structured.get(k) is not None and structured.get(k) is not False)
    return frozenset(used)


def _same(value: Any, neutral: Any) -> bool:
    # NOTE: True == 1 in Python; a boolean is never a neutral number (n: true is no n: 1)
    return type(value) is type(neutral) and value == neutral or (
        isinstance(value, float) and isinstance(neutral, int)
        and not isinstance(neutral, bool) and value == neutral)


def declared_unsupported(backend: str) -> frozenset[str]:
    """The options a backend declares it does not serve (vLLM, external: none)."""
    return _DECLARED_UNSUPPORTED.get(backend, frozenset())
