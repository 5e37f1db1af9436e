"""The adaptive policy's cheaper per-request paths decide as the plain formulas would.

Each written-out path against the plain formula, on random inputs (bit-for-bit: the same
arithmetic in the same order), and a seeded simulator run against recorded decisions. The
RLS update's own comparison is in test_sym3.py. bench/router_cost.py compares whole trees
(``--baseline REV``).
"""

from __future__ import annotations

import random
from collections import Counter

from bench.sim import prefix_mix_sim as pm
from router.adaptive import AdaptiveConfig, AdaptivePolicy
from router.inflight import STALE_FACTOR, Flight, InFlight


def _random_flight(rng: random.Random, worker: str = "w", sent_s: float | None = None
                   ) -> Flight:
    slo_ttft = rng.choice((None, 0.0, rng.uniform(0.05, 1.0)))
    slo_tpot = rng.choice((None, 0.0, rng.uniform(0.001, 0.03)))
    return Flight(worker, rng.randint(0, 40), rng.randint(1, 32), rng.randint(0, 4),
                  rng.uniform(0, 10) if sent_s is None else sent_s, rng.uniform(0.001, 1.5),
                  rng.choice((rng.uniform(0.0005, 0.04), rng.uniform(0, 2e-4))),
                  rng.randint(1, 300), rng.uniform(0, 0.3),
                  slo_ttft, slo_tpot, rng.uniform(1, 5))


def _old_flight_cost(p: AdaptivePolicy, f: Flight, delay_s: float) -> float:
    cost_s = f.ttft_s + max(f.num_tokens - 1, 0) * f.tpot_s
    tpot_s = f.tpot_s + delay_s / max(f.num_tokens - 1, 1)
    penalty, _ = p._slo_of(f.slo_ttft_s, f.slo_tpot_s, f.ttft_s, tpot_s)
    return (cost_s + delay_s) * penalty


def test_flight_cost_s_is_the_plain_formula_bit_for_bit() -> None:
    rng = random.Random(1)
    for _ in range(5000):
        f = _random_flight(rng)
        assert f.cost_s == f.ttft_s + max(f.num_tokens - 1, 0) * f.tpot_s


def _populated(rng: random.Random, now: float) -> InFlight:
    flights = InFlight(10_000)
    for key in range(300):
        flights.add(key, _random_flight(rng, rng.choice("ab"), now - rng.uniform(0, 3)))
    return flights


def test_interference_is_the_old_loop_bit_for_bit() -> None:
    rng = random.Random(2)
    for trial in range(80):
        p, now = AdaptivePolicy(), 10.0
        p._inflight = _populated(rng, now)
        prefill = rng.choice((0.0, rng.uniform(0, 0.3)))
        cost = rng.choice((rng.uniform(0.01, 2), rng.uniform(0, 0.01)))
        crowd_s = rng.choice((0.0, rng.uniform(0, 1e-3)))
        old = 0.0
        if prefill > 0 or crowd_s > 0:
            for f in p._inflight.active("a", now):
                shared = min(max(f.sent_s + f.cost_s - now, 0.1 * f.cost_s), cost)
                delay = prefill + crowd_s * shared / max(f.tpot_s, 1e-4)
                old += _old_flight_cost(p, f, delay) - f.cost_s * f.penalty
        assert p._interference("a", now, prefill, crowd_s, cost) == old, trial


def test_prefill_ahead_and_activity_are_the_old_scans() -> None:
    rng = random.Random(3)
    for now in (9.0, 10.0, 11.5):
        flights = _populated(rng, 10.0)
        for worker in "ab":
            every = list(flights._by_worker[worker].values())
            active = [f for f in every
                      if now < f.sent_s + STALE_FACTOR * max(f.cost_s, 1e-3)]
            assert list(flights.active(worker, now)) == active
            old = sum(min(f.prefill_s, f.sent_s + f.ttft_s - now) for f in active
                      if now < f.sent_s + f.ttft_s)
            assert flights.prefill_ahead_s(worker, now) == old
            left = sorted(f.remaining_s(now) for f in active)
            for ahead in (1, len(left) // 2, len(left), len(left) + 7):
                want = left[ahead - 1] if ahead <= len(left) else \
                    left[-1] + (ahead - len(left)) / 8 * sum(f.cost_s for f in active) / len(active)
                assert flights.slot_wait_s(worker, now, ahead, 8, 0.5) == want


# recorded: prefix_mix(16 req/s, 240 requests, seed 1, tight), the default adaptive policy
# on the simulated bench fleet, by the cost model alone (confidence=None). Re-recorded when
# the experiment switches were deleted (the slot reserve, the stall pricing, the band TPOT
# prior, the measured-step batch scaling, exploring within the SLO, the depth headroom):
# the first 6 decisions are as before.
RECORDED_FIRST = [("batch", 0, "fit"), ("spec", 3, "fit"), ("long", 0, "load"),
                  ("spec", 2, "fit"), ("long", 0, "load"), ("batch", 0, "fit"),
                  ("batch", 0, "load"), ("batch", 0, "fit"), ("long", 0, "load"),
                  ("batch", 0, "fit"), ("long", 0, "fit"), ("spec", 0, "load")]
RECORDED_COUNTS = {
    ("batch", 0, "explore"): 1, ("batch", 0, "fit"): 31, ("batch", 0, "load"): 32,
    ("batch", 0, "slo"): 8, ("long", 0, "affinity"): 2, ("long", 0, "explore"): 6,
    ("long", 0, "fit"): 37, ("long", 0, "load"): 25, ("long", 0, "slo"): 1,
    ("spec", 0, "affinity"): 2, ("spec", 0, "fit"): 57, ("spec", 0, "load"): 27,
    ("spec", 0, "slo"): 3, ("spec", 2, "fit"): 1, ("spec", 2, "load"): 1,
    ("spec", 2, "slo"): 1, ("spec", 3, "fit"): 2, ("spec", 3, "load"): 3}


def test_simulated_decisions_match_the_recorded_ones() -> None:
    """A changed count here is a changed decision: find it and explain it (a near-tie
    moved by rounding) before re-recording."""
    log: list[tuple[str, int | None, str]] = []

    def make(clock: pm.SimClock) -> AdaptivePolicy:
        policy = AdaptivePolicy(AdaptiveConfig(confidence=None), clock=clock)
        choose = policy.choose

        def recording(shape, workers):  # type: ignore[no-untyped-def]
            d = choose(shape, workers)
            log.append((d.worker, d.spec_depth, d.reason))
            return d
        policy.choose = recording  # type: ignore[method-assign]
        return policy

    pm.run_results(make, pm.prefix_mix(16.0, 240, 1, tight=True))
    assert log[:len(RECORDED_FIRST)] == RECORDED_FIRST
    assert dict(Counter(log)) == RECORDED_COUNTS
