"""bench/ngram_replay.py: the step-by-step replay and the pool variants it compares; answers
written out."""

from __future__ import annotations

import pytest

from bench import ngram_replay
from specdec.ngram import NgramConfig, NgramProposer
from specdec.pool import OutputPool


@pytest.fixture(scope="module")
def replay_mod():  # type: ignore[no-untyped-def]
    return ngram_replay


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


# --- top-m: the m best-ranked candidates verified in one step ---

def test_top_m_ranks_own_first_then_length_or_vote_and_dedups(replay_mod) -> None:  # type: ignore[no-untyped-def]
    C, P, cand = replay_mod.CONTEXT, replay_mod.POOL, replay_mod.Candidate
    found = [cand(4, C, [1, 2, 3]), cand(2, C, [5, 6]), cand(2, P, [5]), cand(2, P, [7, 8]),
             cand(1, P, [5, 6, 9])]
    # length: own; [1,2,3] extends own but own is never replaced, so it takes a slot; [5] is a
    # prefix of the kept [5,6] (dropped); [5,6,9] extends [5,6] and replaces it in its slot.
    assert replay_mod.rank([1, 2], found, "length") == [(1, 2), (1, 2, 3), (5, 6, 9), (7, 8)]
    # vote: support = sum of common-prefix lengths with every candidate: [1,2,3] 3, [5,6] 3+2,
    # [5] 3, [7,8] 2, [5,6,9] 3+2+1 -> [5,6,9], [5,6] (dropped), [1,2,3], [5] (dropped), [7,8].
    assert replay_mod.rank([1, 2], found, "vote") == [(1, 2), (5, 6, 9), (1, 2, 3), (7, 8)]
    assert replay_mod.rank([], [cand(1, C, [4]), cand(1, P, [4])], "length") == [(), (4,)]


def test_top_m_gathers_context_and_pool_candidates_capped_or_full(replay_mod) -> None:  # type: ignore[no-untyped-def]
    index = replay_mod._LatestEnds(4)
    index.sync([5, 1, 2, 3, 8, 2, 3, 6, 3])  # suffix [3]: latest earlier end 6 -> 6 3, period 2
    pool = replay_mod._candidate_pool()
    pool.add(100, [6, 3, 9, 9, 9])
    pool.add(101, [0, 6, 3, 4, 4, 4])  # the latest: its hits come first
    full = replay_mod.gather(index, pool, 7, 4, "full")
    assert [(c.n, c.source, c.tokens) for c in full] == [
        (2, replay_mod.POOL, [4, 4, 4]), (2, replay_mod.POOL, [9, 9, 9]),
        (1, replay_mod.CONTEXT, [6, 3, 6, 3]),
        (1, replay_mod.POOL, [4, 4, 4]), (1, replay_mod.POOL, [9, 9, 9])]
    # capped as the proposer caps: pool 2-gram 1 token, context 1-gram 2, pool 1-gram 0 (gone)
    capped = replay_mod.gather(index, pool, 7, 4, "capped")
    assert [c.tokens for c in capped] == [[4], [9], [6, 3]]
    assert [c.tokens for c in replay_mod.gather(index, pool, 101, 4, "capped")] == [[9], [6, 3]]


def test_top_m_verifies_a_second_candidate_and_m1_is_current(replay_mod) -> None:  # type: ignore[no-untyped-def]
    # pos 1: context 1 2 7 8 2 5 6 1 2, truth 5 6 0. Own: the 2-gram [1,2] at 0..1 -> 7 8 2
    # (cap 3), rejected. The 1-gram [2]'s latest earlier end is 4 -> 5 6 (cap 2; full: 5 6 1).
    # m=2: 5 6 accepted, 3 tokens in one step. m=1 = current: 1 token, then at pos 2 the
    # 2-gram [2,5] -> 6 1 (depth 2 left), 6 accepted: 3 tokens in 2 steps.
    record = replay_mod.Record("qa", [1, 2, 7, 8, 2, 5, 6, 1], [2, 5, 6, 0])
    current = replay_mod.replay([record], NgramProposer(NgramConfig()), 16, 1)["qa"]
    rule = replay_mod.TopMRule
    one = replay_mod.replay_top_m([record], rule("length", "capped", 1), 16, 1)["qa"]
    two = replay_mod.replay_top_m([record], rule("length", "capped", 2), 16, 1)["qa"]
    two_full = replay_mod.replay_top_m([record], rule("vote", "full", 2), 16, 1)["qa"]
    assert (current.tokens, current.steps, current.drafted) == (3, 2, 5)
    assert (one.tokens, one.steps, one.drafted, one.rows, one.tree_rows) == (3, 2, 5, 7, 7)
    assert (two.tokens, two.steps, two.rows, two.tree_rows) == (3, 1, 6, 6)
    assert (two_full.tokens, two_full.steps, two_full.rows) == (3, 1, 7)


