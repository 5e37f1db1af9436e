"""bench/ngram_replay.py: the step-by-step replay and the pool variants it compares; answers
written out."""

from __future__ import annotations

import sys

import pytest

from specdec.ngram import NgramConfig, NgramProposer
from specdec.pool import OutputPool
from tests.bench_module import load_bench


@pytest.fixture(scope="module")
def replay_mod():  # type: ignore[no-untyped-def]
    try:
        yield load_bench("ngram_replay.py", "bench_ngram_replay")
    finally:
        sys.modules.pop("bench_ngram_replay", None)
        sys.modules.pop("bench_specdec", None)


def test_replay_counts_tokens_and_steps(replay_mod) -> None:  # type: ignore[no-untyped-def]
    # pos 1: context 5 6 7 8 5, a 1-token match ([5] at 0), capped at 2 -> [6, 7]: both
    # accepted, 3 tokens. pos 4: context ... 5 6 7 8, a 4-token match, depth 1 left -> [5],
    # rejected (9 follows), 1 token. 4 tokens in 2 steps, 3 drafted.
    record = replay_mod.Record("qa", [5, 6, 7, 8], [5, 6, 7, 8, 9])
    tally = replay_mod.replay([record], NgramProposer(NgramConfig(pool_tokens=0)), 16, 1)["qa"]
    assert (tally.tokens, tally.steps, tally.drafted, tally.calls) == (4, 2, 3, 2)


def test_replay_feeds_the_pool_other_prompts_only(replay_mod) -> None:  # type: ignore[no-untyped-def]
    # Two rounds of one prompt: its own earlier output never serves it (prompt_key rule),
    # so round 2 counts exactly as round 1.
    record = replay_mod.Record("chat", [1, 2], [3, 4, 5, 6, 7, 8])
    tally = replay_mod.replay([record], NgramProposer(NgramConfig()), 8, 2)["chat"]
    assert (tally.tokens, tally.steps) == (10, 10)


def test_vote_pool_takes_the_continuation_most_prompts_agree_on(replay_mod) -> None:  # type: ignore[no-untyped-def]
    outputs = [(2, [7, 8, 9, 11]), (3, [7, 8, 9, 11]), (1, [7, 8, 9, 10])]  # latest: 9 10
    current = OutputPool(100, 1, 3)
    vote = replay_mod.VotePool(100, 1, 3, hits=16, min_share=0.0)
    strict = replay_mod.VotePool(100, 1, 3, hits=16, min_share=0.7)
    for pool in (current, vote, strict):
        for key, tokens in outputs:
            pool.add(key, tokens)
    assert current.lookup([4, 7, 8], 99, 0, 2, None) == [9, 10]
    assert vote.lookup([4, 7, 8], 99, 0, 2, None) == [9, 11]  # 2 of 3 prompts
    assert strict.lookup([4, 7, 8], 99, 0, 2, None) == [9]  # 2/3 < 0.7: stop after 9
    assert vote.lookup([4, 7, 8], 2, 0, 2, None) == [9, 10]  # 1 to 1 (prompt 2 out): latest


def test_oracle_bound_is_at_least_the_proposer(replay_mod) -> None:  # type: ignore[no-untyped-def]
    records = [replay_mod.Record("qa", [1, 2, 3], [4, 1, 2, 3, 4, 1, 2, 5, 6]),
               replay_mod.Record("qa", [9, 9], [4, 1, 2, 5, 6, 7, 4, 1, 2])]
    ours = replay_mod.replay(records, NgramProposer(NgramConfig()), 8, 2)["qa"]
    bound = replay_mod.oracle(records, 8, 2)["qa"]
    assert ours.tokens == bound.tokens == 2 * (8 + 8)
    assert bound.steps <= ours.steps
