"""The cross-request output pool, alone and inside the n-gram proposer; answers written out."""

from __future__ import annotations

import pytest

from specdec.base import ProposalRequest
from specdec.errors import ProposerConfigError
from specdec.ngram import NgramConfig, NgramProposer
from specdec.pool import OutputPool


def test_longest_suffix_found_in_an_earlier_output() -> None:
    pool = OutputPool(100, 1, 3)
    pool.add(1, [7, 8, 9, 10, 11])
    assert pool.lookup([4, 7, 8], 2, 0, 2, None) == [9, 10]
    assert pool.lookup([4, 7, 8], 2, 0, 9, None) == [9, 10, 11]  # up to the end of the output
    assert pool.lookup([4, 5, 6], 2, 0, 2, None) == []


def test_weak_matches_are_capped_and_must_beat_the_context() -> None:
    pool = OutputPool(100, 1, 3)
    pool.add(1, [5, 1, 2, 3, 4, 6, 7, 8])
    assert pool.lookup([9, 9, 5], 2, 0, 6, 2) == [1, 2]  # a 1-token match: capped at 2
    assert pool.lookup([3, 4, 6], 2, 0, 3, 2) == [7, 8]  # a full (max_n) match: the whole k
    assert pool.lookup([9, 9, 5], 2, 1, 6, 2) == []  # the context already matched 1 token
    assert pool.lookup([2, 3, 4], 2, 2, 3, 2) == [6, 7, 8]  # 3 > 2: the pool wins


def test_never_proposes_an_output_of_the_same_prompt() -> None:
    pool = OutputPool(100, 1, 2)
    pool.add(1, [1, 2, 3])
    pool.add(2, [1, 2, 4])
    assert pool.lookup([1, 2], 1, 0, 1, None) == [4]  # prompt 1 gets prompt 2's continuation
    assert pool.lookup([1, 2], 2, 0, 1, None) == [3]  # and the other way round
    assert pool.lookup([1, 2], 3, 0, 1, None) == [4]  # a new prompt: the latest output
    pool.add(2, [9, 9])  # prompt 2 answered again: only its latest output stays
    assert pool.lookup([1, 2], 1, 0, 1, None) == []
    assert len(pool) == 2


def test_bounded_oldest_outputs_leave_and_are_never_proposed() -> None:
    pool = OutputPool(10, 1, 2)
    for key in range(20):
        pool.add(key, [100 + key, 200 + key, 300 + key, 400 + key])
        assert pool.num_tokens <= 10
    assert len(pool) == 2
    assert pool.lookup([100 + 19], None, 0, 2, None) == [219, 319]
    assert all(pool.lookup([100 + key], None, 0, 2, None) == [] for key in range(18))


def test_proposer_pools_outputs_of_finished_requests_only_with_a_known_prompt() -> None:
    proposer = NgramProposer(NgramConfig(min_n=1, max_n=2, weak_match_depth=None))
    prompt_a, prompt_b = [50, 51], [60, 61]
    proposer.propose([ProposalRequest(1, prompt_a + [1, 2, 3, 4], 2, num_prompt_tokens=2)])
    proposer.propose([ProposalRequest(9, [70, 1, 2, 3, 4], 2)])  # prompt length unknown
    assert proposer.pool is not None and len(proposer.pool) == 0  # nothing finished yet
    proposer.release(1)
    proposer.release(9)
    assert len(proposer.pool) == 1
    got = proposer.propose([ProposalRequest(2, prompt_b + [8, 2, 3], 3, num_prompt_tokens=2)])
    assert got[0].tokens == [4]  # [2, 3] is not in the context before; the pool has it
    same = proposer.propose([ProposalRequest(3, prompt_a + [8, 2, 3], 3, num_prompt_tokens=2)])
    assert same[0].tokens == []  # the same prompt never sees its own earlier answer


def test_a_context_match_at_least_as_long_wins() -> None:
    proposer = NgramProposer(NgramConfig(min_n=1, max_n=2, weak_match_depth=None))
    proposer.propose([ProposalRequest(1, [50, 1, 2, 9, 9], 2, num_prompt_tokens=1)])
    proposer.release(1)
    got = proposer.propose([ProposalRequest(2, [60, 1, 2, 7, 1, 2], 2, num_prompt_tokens=1)])
    assert got[0].tokens == [7, 1]  # the context's own [1, 2] match, not the pool's


