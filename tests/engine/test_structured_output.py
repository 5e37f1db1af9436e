"""Structured output on a real engine worker, through the real `openai` client on loopback:
``response_format`` json_object / json_schema and vLLM's ``structured_outputs`` (json, regex,
choice, EBNF grammar), with xgrammar's mask on the sampler's path (engine.grammar). The tiny
model writes nonsense, but under the mask it is JSON that validates, text that matches the
regex, one of the choices, a sentence of the grammar."""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch

from engine.grammar import GrammarSpec, grammars_for, mask_rows
from engine.tokenizer import TextTokenizer
from polyinfer.capabilities import declared_unsupported, requested_options
from tests.engine.conftest import EngineProcess, draft_engine_config, serving

pytestmark = pytest.mark.timeout(300)
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,8}-\d{2,4}( [A-Z][a-z]{1,8})?"
CHOICES = ["positive", "negative", 'a "quoted" choice', "naïve\\path"]
# a regular grammar in EBNF, and the same language as a Python regex to check it by
GRAMMAR = """
root ::= greeting " " name ("," " " name)? "!"
greeting ::= "hello" | "hi"
name ::= [A-Z] [a-z] [a-z]? [a-z]?
"""
GRAMMAR_AS_REGEX = r"(hello|hi) [A-Z][a-z]{1,3}(, [A-Z][a-z]{1,3})?!"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[EngineProcess]:
    """A draft-model engine, so a constrained request beside speculative ones is exercised."""
    yield from serving(draft_engine_config(tiny_model_dir), tmp_path_factory)


def client(server: EngineProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def chat(server: EngineProcess, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 400)
    kwargs.setdefault("temperature", 0)
    return client(server).chat.completions.create(model="tiny", messages=CHAT, **kwargs)


def test_json_object_parses(server: EngineProcess) -> None:
    texts = set()
    for depth in (0, 4):
        r = chat(server, response_format={"type": "json_object"},
                 extra_body={"speculative_depth": depth})
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)
        texts.add(choice.message.content)
    assert len(texts) == 1, texts


