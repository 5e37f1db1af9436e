"""The adaptive policy's depth for a request's own TPOT SLO in closed loop on the simulated
fleet (bench/sim/fleet_sim.py)
with speculation driven by the depth each request is sent at: one 4-slot n-gram worker
serving a rag-heavy mix (acceptance 0.1), where a step pays 1 ms for each speculating
sequence, so the depth policy runs the worker's mix at k=0 under load; a quarter of the
requests are translation (acceptance 0.8) with a 2 ms TPOT SLO that only speculation meets
(a k=0 step of four sequences takes ~3.1 ms). Seeded and time-stepped: a model, not a
measurement (the device A/B is in bench/RESULTS.md's routing settings table)."""

from __future__ import annotations

import random
from collections import Counter

from bench.sim.fleet_sim import SimClock, SimWorker, simulate
from polyinfer.config import CompiledConfig
from router.adaptive import AdaptiveConfig, AdaptivePolicy
from router.base import RequestShape

SEEDS = (1, 2)
RATE = 12.0  # req/s: ~3.5 of the 4 slots busy


def spec_worker() -> SimWorker:
    config = CompiledConfig().with_engine(max_num_seqs=4, max_num_batched_tokens=256,
                                          spec_method="ngram", spec_max_depth=4)
    return SimWorker("spec", config, base_s=0.0025, per_seq_s=0.00015, prefill_s=0.00002,
                     chunk=256, acceptance={"translation": 0.8, "rag": 0.1},
                     verify_s=0.0002, spec_seq_s=0.001)


def arrivals(seed: int, num: int = 360) -> list[tuple[float, RequestShape]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        t += rng.expovariate(RATE)
        if rng.random() < 0.25:
            shape = RequestShape("translation", 100, None, 64, slo_ttft_s=1.0, slo_tpot_s=0.002)
        else:
            shape = RequestShape("rag", 300, None, 64, slo_ttft_s=1.0, slo_tpot_s=0.02)
        out.append((t, shape))
    return out


def run(seed: int) -> Counter[str]:
    """Requests meeting both SLOs, per domain."""
    clock = SimClock()
    policy = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0), clock=clock)
    results: list = []
    simulate(policy, [spec_worker()], arrivals(seed), 1.0, 1.0, dt=0.0005, clock=clock,
             results=results)
    return Counter(r.shape.domain for r in results if r.ttft_ok and r.tpot_ok)


def test_a_tight_tpot_slo_gets_the_depth_that_meets_it_where_the_mix_depth_is_zero() -> None:
    """At the mix depth for every request, translation met 9 of 86 (seed 1) and 16 of 83
    (seed 2), rag 274 and 277."""
    for seed, mix_depth_met in zip(SEEDS, (9, 16), strict=True):
        met = run(seed)
        print(seed, dict(met))
        # measured: translation 53 and 55, rag 274 and 277
        assert met["translation"] >= 2 * mix_depth_met + 10
        assert met["rag"] >= 0.97 * 274
