"""The look-ahead planner (bench/sim/lookahead_bound.py): its copies of the fleet are
exact and independent, and it places a request where nothing in the system misses."""

from __future__ import annotations

from bench.sim.fleet_sim import SimClock, _advance, simulate
from bench.sim.lookahead_bound import LookaheadPlanner, copy_worker, request_value
from bench.sim.placement_bound import SCORE_DT, SEARCH_DT
from bench.sim.prefix_mix_sim import CONTEXT_S, bench_fleet, prefix_mix, rule_slos
from router.base import RequestShape


def run_ahead(fleet: list, start: float, seconds: float) -> list[tuple[str, float, float]]:
    done, t = [], start
    while t < start + seconds:
        for w in fleet:
            done += [(w.name, r["first"], r["end"]) for r in _advance(w, t, SEARCH_DT)]
        t += SEARCH_DT
    return done


def test_a_copy_of_the_fleet_runs_as_the_fleet_does_and_leaves_it_untouched() -> None:
    arr = prefix_mix(14.0, 40, 1, tight=True, slos=rule_slos(CONTEXT_S))
    fleet, clock = bench_fleet(CONTEXT_S), SimClock()
    planner = LookaheadPlanner(fleet, clock)
    simulate(planner, fleet, arr[:20], 1.0, 1.0, dt=SEARCH_DT, clock=clock)
    # the run ended with the fleet drained; put the rest in flight, mid-way
    for i, (_, shape) in enumerate(arr[20:]):
        fleet[i % 3].waiting.append(
            {"shape": shape, "arrival": clock.now, "batch": 0, "left_prefill": None,
             "tokens": 0.0, "first": None, "depth": None})
    for w in fleet:
        _advance(w, clock.now, SEARCH_DT)
    before = [(w.name, len(w.running), len(w.waiting), dict(w.cache),
               [dict(r) for r in w.running]) for w in fleet]
    copies = [copy_worker(w) for w in fleet]
    ahead = run_ahead(copies, clock.now, 2.0)
    assert ahead  # the copies did run
    assert [(w.name, len(w.running), len(w.waiting), dict(w.cache),
             [dict(r) for r in w.running]) for w in fleet] == before
    assert run_ahead(fleet, clock.now, 2.0) == ahead


def test_the_planner_keeps_a_long_prompt_off_a_tight_decode() -> None:
    """Two workers each decode one request; ``spec``'s has a TPOT SLO that a long prompt's
    prefill chunks in its steps would break, ``batch``'s a loose one. Least-outstanding sees
    a tie; the planner sends the long prompt to ``batch``."""
    spec, batch, _ = bench_fleet(CONTEXT_S)
    fleet, clock = [spec, batch], SimClock()
    clock.now = 1.0
    for w, tpot_slo in ((spec, 0.004), (batch, 0.05)):
        shape = RequestShape("chat", 100, None, 60, slo_ttft_s=1.0, slo_tpot_s=tpot_slo)
        w.running.append({"shape": shape, "arrival": 0.9, "batch": 0, "left_prefill": 0.0,
                          "tokens": 5.0, "first": 0.95, "depth": None, "cached": 0.0})
    long = RequestShape("summarization", 1500, None, 20, slo_ttft_s=2.0, slo_tpot_s=0.05)
    planner = LookaheadPlanner(fleet, clock)
    assert planner.value(long, "batch", 1.0) == 3.0  # all three meet both SLOs
    assert planner.value(long, "spec", 1.0) < 2.0  # spec's own request misses
    assert planner.choose(long, [w.view() for w in fleet]).worker == "batch"


def test_request_value_counts_met_on_course_and_late() -> None:
    shape = RequestShape("chat", 100, None, 11, slo_ttft_s=0.2, slo_tpot_s=0.01)
    base = {"shape": shape, "arrival": 0.0, "tokens": 0.0, "first": None}
    assert request_value(base, 0.1) == 0.0  # not started, not late yet
    assert -0.1 < request_value(base, 0.5) < 0.0  # not started, already late
    assert request_value({**base, "first": 0.1, "tokens": 5.0}, 0.14) == 1.0  # on course
    assert request_value({**base, "first": 0.1, "end": 0.15}, 0.2) == 1.0  # met
    assert request_value({**base, "first": 0.1, "end": 0.5}, 0.6) < 0.0  # TPOT missed
    assert request_value({**base, "first": 0.5, "end": 0.55}, 0.6) < 0.0  # TTFT missed


def test_lookahead_runs_end_to_end_on_a_short_window() -> None:
    arr = prefix_mix(14.0, 30, 2, tight=True, slos=rule_slos(CONTEXT_S))
    fleet, clock, results = bench_fleet(CONTEXT_S), SimClock(), []
    simulate(LookaheadPlanner(fleet, clock, horizon_s=1.0), fleet, arr, 1.0, 1.0, dt=SCORE_DT,
             clock=clock, results=results)
    assert len(results) == len(arr) and {r.worker for r in results} <= {"spec", "batch", "long"}
