"""N-gram prompt lookup: expected answers written out, plus a brute-force cross-check."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.base import ProposalRequest
from specdec.errors import ProposerConfigError
from specdec.ngram import NgramConfig, NgramProposer, find_ngram_proposal

CAPS = NgramConfig().context_depth_caps  # the proposer's default caps by match length


def _find(tokens: list[int], min_n: int, max_n: int, k: int, periodic: bool = False,
          weak: int | None = None, caps: tuple[int, ...] = ()) -> list[int]:
    return find_ngram_proposal(np.array(tokens, dtype=np.int64), min_n, max_n, k,
                               periodic, weak, caps).tolist()


@pytest.mark.parametrize(
    ("tokens", "min_n", "max_n", "k", "expected"),
    [
        ([1, 2, 3, 4, 1, 2, 3], 1, 3, 2, [4, 1]),  # 3-gram [1,2,3] occurred at 0..2
        ([1, 2, 3, 4, 5], 1, 3, 2, []),  # no token repeats
        ([], 1, 3, 2, []),
        ([7], 1, 3, 2, []),
        ([7, 7], 1, 3, 3, [7]),  # proposal truncated at the end of the context
        ([1, 2, 3, 1], 2, 3, 3, []),  # [3,1] never occurred and 1-grams are below min_n
        ([1, 2, 3, 1], 1, 3, 3, [2, 3, 1]),  # the 1-gram [1] occurred at 0
        # longest wins over most recent: [2,3] at 0..1 beats the later lone 3 at 4
        ([2, 3, 4, 0, 3, 8, 2, 3], 1, 2, 2, [4, 0]),
        # ... unless max_n stops at 1: then the latest 3 (at 4) wins
        ([2, 3, 4, 0, 3, 8, 2, 3], 1, 1, 2, [8, 2]),
        # equal length: the most recent earlier occurrence wins
        ([5, 6, 1, 5, 6, 2, 5, 6], 2, 2, 1, [2]),
        # a match longer than max_n is still found as a max_n match (latest of them)
        ([1, 2, 3, 4, 9, 1, 2, 3, 4], 2, 3, 2, [9, 1]),
        ([1, 2, 3, 1, 2, 3], 1, 3, 0, []),  # k = 0
        # overlapping occurrence: a run of one token proposes that token
        ([4, 4, 4, 4], 1, 2, 3, [4]),
    ],
)
def test_find_ngram_expected(tokens: list[int], min_n: int, max_n: int, k: int,
                             expected: list[int]) -> None:
    assert _find(tokens, min_n, max_n, k) == expected


@pytest.mark.parametrize(
    ("tokens", "k", "expected"),
    [
        ([5, 6, 7, 5, 6], 5, [7, 5, 6, 7, 5]),  # period 3: the loop goes on
        ([7, 7], 3, [7, 7, 7]),  # a run of one token
        ([4, 4, 4, 4], 3, [4, 4, 4]),
        ([1, 2, 3, 4, 1, 2, 3], 2, [4, 1]),  # enough tokens follow: unchanged
        ([1, 2, 3, 4, 1, 2, 3], 6, [4, 1, 2, 3, 4, 1]),
        ([1, 2, 3, 4, 5], 4, []),  # no match: still nothing
    ],
)
def test_find_ngram_periodic(tokens: list[int], k: int, expected: list[int]) -> None:
    assert _find(tokens, 1, 3, k, periodic=True) == expected
    # without periodic, the same match is cut at the end of the context
    assert _find(tokens, 1, 3, k) == expected[: len(_reference(tokens, 1, 3, k))]


def _reference(tokens: list[int], min_n: int, max_n: int, k: int, periodic: bool = False,
               weak: int | None = None, caps: tuple[int, ...] = ()) -> list[int]:
    """Plain-Python spec: longest n from max_n down, latest earlier start."""
    if k <= 0:
        return []
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                if weak is not None and n < max_n:
                    k = min(k, weak)
                if n <= len(caps):
                    k = min(k, caps[n - 1])
                follow = tokens[start + n :]
                if not periodic:
                    return follow[:k]
                return [follow[i % len(follow)] for i in range(k)]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(0, 9),
    periodic=st.booleans(),
    weak=st.one_of(st.none(), st.integers(1, 4)),
)
def test_find_ngram_matches_reference(tokens: list[int], min_n: int, extra: int, k: int,
                                      periodic: bool, weak: int | None) -> None:
    max_n = min_n + extra
    assert (_find(tokens, min_n, max_n, k, periodic, weak)
            == _reference(tokens, min_n, max_n, k, periodic, weak))


@pytest.mark.parametrize(
    ("tokens", "k", "weak", "expected"),
    [
        ([1, 2, 3, 4, 5, 1], 8, 2, [2, 3]),  # a 1-token match (max_n 3): capped at 2
        ([1, 2, 3, 4, 5, 1], 8, None, [2, 3, 4, 5, 1]),  # no cap
        # a full 3-token match [9, 1, 2] proposes the whole depth
        ([9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], 6, 2, [3, 4, 5, 6, 7, 8]),
        ([1, 2, 3, 4, 5, 1], 1, 2, [2]),  # the cap never raises k
    ],
)
def test_weak_matches_propose_less(tokens: list[int], k: int, weak: int | None,
                                   expected: list[int]) -> None:
    assert _find(tokens, 1, 3, k, weak=weak) == expected


def test_proposer_incremental_equals_fresh() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 5, 300).tolist()
    kept = NgramProposer(NgramConfig(min_n=1, max_n=3))
    for step in range(50):
        tokens.append(int(rng.integers(0, 5)))
        got = kept.propose([ProposalRequest(7, tokens, 4)])[0]
        fresh = NgramProposer(NgramConfig(min_n=1, max_n=3)).propose([ProposalRequest(7, tokens, 4)])
        assert got.tokens == fresh[0].tokens == _reference(tokens, 1, 3, 4, True, 4, CAPS), step
        assert got.seq_id == 7 and got.probs is None


def test_prepare_indexes_ahead_and_proposes_the_same() -> None:
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 5, 200).tolist()
    ahead, lazy = NgramProposer(), NgramProposer()
    ahead.prepare(ProposalRequest(3, prompt, 8, None, len(prompt)))
    assert ahead.num_tracked == 1 and lazy.num_tracked == 0
    tokens = list(prompt)
    for step in range(20):
        tokens.append(int(rng.integers(0, 5)))
        a = ahead.propose([ProposalRequest(3, tokens, 8, None, len(prompt))])[0]
        b = lazy.propose([ProposalRequest(3, tokens, 8, None, len(prompt))])[0]
        assert a.tokens == b.tokens, step


@settings(max_examples=200, deadline=None)
@given(
    chunks=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1,
                    max_size=12),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
    window=st.sampled_from([5, 8, 4096]),
    k=st.integers(1, 9),
    weak=st.one_of(st.none(), st.integers(1, 4)),
    rewrite_at=st.integers(0, 12),
)
def test_index_equals_the_reference_search(chunks: list[list[int]], min_n: int, extra: int,
                                           window: int, k: int, weak: int | None,
                                           rewrite_at: int) -> None:
    """The proposer's per-sequence index answers what find_ngram_proposal does on the window,
    step after step as tokens arrive (several per step), and after a preemption (release,
    then a shorter history)."""
    max_n = min_n + extra
    window = max(window, max_n + 1)
    proposer = NgramProposer(NgramConfig(min_n=min_n, max_n=max_n, window=window,
                                         weak_match_depth=weak))
    tokens: list[int] = []
    for step, chunk in enumerate(chunks):
        if step == rewrite_at:
            proposer.release(3)
            tokens = tokens[: len(tokens) // 2]
        tokens = tokens + chunk
        got = proposer.propose([ProposalRequest(3, tokens, k)])[0].tokens
        assert got == _find(tokens[-window:], min_n, max_n, k, True, weak, CAPS), (step, tokens)


def test_proposer_batch_depths_and_release() -> None:
    proposer = NgramProposer(NgramConfig(min_n=1, max_n=2))
    out = proposer.propose([
        ProposalRequest(1, [1, 2, 3, 4, 1, 2], 3),
        ProposalRequest(2, [9, 8, 9], 3),
        ProposalRequest(3, [1, 2, 3], 2),
        ProposalRequest(4, [1, 2, 1, 2], 0),
    ])
    assert [p.seq_id for p in out] == [1, 2, 3, 4]
    # seq 2: only [8, 9] follows the earlier 9 (periodic continuation would add the 8), and
    # a 1-token match proposes at most context_depth_caps[0] = 2 tokens
    assert [p.tokens for p in out] == [[3, 4, 1], [8, 9], [], []]
    proposer.commit(1, 2)
    assert proposer.num_tracked == 3  # depth 0 keeps no state
    for seq_id in (1, 2, 3, 4):
        proposer.release(seq_id)
    assert proposer.num_tracked == 0


def test_proposer_rewritten_history_is_not_stale() -> None:
    proposer = NgramProposer(NgramConfig(min_n=1, max_n=2))
    assert proposer.propose([ProposalRequest(1, [1, 2, 3, 1], 2)])[0].tokens == [2, 3]
    # Same seq_id, a different history (e.g. reused id): answers from the new tokens.
    assert proposer.propose([ProposalRequest(1, [5, 6, 5], 2)])[0].tokens == [6, 5]
    assert proposer.propose([ProposalRequest(1, [5, 6], 2)])[0].tokens == []


def test_window_limits_the_search() -> None:
    tokens = [1, 2, 3] + [0, 9] * 10 + [4, 1, 2]  # [1,2] only occurs far back
    near = NgramProposer(NgramConfig(min_n=2, max_n=2, window=10))
    far = NgramProposer(NgramConfig(min_n=2, max_n=2, window=100))
    assert near.propose([ProposalRequest(1, tokens, 2)])[0].tokens == []
    assert far.propose([ProposalRequest(1, tokens, 2)])[0].tokens == [3, 0]


def test_long_context_buffer_grows() -> None:
    tokens = list(range(1000)) + [10, 11]
    proposer = NgramProposer(NgramConfig(min_n=1, max_n=4))
    assert proposer.propose([ProposalRequest(1, tokens, 3)])[0].tokens == [12, 13, 14]


@pytest.mark.parametrize("kwargs", [{"min_n": 0}, {"min_n": 3, "max_n": 2}, {"window": 4},
                                    {"weak_match_depth": 0}])
def test_config_rejects_bad_values(kwargs: dict[str, int]) -> None:
    with pytest.raises(ProposerConfigError):
        NgramConfig(**kwargs)


def test_context_depth_caps_by_match_length() -> None:
    proposer = NgramProposer(NgramConfig(min_n=1, max_n=4, pool_tokens=0))  # caps (2, 3)
    one = [1, 2, 3, 4, 5, 6, 1]  # [1] occurred: a 1-token match
    two = [9, 1, 2, 3, 4, 5, 6, 8, 1, 2]  # [1, 2]: 2 tokens
    full = [7, 1, 2, 3, 4, 5, 6, 8, 9, 0, 7, 1, 2, 3]  # [7, 1, 2, 3]: max_n, uncapped
    assert proposer.propose([ProposalRequest(1, one, 8)])[0].tokens == [2, 3]
    assert proposer.propose([ProposalRequest(2, two, 8)])[0].tokens == [3, 4, 5]
    assert proposer.propose([ProposalRequest(3, full, 8)])[0].tokens == [4, 5, 6, 8, 9, 0, 7, 1]


@pytest.mark.parametrize("caps", [(-1,), (2, -3)])
def test_config_rejects_negative_depth_caps(caps: tuple[int, ...]) -> None:
    with pytest.raises(ProposerConfigError, match="depth_caps"):
        NgramConfig(context_depth_caps=caps)
    with pytest.raises(ProposerConfigError, match="depth_caps"):
        NgramConfig(pool_depth_caps=caps)
