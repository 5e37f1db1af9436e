"""Closed-loop check of the adaptive policy against the baselines on a simulated fleet.

The fleet (bench/sim/fleet_sim.py) has the bench's two worker shapes: ``spec-small``
(4 sequences, speculation that makes code 2.5x faster) and ``batch-big`` (32 sequences,
slower steps that grow with the batch). Everything is seeded and time-stepped, so the
goodputs are deterministic; the values measured when this was written are in comments.
"""

from __future__ import annotations

import random

from bench.sim.fleet_sim import SimClock, SimWorker, poisson_mix, simulate
from polyinfer.config import CompiledConfig, DeclaredFit
from router.adaptive import AdaptiveConfig, AdaptivePolicy
from router.base import RequestShape
from router.baselines import LeastOutstandingPolicy, RoundRobinPolicy

SLO_TTFT_S, SLO_TPOT_S = 1.0, 0.06


def fleet() -> list[SimWorker]:
    small = CompiledConfig().with_engine(max_num_seqs=4, max_num_batched_tokens=256,
                                         spec_method="ngram")
    big = CompiledConfig().with_engine(max_num_seqs=32, max_num_batched_tokens=2048)
    return [SimWorker("spec-small", small, base_s=0.02, per_seq_s=0.002, prefill_s=0.0002,
                      factor={"code": 0.4, "extraction": 0.4}),
            SimWorker("batch-big", big, base_s=0.03, per_seq_s=0.002, prefill_s=0.0001)]


def goodputs(arrivals: list) -> tuple[float, float, float, AdaptivePolicy]:
    clock = SimClock()
    adaptive = AdaptivePolicy(clock=clock)
    return (simulate(RoundRobinPolicy(), fleet(), arrivals, SLO_TTFT_S, SLO_TPOT_S),
            simulate(LeastOutstandingPolicy(), fleet(), arrivals, SLO_TTFT_S, SLO_TPOT_S),
            simulate(adaptive, fleet(), arrivals, SLO_TTFT_S, SLO_TPOT_S, clock=clock), adaptive)


def test_mixed_domains_adaptive_beats_baselines() -> None:
    arrivals = poisson_mix(8.0, 400, {"code": 0.5, "chat": 0.5}, prompt=200, output=64, seed=1)
    rr, lo, ad, _ = goodputs(arrivals)
    # measured: rr 0.2375, lo 0.098, adaptive 0.395 (0.50 routing by cost alone, 0.3275
    # with a whole error band as the margin: the fallback to least-outstanding while the
    # model's error band hides a difference, see router.confidence, gives up part of the
    # gain for never losing to LO)
    assert ad >= 1.25 * rr and ad >= 1.5 * lo


def test_one_domain_favourite_saturates_and_traffic_spreads() -> None:
    """One domain whose favourite has 4 slots: the policy must spill, not herd.
    NOTE: adaptive's goodput here is at least-outstanding's level, not above it, and one
    seed alone is noise (seeds 1-8: adaptive 0.776-0.790, least-outstanding 0.788). So the
    goodput check is against both baselines on seeds 1-2 (measured: rr 0.653, lo 0.844,
    adaptive 0.790)."""
    totals = [0.0, 0.0, 0.0]
    for seed in (1, 2):
        arrivals = poisson_mix(8.0, 400, {"code": 1.0}, prompt=200, output=64, seed=seed)
        rr, lo, ad, adaptive = goodputs(arrivals)
        totals = [t + g / 2 for t, g in zip(totals, (rr, lo, ad), strict=True)]
        picks = adaptive.stats()["decisions"]
        # measured (seed 2): picks spec-small 263, batch-big 137, 'load' 123
        assert picks["spec-small"] >= 0.5 * 400  # the favourite for code ...
        assert picks["batch-big"] >= 0.2 * 400  # ... but not all of it: no herding
        assert adaptive.stats()["reasons"]["load"] >= 50
    rr, lo, ad = totals
    assert ad >= 1.2 * rr and ad >= 0.9 * lo


def chunked_fleet() -> list[SimWorker]:
    """An earlier bench fleet's shape, as a model: two interactive workers (8 seqs,
    128-token prefill chunks) and a bulk one (32 seqs, 2,048-token chunks, a cheaper
    per-sequence step); prefill shares the decode steps (fleet_sim ``chunk``)."""
    inter = CompiledConfig(fit=DeclaredFit(domains=("chat",))).with_engine(
        max_num_seqs=8, max_num_batched_tokens=128)
    bulk = CompiledConfig(fit=DeclaredFit(domains=("summarization",))).with_engine(
        max_num_seqs=32, max_num_batched_tokens=2048)
    return [SimWorker("i1", inter, base_s=0.005, per_seq_s=0.0008, prefill_s=0.00017, chunk=128),
            SimWorker("i2", inter, base_s=0.005, per_seq_s=0.0008, prefill_s=0.00017, chunk=128),
            SimWorker("bulk", bulk, base_s=0.005, per_seq_s=0.0004, prefill_s=0.00017,
                      chunk=2048)]


def long_short_mix(rate: float, num: int, seed: int) -> list[tuple[float, RequestShape]]:
    """30% 1,000-token prompts with a loose SLO, 70% short ones with a tight SLO."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        t += rng.expovariate(rate)
        if rng.random() < 0.3:
            out.append((t, RequestShape("summarization", 1000, None, 60, slo_ttft_s=0.9,
                                        slo_tpot_s=0.025)))
        else:
            out.append((t, RequestShape("chat", 60, None, 60, slo_ttft_s=0.15,
                                        slo_tpot_s=0.011)))
    return out


def test_pricing_prefill_interference_pays_on_a_chunked_prefill_fleet() -> None:
    """A model, not a measurement (bench/RESULTS.md has the measured runs). Means over
    seeds 1-4 at 12 req/s (one seed alone is noise); measured: adaptive 0.892, rr 0.857,
    lo 0.860."""
    totals: dict[str, float] = {}
    for seed in (1, 2, 3, 4):
        arrivals = long_short_mix(12.0, 400, seed)
        clock = SimClock()
        policy = AdaptivePolicy(AdaptiveConfig(), clock=clock)
        good = simulate(policy, chunked_fleet(), arrivals, 1.0, 1.0, clock=clock)
        totals["adaptive"] = totals.get("adaptive", 0.0) + good / 4
        for name, base in (("rr", RoundRobinPolicy()), ("lo", LeastOutstandingPolicy())):
            totals[name] = totals.get(name, 0.0) + simulate(
                base, chunked_fleet(), arrivals, 1.0, 1.0) / 4
    print(totals)
    assert totals["adaptive"] > max(totals["rr"], totals["lo"])
