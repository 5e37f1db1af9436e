"""Structured output: a request's grammar, compiled by xgrammar, masks its logits rows.

A request that constrains its output (``response_format`` ``json_object`` /
``json_schema``, or vLLM's ``structured_outputs`` ``json`` / ``json_object`` / ``regex`` /
``choice`` / ``grammar``) carries a :class:`GrammarSpec` in its parameters (plain data: it
crosses to a data-parallel core by pickle). The parser compiles it once to refuse a
grammar that cannot compile (a 400); the core compiles it again (a hit in the compiler's
cache, keyed by the source text) and keeps a matcher per sequence::

    grammars = grammars_for(tokenizer, vocab_size)     # one per tokenizer and process
    matcher = grammars.matcher(GrammarSpec.json_schema(schema))
    masked = mask_rows(logits, [matcher, None, ...])   # disallowed tokens -> -inf
    masked = mask_rows(logits, [matcher], [drafts])    # k + 1 rows: each draft's position
    matcher.accept_token(token)                        # the core, as tokens are appended

The grammar's end is the tokenizer's EOS: once the output is complete (the JSON closes,
the regex or grammar has matched all it can), the mask allows only EOS, and accepting it
terminates the matcher (the core then finishes the request).
xgrammar is imported on first use: a worker that never sees a grammar does not pay for it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.tokenizer import TextTokenizer

if TYPE_CHECKING:
    import xgrammar

CACHE_LIMIT_BYTES = 64 << 20  # compiled grammars kept per compiler (xgrammar's LRU cache)


class GrammarError(ValueError):
    """A schema, regex or grammar that xgrammar cannot compile."""


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain a request's output to: any JSON object, JSON of a schema, text of a
    regex, one of a list of strings, or text of an EBNF (GBNF) grammar."""

    kind: str  # "json_object" | "json_schema" | "regex" | "choice" | "grammar"
    # what compiles, and the cache key: the schema as compact JSON text (NOTE: keys keep the
    # client's order, the properties' order is the output's), the regex, or the EBNF text
    # (a choice is compiled as the EBNF alternation of its quoted strings)
    source: str = ""

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Any) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> GrammarSpec:
        """Exactly one of ``choices``: ``root ::= "a" | "b"``, each string quoted as JSON
        quotes it (EBNF strings take the same escapes)."""
        return cls("choice", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                      for c in choices))

    @classmethod
    def grammar(cls, ebnf: str) -> GrammarSpec:
        return cls("grammar", ebnf)


class Grammars:
    """Compiles :class:`GrammarSpec` for one tokenizer and logits width."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo(_encoded_vocab(tokenizer, vocab_size), _vocab_type(tokenizer),
                                 vocab_size=vocab_size,
                                 stop_token_ids=sorted(tokenizer.eos_token_ids),
                                 add_prefix_space=False)
        # NOTE: the compiler caches compiled grammars by their source (the schema text)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                            cache_limit_bytes=CACHE_LIMIT_BYTES)

    def compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        try:
            if spec.kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}',
                                                         any_whitespace=False)
            if spec.kind == "json_schema":
                return self.compiler.compile_json_schema(spec.source, any_whitespace=False)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.source)
            if spec.kind in ("choice", "grammar"):
                return self.compiler.compile_grammar(spec.source)
        except RuntimeError as e:  # xgrammar reports every compile error as RuntimeError
            raise GrammarError(_first_line(str(e))) from None
        raise AssertionError(f"unknown grammar kind {spec.kind!r}")

    def matcher(self, spec: GrammarSpec) -> xgrammar.GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))


@functools.lru_cache(maxsize=4)
def grammars_for(tokenizer: TextTokenizer, vocab_size: int) -> Grammars:
    """The process's :class:`Grammars` for ``tokenizer``: the parser and the core share it
    (and so its cache) when they run in one process."""
    return Grammars(tokenizer, vocab_size)


def mask_rows(logits: torch.Tensor, matchers: Sequence[Any],
              drafts: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """``logits`` with the tokens each sequence's matcher disallows at -inf; the same tensor
    when no sequence has a matcher, else a new one (the model's may be read-only).

    Sequence i has ``len(drafts[i]) + 1`` rows (one when ``drafts`` is None): row j is
    the position after its first j drafts, masked by the matcher advanced over them (then
    rolled back: the core accepts what verification keeps). Rows past a draft the grammar
    refuses, or past one that completes it, stay unmasked: verification stops at or before
    that draft (its own row gives it no probability), so they are never sampled from.
    """
    if all(m is None for m in matchers):
        return logits
    import xgrammar as xgr

    drafts = drafts if drafts is not None else [()] * len(matchers)
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    index = []
    row = 0
    for matcher, tokens in zip(matchers, drafts, strict=True):
        if matcher is not None:
            index += _fill_drafted(matcher, tokens, bitmask, row)
        row += len(tokens) + 1
    assert row == logits.shape[0], (row, logits.shape)
    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), indices=index)
    return out


def _fill_drafted(matcher: Any, drafts: Sequence[int], bitmask: torch.Tensor,
                  row: int) -> list[int]:
    """Fill the bitmask rows of one sequence from ``row``: the rows filled."""
    matcher.fill_next_token_bitmask(bitmask, row)
    filled = [row]
    num_accepted = 0
    for j, token in enumerate(drafts):
        if not matcher.accept_token(token):
            break
        num_accepted += 1
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(bitmask, row + j + 1)
        filled.append(row + j + 1)
    if num_accepted:
        matcher.rollback(num_accepted)
    return filled


def _encoded_vocab(tokenizer: TextTokenizer, vocab_size: int) -> list[str]:
    """Each id's token as tokenizer.json spells it; ids the tokenizer lacks are empty
    (xgrammar never allows an empty token)."""
    vocab = [""] * vocab_size
    for token, i in tokenizer.tokenizer.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            vocab[i] = token
    return vocab


def _vocab_type(tokenizer: TextTokenizer) -> xgrammar.VocabType:
    """How tokenizer.json spells bytes: GPT-2's byte-level alphabet, sentencepiece's
    ``<0xNN>`` fallback, or raw text."""
    import xgrammar as xgr

    decoder = json.loads(tokenizer.tokenizer.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def _first_line(message: str) -> str:
    """xgrammar's message without its source location prefix."""
    line = message.strip().splitlines()[0] if message.strip() else "invalid schema"
    return line.split(": ", 1)[1] if line.startswith("[") and ": " in line else line
