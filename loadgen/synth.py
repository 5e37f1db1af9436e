"""Prompt synthesis to an exact token length, with prefix sharing preserved.

The corpus (``loadgen/data/corpus.txt``) is split into words that each start
with a space. With a byte-level BPE tokenizer a space always starts a new
pre-token, so the token count of a run of words is the sum of the words'
counts: a prompt of exactly ``n`` tokens is a run of words whose counts sum to
at most ``n``, topped up with one-token filler words. Prompts are re-counted
with the real tokenizer (a sample, or all after one miss) and corrected if that
assumption ever fails (a tokenizer of another kind); what could not be made
exact is counted. Servers report ``usage.prompt_tokens`` too, and every
summary counts the requests whose reported length differs from the intended.

Prefix sharing: prefix block ``h`` (Mooncake ``hash_ids``, polyinfer
``prefix_hashes``) is always the same text of exactly ``block_tokens`` tokens,
cut from a corpus position derived from ``h``. A prompt is its blocks in order
followed by request-specific text, so two requests that share their first
``k`` block ids share their first ``k * block_tokens`` tokens exactly.

A request may name its own block size (a polyinfer trace records the proxy's
per-prompt estimate, ``prefix_block_tokens``). A block's text is fixed the
first time its id is seen, at the size that request names; later requests
reuse that text whatever size they name, so sharing stays exact while the
estimates of one trace differ by a token or two.
"""

from __future__ import annotations

import hashlib
import logging
import re
from bisect import bisect_right
from dataclasses import dataclass
from importlib import resources
from itertools import accumulate

from loadgen.tokenizer import TokenCounter

logger = logging.getLogger(__name__)

FILLER = " the"  # one token in common BPE vocabularies; checked at start-up
MAX_FIXUP_ROUNDS = 4
VERIFY_FIRST = 64  # re-count the first prompts in full ...
VERIFY_EVERY = 50  # ... then one in this many, unless one was ever off


def load_corpus_words(text: str | None = None) -> list[str]:
    """The shipped corpus (or ``text``) as words that each begin with one space."""
    if text is None:
        text = resources.files("loadgen").joinpath("data/corpus.txt").read_text("utf-8")
    return re.findall(r" \S+", " " + " ".join(text.split()))


def stable_hash(*parts: int) -> int:
    data = b"".join(p.to_bytes(16, "big", signed=True) for p in parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@dataclass
class SynthStats:
    num_prompts: int = 0
    num_verified: int = 0  # prompts re-counted with the tokenizer
    num_inexact: int = 0  # prompts whose re-count differed from the target after fix-ups


class PromptSynthesizer:
    """Builds prompts of a given token length from the corpus; deterministic for a seed."""

    def __init__(self, counter: TokenCounter, block_tokens: int = 512, seed: int = 0,
                 words: list[str] | None = None, verify_all: bool = False) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens: expected a positive integer, got {block_tokens}")
        self.counter = counter
        self.block_tokens = block_tokens
        self.seed = seed
        self._words = words if words is not None else load_corpus_words()
        counts = counter.count_batch(self._words)
        self._counts = counts
        self._cum = [0, *accumulate(counts)]  # _cum[i] = tokens in words[:i]
        self._blocks: dict[int, tuple[str, int]] = {}  # id -> (text, tokens), fixed when first seen
        self.filler = self._one_token_word()
        self.stats = SynthStats()
        self.verify_all = verify_all  # re-count every prompt (else a sample)

    @property
    def corpus_tokens(self) -> int:
        return self._cum[-1]

    def _one_token_word(self) -> str:
        if self.counter.count(FILLER) == 1:
            return FILLER
        for word, n in zip(self._words, self._counts, strict=True):
            if n == 1:
                return word
        raise ValueError("the corpus has no one-token word to pad with")

    def span(self, start_word: int, num_tokens: int) -> str:
        """Corpus text from ``start_word`` (wrapping around) of exactly ``num_tokens`` tokens."""
        parts: list[str] = []
        start = start_word % len(self._words)
        remaining = num_tokens
        while remaining > 0:
            base = self._cum[start]
            end = bisect_right(self._cum, base + remaining) - 1  # words[start:end] fit
            if end <= start:  # the next word alone is too long: pad instead
                parts.append(self.filler * remaining)
                break
            parts.append("".join(self._words[start:end]))
            remaining -= self._cum[end] - base
            start = end % len(self._words)
        return "".join(parts)

    def block(self, block_id: int, block_tokens: int | None = None) -> tuple[str, int]:
        """Prefix block ``block_id`` as (text, tokens): the same for every request naming it.

        ``block_tokens`` (default: the synthesizer's) sizes a block seen for the first time.
        """
        cached = self._blocks.get(block_id)
        if cached is None:
            size = self.block_tokens if block_tokens is None else block_tokens
            cached = self.span(stable_hash(self.seed, 1, block_id), size), size
            self._blocks[block_id] = cached
        return cached

    def prompt(self, num_tokens: int, key: int, hash_ids: tuple[int, ...] = (),
               block_tokens: int | None = None) -> str:
        """A prompt of ``num_tokens`` tokens: shared blocks first, then text unique to ``key``.

        ``block_tokens`` is this request's block size (default: the synthesizer's).
        """
        if block_tokens is not None and block_tokens <= 0:
            raise ValueError(f"block_tokens: expected a positive integer, got {block_tokens}")
        parts: list[str] = []
        rest = num_tokens
        num_full = 0
        for h in hash_ids:
            text, size = self.block(h, block_tokens)
            if size > rest:
                break
            parts.append(text)
            rest -= size
            num_full += 1
        if rest and num_full < len(hash_ids):
            # NOTE: the partial last block starts like the full block (same
            # corpus position), so the shared prefix runs into it word by word.
            parts.append(self.span(stable_hash(self.seed, 1, hash_ids[num_full]), rest))
        elif rest:
            parts.append(self.span(stable_hash(self.seed, 2, key), rest))
        return self.exact("".join(parts), num_tokens)

    def _should_verify(self) -> bool:
        n = self.stats.num_prompts
        return self.verify_all or n <= VERIFY_FIRST or n % VERIFY_EVERY == 0

    def exact(self, text: str, num_tokens: int) -> str:
        """Re-count ``text`` and trim or pad its tail until it has ``num_tokens`` tokens.

        NOTE: re-counting costs ~3 us per token, more than building the
        prompt, so only a sample is re-counted while the word-sum assumption
        holds; the first miss switches to re-counting every prompt.
        """
        self.stats.num_prompts += 1
        if not self.counter.exact or not self._should_verify():
            return text
        self.stats.num_verified += 1
        if not self.verify_all and self.counter.count(text) != num_tokens:
            logger.warning("tokenizer %s is not additive over words: re-counting every prompt",
                           self.counter.name)
            self.verify_all = True
        for _ in range(MAX_FIXUP_ROUNDS):
            got = self.counter.count(text)
            if got == num_tokens:
                return text
            if got < num_tokens:
                text += self.filler * (num_tokens - got)
            else:
                text = _drop_words(text, got - num_tokens)
        if self.counter.count(text) != num_tokens:
            self.stats.num_inexact += 1
        return text


def _drop_words(text: str, num_words: int) -> str:
    """``text`` without its last ``num_words`` space-separated words (never empty)."""
    cut = len(text)
    for _ in range(num_words):
        space = text.rfind(" ", 0, cut)
        if space <= 0:
            break
        cut = space
    return text[:cut]