@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
    {"extra_body": {"structured_outputs": {"regex": REGEX}}},
    {"extra_body": {"structured_outputs": {"grammar": GRAMMAR}}},
], ids=["json_schema", "regex", "grammar"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_constrained_speculation_is_lossless(server: EngineProcess, constraint: dict[str, Any],
                                             sampling: dict[str, Any]) -> None:
    """The mask applies at every draft's position in verification: the same text at every
    depth; the draft model's (unconstrained) drafts are accepted inside JSON, where the
    grammar leaves it free choices (its regex and grammar texts are too odd for it)."""
    constraint = dict(constraint)
    extra = constraint.pop("extra_body", {})
    texts, accepted = set(), 0
    for depth in (0, 1, 4):
        r = chat(server, max_tokens=200, extra_body={**extra, "speculative_depth": depth},
                 **constraint, **sampling)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        texts.add(r.choices[0].message.content)
        accepted += r.usage.model_extra["spec_decode"]["num_accepted_tokens"]
    assert len(texts) == 1, texts
    assert accepted > 0 or "response_format" not in constraint


def test_json_schema_validates(server: EngineProcess) -> None:
    for seed in (1, 2, 3):
        r = chat(server, temperature=1.0, seed=seed, response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_vllm_structured_outputs_json_on_completions(server: EngineProcess) -> None:
    r = client(server).completions.create(
        model="tiny", prompt="A person:", max_tokens=400, temperature=0.9, seed=5,
        extra_body={"structured_outputs": {"json": SCHEMA}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_streamed_json_schema_validates(server: EngineProcess) -> None:
    stream = client(server).chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=400, temperature=0, stream=True,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": SCHEMA}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("kwargs, param, code", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format", None),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/missing"}}}}, "response_format", None),
    ({"extra_body": {"structured_outputs": {"json": {"type": "string", "pattern": "(("}}}},
     "structured_outputs", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema", None),
    ({"response_format": {"type": "yaml"}}, "response_format.type", None),
    ({"extra_body": {"structured_outputs": {"regex": "[a-z]+(("}}},
     "structured_outputs.regex", None),
    ({"extra_body": {"structured_outputs": {"regex": ""}}}, "structured_outputs.regex", None),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= undefined_rule"}}},
     "structured_outputs.grammar", None),
    ({"extra_body": {"structured_outputs": {"grammar": 'start ::= "a"'}}},
     "structured_outputs.grammar", None),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice", None),
    ({"extra_body": {"structured_outputs": {"choice": ["a", 3]}}},
     "structured_outputs.choice", None),
    ({"extra_body": {"structured_outputs": {"choice": ["a"], "regex": "a"}}},
     "structured_outputs", None),
    ({"extra_body": {"structured_outputs": {"structural_tag": '{"type": "x"}'}}},
     "structured_outputs.structural_tag", "unsupported_option"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "tools", "unsupported_option"),
])
def test_what_cannot_be_served_is_a_400(server: EngineProcess, kwargs: dict[str, Any],
                                        param: str, code: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, max_tokens=8, **kwargs)
    assert e.value.param == param, e.value.body
    if code is not None:
        assert e.value.code == code


def test_the_routing_table_knows_what_the_engine_serves() -> None:
    """Every structured_outputs constraint but structural_tag goes to engine workers."""
    engine = declared_unsupported("engine")
    for body in ({"response_format": {"type": "json_object"}},
                 {"structured_outputs": {"json": SCHEMA, "disable_fallback": True}},
                 {"structured_outputs": {"json_object": True}},
                 {"structured_outputs": {"regex": "[a-z]+"}},
                 {"structured_outputs": {"choice": ["a", "b"]}},
                 {"structured_outputs": {"grammar": "root ::= x"}}):
        assert requested_options(body, chat=True) and not requested_options(body, True) & engine
    needs = requested_options({"structured_outputs": {"structural_tag": "{}"}}, chat=False)
    assert needs & engine == {"structured_outputs.structural_tag"}
    assert "tools" in engine and "tool_choice" in engine


def structured(server: EngineProcess, constraint: dict[str, Any], **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 64)
    kwargs.setdefault("temperature", 1.0)
    extra = {"structured_outputs": constraint, **kwargs.pop("extra_body", {})}
    return client(server).completions.create(model="tiny", prompt="Answer:", extra_body=extra,
                                             **kwargs)


def test_regex_output_matches(server: EngineProcess) -> None:
    texts = set()
    for seed in (1, 2, 3):
        r = structured(server, {"regex": REGEX}, seed=seed, n=2)
        for c in r.choices:
            assert c.finish_reason == "stop" and re.fullmatch(REGEX, c.text), c.text
            texts.add(c.text)
    assert len(texts) > 1  # sampled within the language, not one forced string
    r = chat(server, max_tokens=64, extra_body={"structured_outputs": {"regex": REGEX},
                                                "speculative_depth": 4})
    assert re.fullmatch(REGEX, r.choices[0].message.content), r.choices[0].message.content


def test_choice_is_one_of_the_choices(server: EngineProcess) -> None:
    seen = set()
    for seed in range(6):
        r = structured(server, {"choice": CHOICES}, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].text in CHOICES, r.choices[0].text
        seen.add(r.choices[0].text)
    assert len(seen) > 1, seen
    stream = client(server).chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=32, temperature=0, stream=True,
        extra_body={"structured_outputs": {"choice": CHOICES}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in CHOICES


def test_the_grammar_wins_over_min_tokens(server: EngineProcess) -> None:
    """min_tokens past the grammar's end bans the EOS that ends it: the text still ends
    where the grammar does."""
    r = structured(server, {"choice": CHOICES}, n=8, extra_body={"min_tokens": 20})  # unseeded
    for c in r.choices:
        assert c.finish_reason == "stop" and c.text in CHOICES, c


def test_grammar_output_parses(server: EngineProcess) -> None:
    for seed in (1, 2, 3, 4):
        r = structured(server, {"grammar": GRAMMAR}, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        assert re.fullmatch(GRAMMAR_AS_REGEX, r.choices[0].text), r.choices[0].text


def test_unconstrained_requests_are_unaffected(server: EngineProcess) -> None:
    """The same greedy text alone and in a batch beside constrained requests."""
    def plain() -> str:
        return chat(server, max_tokens=48).choices[0].message.content

    alone = plain()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        constrained = [pool.submit(chat, server, response_format={"type": "json_object"})
                       for _ in range(3)]
        beside = [pool.submit(plain) for _ in range(3)]
        assert [f.result() for f in beside] == [alone] * 3
        for f in constrained:
            json.loads(f.result().choices[0].message.content)
    with pytest.raises(json.JSONDecodeError):
        json.loads(alone)  # free text really is free: the mask changed something


def test_drafted_rows_are_masked_at_each_drafts_position(tiny_model_dir: Path) -> None:
    """choice ["yes", "maybe"]: "yes" is one token, "maybe" two ("may" 6539, "be" 1492),
    EOS is 2."""
    tokenizer = TextTokenizer(tiny_model_dir, (2,))
    assert tokenizer.encode("yes") == [5033] and tokenizer.encode("maybe") == [6539, 1492]
    grammars = grammars_for(tokenizer, tokenizer.vocab_size)
    matcher = grammars.matcher(GrammarSpec.choice(["yes", "maybe"]))
    logits = torch.zeros(8, tokenizer.vocab_size)

    def allowed(out: torch.Tensor, row: int) -> set[int]:
        return set(torch.nonzero(out[row] > -math.inf).flatten().tolist())

    def spelled(tokens: set[int]) -> set[str]:
        return {tokenizer.decode([t]) for t in tokens}

    # a free row; drafts "may" "be" (3 rows); drafts "may", "yes" (refused), one more (4 rows)
    out = mask_rows(logits, [None, matcher, matcher], [[], [6539, 1492], [6539, 5033, 7]])
    assert len(allowed(out, 0)) == tokenizer.vocab_size  # no matcher: untouched
    for row in (1, 4):
        assert spelled(allowed(out, row)) == {"m", "ma", "may", "y", "ye", "yes"}
    for row in (2, 5):  # after "may"
        assert spelled(allowed(out, row)) == {"b", "be"}
    assert allowed(out, 3) == {2}  # complete: EOS only
    # 5033 is refused at row 5: rows 6 and 7 are never sampled from and stay unmasked
    assert len(allowed(out, 6)) == len(allowed(out, 7)) == tokenizer.vocab_size
    # the matcher was rolled back: still at the start
    assert matcher.accept_token(5033) and matcher.accept_token(2) and matcher.is_terminated()


def test_mask_cost_per_decode_token(tiny_model_dir: Path) -> None:
    """The mask's CPU cost per constrained row (fill the bitmask, apply it): printed for
    bench/RESULTS.md; bounded loosely so a broken (pathological) mask fails."""
    tokenizer = TextTokenizer(tiny_model_dir, (2,))
    grammars = grammars_for(tokenizer, tokenizer.vocab_size)
    matcher = grammars.matcher(GrammarSpec.json_schema(SCHEMA))
    gen = torch.Generator().manual_seed(0)
    seconds, rows = 0.0, 0
    while rows < 300:
        logits = torch.randn(1, tokenizer.vocab_size, generator=gen)
        t0 = time.perf_counter()
        masked = mask_rows(logits, [matcher])
        seconds += time.perf_counter() - t0
        rows += 1
        token = int(masked.argmax())
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            matcher.reset()
    per_row_ms = seconds / rows * 1e3
    print(f"\ngrammar mask (json_schema, vocab {tokenizer.vocab_size}): "
          f"{per_row_ms:.3f} ms per constrained row per decode step")
    assert per_row_ms < 50
