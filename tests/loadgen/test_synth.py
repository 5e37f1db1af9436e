"""Prompt synthesis: exact token lengths and block-aligned prefix sharing."""

from __future__ import annotations

from tokenizers import Tokenizer

from loadgen.synth import PromptSynthesizer
from loadgen.tokenizer import EstimateTokenCounter, HfTokenCounter
from polyinfer.config import TINY_TARGET

TOK = Tokenizer.from_file(str(TINY_TARGET / "tokenizer.json"))


def _ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False).ids


def test_lengths_are_exact_in_the_target_tokenizer(synth: PromptSynthesizer) -> None:
    for n in [1, 2, 3, 17, 63, 64, 65, 500, 2047]:
        assert len(_ids(synth.prompt(n, key=n))) == n
    assert synth.stats.num_inexact == 0


def test_longer_than_the_corpus_wraps_around(synth: PromptSynthesizer) -> None:
    n = synth.corpus_tokens + 1000
    assert len(_ids(synth.prompt(n, key=1))) == n


def test_shared_block_ids_share_exactly_their_tokens(synth: PromptSynthesizer) -> None:
    b = synth.block_tokens  # 64 in the fixture
    a = _ids(synth.prompt(3 * b + 10, key=1, hash_ids=(5, 6, 7, 8)))
    c = _ids(synth.prompt(2 * b + 30, key=2, hash_ids=(5, 6, 9)))
    d = _ids(synth.prompt(3 * b, key=3, hash_ids=(1, 6, 7)))
    assert len(a) == 3 * b + 10 and len(c) == 2 * b + 30 and len(d) == 3 * b
    shared = next(i for i, (x, y) in enumerate(zip(a, c, strict=False)) if x != y)
    assert shared == 2 * b  # blocks 5, 6 in common, then 7 vs 9 differ at once
    assert a[:b] != d[:b] and a[b:3 * b] == d[b:3 * b]  # same block ids -> same token blocks


def test_partial_last_block_starts_like_the_full_block(synth: PromptSynthesizer) -> None:
    b = synth.block_tokens
    full = _ids(synth.prompt(2 * b, key=1, hash_ids=(40, 41)))
    partial = _ids(synth.prompt(b + 20, key=2, hash_ids=(40, 41)))
    assert partial[:b] == full[:b]
    assert partial[b:b + 10] == full[b:b + 10]  # the cut block is the same words, cut short


def test_unrelated_requests_do_not_share_a_prefix(synth: PromptSynthesizer) -> None:
    a, c = _ids(synth.prompt(200, key=1)), _ids(synth.prompt(200, key=2))
    assert a[:4] != c[:4]
    assert synth.prompt(200, key=1) == synth.prompt(200, key=1)  # deterministic


def test_scaled_block_size() -> None:
    counter = HfTokenCounter(TINY_TARGET)
    words = [" alpha", " beta,", " gamma", " delta.", " epsilon"] * 50
    s = PromptSynthesizer(counter, block_tokens=26, words=words)
    a = _ids(s.prompt(60, key=1, hash_ids=(1, 2, 3)))
    c = _ids(s.prompt(60, key=2, hash_ids=(1, 2, 4)))
    assert len(a) == len(c) == 60 and a[:52] == c[:52]


def test_estimate_mode_is_flagged_and_approximate() -> None:
    s = PromptSynthesizer(EstimateTokenCounter(), block_tokens=32,
                          words=[" word", " other", " thing."] * 100)
    text = s.prompt(100, key=1)
    assert not s.counter.exact
    assert EstimateTokenCounter().count(text) == 100  # exact in its own (estimated) units


class CharCounterFixture:
    """FIXTURE: an "exact" counter that is not additive over words (len // 3 of the text)."""

    name = "chars//3"
    exact = True

    def count(self, text: str) -> int:
        return len(text) // 3

    def count_batch(self, texts: list[str]) -> list[int]:
        return [self.count(t) for t in texts]


def test_a_miss_switches_to_recounting_every_prompt() -> None:
    s = PromptSynthesizer(CharCounterFixture(), block_tokens=16,  # type: ignore[arg-type]
                          words=[" ab", " cde", " fghij"] * 200)
    assert not s.verify_all
    for n in range(100, 200):
        s.prompt(n, key=n)
    assert s.verify_all and s.stats.num_verified == 100
    assert s.stats.num_prompts == 100


def test_additive_tokenizer_recounts_only_a_sample() -> None:
    s = PromptSynthesizer(HfTokenCounter(TINY_TARGET), block_tokens=16,
                          words=[" alpha", " beta,", " gamma"] * 100)
    for n in range(1, 201):
        assert len(_ids(s.prompt(n, key=n))) == n
    assert not s.verify_all and s.stats.num_verified == 64 + 3 and s.stats.num_inexact == 0