def test_pool_off_and_bad_size() -> None:
    proposer = NgramProposer(NgramConfig(pool_tokens=0))
    proposer.propose([ProposalRequest(1, [50, 1, 2, 3], 2, num_prompt_tokens=1)])
    proposer.release(1)
    assert proposer.pool is None
    with pytest.raises(ProposerConfigError):
        NgramConfig(pool_tokens=-1)


def test_depth_caps_by_match_length() -> None:
    pool = OutputPool(100, 1, 4)
    pool.add(1, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    caps = NgramConfig().pool_depth_caps  # (0, 1, 1, 3)
    assert pool.lookup([0, 0, 0, 5], 2, 0, 8, None, caps) == []  # 1 token: cap 0
    assert pool.lookup([0, 0, 5, 6], 2, 0, 8, None, caps) == [7]  # 2 tokens: cap 1
    assert pool.lookup([0, 5, 6, 7], 2, 0, 8, None, caps) == [8]  # 3 tokens: cap 1
    assert pool.lookup([5, 6, 7, 8], 2, 0, 8, None, caps) == [9, 10, 11]  # 4 tokens: cap 3
    assert pool.lookup([5, 6, 7, 8], 2, 0, 2, None, caps) == [9, 10]  # never above k
    assert pool.lookup([5, 6, 7, 8], 2, 0, 8, None) == [9, 10, 11, 12, 13, 14, 5, 6][:6]


def test_proposer_falls_back_to_its_context_when_the_pool_cap_is_zero() -> None:
    proposer = NgramProposer(NgramConfig())  # pool caps (0, 1, 1, 3)
    proposer.propose([ProposalRequest(1, [50, 1, 2, 3, 4, 5], 4, num_prompt_tokens=1)])
    proposer.release(1)  # the pool now holds [1, 2, 3, 4, 5]
    # the context has no match for 3; the pool's 1-token match is capped at 0 tokens
    assert proposer.propose([ProposalRequest(2, [60, 3], 4, num_prompt_tokens=1)])[0].tokens == []
    # the context matches [2] (1 token: [9, 1], cap 2); the pool's longer [1, 2] wins, cap 1
    assert proposer.propose([ProposalRequest(3, [61, 2, 9, 1, 2], 4,
                                             num_prompt_tokens=1)])[0].tokens == [3]


def _drive(proposer: NgramProposer, flush_each_release: bool) -> list[list[int]]:
    """Requests 0..29 in turn, each proposed for and released; what every step proposed."""
    got = []
    for rid in range(30):
        prompt = [100 + rid, 101 + rid]
        out = [(rid * 7 + i * 3) % 11 for i in range(12)]
        for end in range(1, len(out) + 1):
            req = ProposalRequest(rid, prompt + out[:end], 4, num_prompt_tokens=2)
            got.append(proposer.propose([req])[0].tokens)
        proposer.release(rid)
        if flush_each_release:
            proposer.flush_pool()
    return got


def test_released_outputs_join_the_pool_before_the_next_proposal() -> None:
    config = NgramConfig(min_n=1, max_n=3, pool_tokens=100)  # small: evictions and rebuilds
    deferred, eager = NgramProposer(config), NgramProposer(config)
    assert _drive(deferred, False) == _drive(eager, True)
    assert deferred._unpooled and not eager._unpooled  # the last release waits for idle time
    assert deferred.pool is not None and eager.pool is not None
    assert len(deferred.pool) == len(eager.pool)  # reading the pool flushes
    assert not deferred._unpooled


def test_waiting_outputs_are_bounded_by_the_pool_size() -> None:
    proposer = NgramProposer(NgramConfig(pool_tokens=20))
    for rid in range(5):  # released, never followed by a proposal: the engine never idle
        proposer.propose([ProposalRequest(rid, [50 + rid] + list(range(8)), 2,
                                          num_prompt_tokens=1)])
        proposer.release(rid)
        assert proposer._num_unpooled <= 20
    assert proposer._pool is not None and len(proposer._pool) > 0
