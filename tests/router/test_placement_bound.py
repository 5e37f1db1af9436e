"""The hindsight placement search (bench/sim/placement_bound.py) on a short window."""

from __future__ import annotations

from bench.sim.placement_bound import (
    SCORE_DT,
    SEARCH_DT,
    FixedPlacement,
    policy_placement,
    replay,
    score,
    search,
)
from bench.sim.prefix_mix_sim import CONTEXT_S, prefix_mix, rule_slos


def arrivals(rate: float = 14.0, num: int = 36) -> list:
    return prefix_mix(rate, num, 1, tight=True, slos=rule_slos(CONTEXT_S))


def test_a_recorded_placement_replays_to_the_policy_s_own_results() -> None:
    arr = arrivals()
    placement, results = policy_placement("adaptive", arr, SCORE_DT)
    assert len(placement) == len(arr) and set(placement) <= {"spec", "batch", "long"}
    again = replay(FixedPlacement(placement), arr, SCORE_DT)
    assert [(r.worker, r.ttft_s, r.tpot_s) for r in again] == \
        [(r.worker, r.ttft_s, r.tpot_s) for r in results]


def test_search_from_a_bad_placement_meets_more_slos_and_never_fewer() -> None:
    arr = arrivals()
    start = ["long"] * len(arr)  # everything on one worker: most requests miss
    start_score = score(replay(FixedPlacement(start), arr, SEARCH_DT))
    found = search(arr, start, seed=1, max_passes=1, movable=range(len(arr)), log=False)
    found_score = score(replay(FixedPlacement(found), arr, SEARCH_DT))
    assert found_score[0] > start_score[0] + len(arr) // 4
    assert set(found) > {"long"}
    # a request that may not move stays where it started
    pinned = search(arr, start, seed=1, max_passes=1, movable=range(10, len(arr)), log=False)
    assert pinned[:10] == start[:10]
    assert score(replay(FixedPlacement(pinned), arr, SEARCH_DT)) >= start_score


def test_only_the_scored_requests_count() -> None:
    arr = arrivals()
    results = replay(FixedPlacement(["batch"] * len(arr)), arr, SEARCH_DT)
    later = {id(s) for t, s in arr if t >= arr[len(arr) // 2][0]}
    met_all, met_later = score(results)[0], score(results, later)[0]
    assert met_later <= met_all
    assert met_later == sum(r.ttft_ok and r.tpot_ok for r in results if id(r.shape) in later)