def test_top_m_one_equals_current_over_rounds_with_the_pool(replay_mod) -> None:  # type: ignore[no-untyped-def]
    records = [replay_mod.Record("chat", [1, 2, 3], [4, 1, 2, 3, 4, 1, 2, 5, 6, 7, 8]),
               replay_mod.Record("chat", [9, 9], [4, 1, 2, 5, 6, 7, 8, 4, 1, 2, 5]),
               replay_mod.Record("qa", [8, 8, 1], [2, 5, 6, 7, 1, 2, 3, 4, 1, 2, 5])]
    for depth in (4, 16):
        current = replay_mod.replay(records, NgramProposer(NgramConfig()), depth, 3)
        for ranking in replay_mod.RANKINGS:
            for lengths in replay_mod.LENGTH_RULES:
                rule = replay_mod.TopMRule(ranking, lengths, 1)
                top1 = replay_mod.replay_top_m(records, rule, depth, 3)
                for d in ("chat", "qa"):
                    assert (top1[d].tokens, top1[d].steps, top1[d].drafted) == (
                        current[d].tokens, current[d].steps, current[d].drafted)
                more = replay_mod.replay_top_m(
                    records, replay_mod.TopMRule(ranking, lengths, 8), depth, 3)
                assert all(more[d].steps <= top1[d].steps for d in ("chat", "qa"))
                if lengths == "full":  # uncapped candidates find runs the capped own misses
                    assert more["qa"].steps < top1["qa"].steps


def test_top_m_rule_is_checked(replay_mod) -> None:  # type: ignore[no-untyped-def]
    for bad in (("length", "capped", 0), ("best", "capped", 2), ("vote", "long", 2)):
        with pytest.raises(ValueError):
            replay_mod.TopMRule(*bad)


def test_gpu_step_price_is_the_fitted_line(replay_mod) -> None:  # type: ignore[no-untyped-def]
    price = replay_mod.gpu_step_ms
    assert price(1) == pytest.approx(0.512)  # no draft: no verify
    assert price(2) == pytest.approx(0.512 + 0.138 + 0.002)
    assert price(17) == pytest.approx(0.512 + 0.138 + 0.032)


def test_top_m_edges_no_candidates_and_nothing_to_step(replay_mod) -> None:  # type: ignore[no-untyped-def]
    index, pool = replay_mod._LatestEnds(4), replay_mod._candidate_pool()
    assert replay_mod.gather(index, pool, 1, 8, "full") == []  # empty context, empty pool
    index.sync([3, 4, 5])  # no n-gram occurs twice
    assert replay_mod.gather(index, pool, 1, 8, "full") == []
    assert replay_mod.rank([], [], "vote") == [()]
    # one output token: prefill samples it, no step; m above the candidates found is fine
    rule = replay_mod.TopMRule("vote", "full", 8)
    none = replay_mod.replay_top_m([replay_mod.Record("qa", [1, 2], [7])], rule, 16, 1)["qa"]
    assert (none.tokens, none.steps, none.rows) == (0, 0, 0)
    two = replay_mod.replay_top_m([replay_mod.Record("qa", [1, 2], [7, 8])], rule, 16, 1)["qa"]
    assert (two.tokens, two.steps, two.rows, two.drafted) == (1, 1, 1, 0)
