"""AdaptivePolicy: learned fit, load spreading (no herding), affinity, SLO, depth, stats."""

from __future__ import annotations

from collections import Counter

import pytest

from polyinfer.config import CompiledConfig
from router.adaptive import AdaptiveConfig, AdaptivePolicy
from router.base import RequestOutcome, RequestShape, RoutingPolicy, WorkerView
from specdec.policy import DepthPolicy, PolicyConfig

SMALL = CompiledConfig().with_engine(max_num_seqs=4, max_num_batched_tokens=256,
                                     spec_method="ngram", spec_max_depth=4)
BIG = CompiledConfig().with_engine(max_num_seqs=32, max_num_batched_tokens=2048)
# NOTE: these pin the cost model itself: routed by predicted cost alone, without the
# fallback to least-outstanding's pick while the model is unproven (router.confidence)
NO_EXPLORE = AdaptiveConfig(explore_prob=0.0, confidence=None)


def views() -> list[WorkerView]:
    return [WorkerView("small", "http://s", "engine", SMALL),
            WorkerView("big", "http://b", "engine", BIG)]


def shape(domain: str = "code", prompt: int = 100, out: int = 100, **kw: object) -> RequestShape:
    return RequestShape(domain, prompt, None, out, **kw)  # type: ignore[arg-type]


def teach(policy: AdaptivePolicy, ws: list[WorkerView], worker: str, domain: str,
          tpot_s: float, n: int = 30, ttft_s: float = 0.05) -> None:
    view = next(w for w in ws if w.name == worker)
    for _ in range(n):
        s = shape(domain)
        policy.choose(s, [view])
        policy.observe(RequestOutcome(worker, s, "ok", completion_tokens=100, ttft_s=ttft_s,
                                      tpot_s=tpot_s, e2e_s=ttft_s + 99 * tpot_s))


def test_implements_the_protocol() -> None:
    assert isinstance(AdaptivePolicy(), RoutingPolicy)


def test_learns_which_worker_fits_each_domain() -> None:
    p, ws = AdaptivePolicy(NO_EXPLORE), views()
    teach(p, ws, "small", "code", 0.01)
    teach(p, ws, "big", "code", 0.05)
    teach(p, ws, "small", "chat", 0.06)
    teach(p, ws, "big", "chat", 0.02)
    assert p.choose(shape("code"), ws).worker == "small"
    assert p.choose(shape("chat"), ws).worker == "big"
    assert p.stats()["reasons"]["fit"] == 2


def test_does_not_herd_when_the_favourite_saturates() -> None:
    p, ws = AdaptivePolicy(NO_EXPLORE), views()
    teach(p, ws, "small", "code", 0.01)
    teach(p, ws, "big", "code", 0.03)
    picks: Counter[str] = Counter()
    for _ in range(40):  # all one domain, nothing finishes: outstanding keeps growing
        d = p.choose(shape("code"), ws)
        picks[d.worker] += 1
        next(w for w in ws if w.name == d.worker).outstanding_requests += 1
    # small is 3x faster per request (e2e ~1.05 s vs ~3.0 s at batch 1): it takes the first
    # 7 (4 slots, then a queue while waiting there still beats big), and from then on each
    # worker's predicted cost grows with its own load, so they alternate
    assert picks["small"] >= 7 and picks["big"] >= 20
    assert p.stats()["reasons"].get("load", 0) >= 20


def test_scraped_queue_counts_as_load() -> None:
    p, ws = AdaptivePolicy(NO_EXPLORE), views()
    teach(p, ws, "small", "code", 0.01)
    teach(p, ws, "big", "code", 0.03)
    ws[0].running, ws[0].waiting = 4, 20  # another proxy filled it
    d = p.choose(shape("code"), ws)
    assert d.worker == "big" and d.reason == "load"


def test_slo_steers_away_from_a_worker_that_would_miss_it() -> None:
    p, ws = AdaptivePolicy(NO_EXPLORE), views()
    teach(p, ws, "small", "qa", tpot_s=0.010, ttft_s=1.0)  # fast tokens, slow first token
    teach(p, ws, "big", "qa", tpot_s=0.020, ttft_s=0.2)
    # no SLO: lowest e2e wins (small ~1.0 + 199 * 0.010 = 3.0 s; big ~0.2 + 199 * 0.02 = 4.2 s)
    assert p.choose(shape("qa", out=200), ws).worker == "small"
    # TTFT SLO 0.5 s: small's predicted 1.0 s misses it by 100% -> cost x (1 + 4 * 1.0)
    d = p.choose(shape("qa", out=200, slo_ttft_s=0.5), ws)
    assert (d.worker, d.reason) == ("big", "slo")


def test_depth_comes_from_the_depth_policy_and_client_depth_is_capped() -> None:
    dp = DepthPolicy(PolicyConfig(prior_acceptance=0.9))
    p, ws = AdaptivePolicy(NO_EXPLORE, depth_policy=dp), views()
    d_small = p.candidate(shape("code"), ws[0]).depth
    assert d_small == dp.decide("small", "code", 1, 4) and d_small > 0
    assert p.candidate(shape("code"), ws[1]).depth == 0  # big does not speculate
    assert p.candidate(shape("code", speculative_depth=9), ws[0]).depth == 4
    ext = WorkerView("vllm", "http://v", "vllm", CompiledConfig(backend="vllm"))
    assert p.candidate(shape("code"), ext).depth is None


def test_only_the_picked_worker_records_the_depth_decision() -> None:
    """Every candidate is priced at its depth, but only the pick counts toward its k=0
    probe (and its domain mix): pricing a worker must not probe it or steer a request."""
    # speculation is free under this step prior, so every committed decision is k=4 unless
    # it is the worker's every-10th k=0 probe
    dp = DepthPolicy(PolicyConfig(max_depth=4, step_prior_s=(0.010, 0.0, 0.0, 0.0),
                                  step_prior_weight=1e12))
    p = AdaptivePolicy(NO_EXPLORE, depth_policy=dp)
    a = WorkerView("a", "http://a", "engine", SMALL)
    b = WorkerView("b", "http://b", "engine", SMALL, running=4, waiting=20)  # a wins
    both = [p.choose(shape("code"), [a, b]) for _ in range(15)]
    assert {d.worker for d in both} == {"a"}
    assert [i + 1 for i, d in enumerate(both) if d.spec_depth == 0] == [10]  # a's 10th
    # b was priced 15 times and picked never: its own 10th request is its first probe
    alone = [p.choose(shape("code"), [b]) for _ in range(10)]
    assert [i + 1 for i, d in enumerate(alone) if d.spec_depth == 0] == [10]
    assert [d.spec_depth for d in alone[:9]] == [4] * 9


def test_observe_feeds_acceptance_to_the_depth_policy() -> None:
    dp = DepthPolicy()
    p, ws = AdaptivePolicy(NO_EXPLORE, depth_policy=dp), views()
    before = dp.acceptance("small", "code").mean
    s = shape("code")
    p.choose(s, [ws[0]])
    p.observe(RequestOutcome("small", s, "ok", completion_tokens=200, ttft_s=0.05, tpot_s=0.01,
                             e2e_s=1.0, spec_depth=4, spec_draft_tokens=120,
                             spec_accepted_tokens=90))
    est = dp.acceptance("small", "code")
    assert est.mean != before and est.alpha + est.beta > 8  # the prior's 8 pseudo-tokens + data


def test_observe_feeds_depth_0_requests_to_the_depth_policy_too() -> None:
    dp = DepthPolicy()
    p, ws = AdaptivePolicy(NO_EXPLORE, depth_policy=dp), views()
    s = shape("code")
    p.choose(s, [ws[1]])  # big does not speculate: depth 0
    p.observe(RequestOutcome("big", s, "ok", completion_tokens=101, ttft_s=0.05, tpot_s=0.01,
                             e2e_s=1.05, spec_depth=0))
    # 100 tokens after the first in 1.0 s: 10 ms a token at depth 0, batch 1
    assert dp.step_time("big").token_costs[(1, 0)][:3] == pytest.approx([0.010, 1.0, 1.0])


def test_exploration_rate_and_reason_counts() -> None:
    p, ws = AdaptivePolicy(AdaptiveConfig(explore_prob=0.2), seed=1), views()
    for _ in range(500):
        p.choose(shape("code"), ws)
    st = p.stats()
    assert 60 <= st["reasons"]["explore"] <= 140
    assert sum(st["reasons"].values()) == 500 == sum(st["decisions"].values())


def _explored(config: AdaptiveConfig, slo_tpot_s: float | None) -> Counter[str]:
    """Where 300 exploring-prone decisions went, ``small`` taught at 2 ms a token and
    ``big`` at 20 ms; each request finishes before the next (no load)."""
    p, ws = AdaptivePolicy(config, seed=3), views()
    teach(p, ws, "small", "code", 0.002)
    teach(p, ws, "big", "code", 0.020)
    went: Counter[str] = Counter()
    for _ in range(300):
        s = shape("code", slo_tpot_s=slo_tpot_s)
        d = p.choose(s, ws)
        tpot = 0.002 if d.worker == "small" else 0.020
        p.observe(RequestOutcome(d.worker, s, "ok", completion_tokens=100, ttft_s=0.05,
                                 tpot_s=tpot, e2e_s=0.05 + 99 * tpot))
        if d.reason == "explore":
            went[d.worker] += 1
    return went


def test_exploration_goes_to_any_unsaturated_worker() -> None:
    # a 5 ms TPOT SLO: small meets it, big (20 ms) does not; exploring tries big all the same
    assert _explored(AdaptiveConfig(explore_prob=0.3), 0.005)["big"] >= 20  # ~45 of 300
    assert _explored(AdaptiveConfig(explore_prob=0.3), None)["big"] >= 20


def test_single_candidate_and_bad_outcomes() -> None:
    p, ws = AdaptivePolicy(), views()
    assert p.choose(shape(), ws[:1]).reason == "only"
    p.observe(RequestOutcome("nobody", shape(), "ok", ttft_s=0.1, tpot_s=0.1))
    p.observe(RequestOutcome("small", shape(), "error"))
    p.observe(RequestOutcome("small", shape(), "ok", ttft_s=float("inf"), tpot_s=None))


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        AdaptiveConfig(explore_prob=1.5)


def test_non_streamed_outcomes_teach_tpot_from_e2e() -> None:
    p, ws = AdaptivePolicy(NO_EXPLORE), views()
    for _ in range(100):
        s = shape("chat", out=101)
        p.choose(s, [ws[1]])
        # e2e 2.05 s for 101 tokens, no TTFT seen: TPOT ~ (2.05 - predicted TTFT) / 100
        p.observe(RequestOutcome("big", s, "ok", completion_tokens=101, e2e_s=2.05))
    pred = p.profile(ws[1]).predict("chat", 100, 0, 1, 0)
    assert pred.tpot_s == pytest.approx(0.02, rel=0.05)
    assert p.stats()["profiles"]["big"]["num_samples"] == 100


def test_a_non_streamed_outcome_faster_than_the_predicted_ttft_still_teaches_tpot() -> None:
    p, ws = AdaptivePolicy(NO_EXPLORE), views()
    s = shape("chat", out=6)
    p.choose(s, [ws[1]])
    pred = p.profile(ws[1]).predict("chat", 100, 0, 1, 0)
    e2e = pred.ttft_s / 2  # the whole request took half the TTFT the prior predicts
    p.observe(RequestOutcome("big", s, "ok", completion_tokens=6, e2e_s=e2e))
    assert p.stats()["profiles"]["big"]["num_samples"] == 1  # before: TPOT 0, sample dropped


def test_profile_survives_equal_config_copies_and_resets_on_a_new_config() -> None:
    import dataclasses

    p, ws = AdaptivePolicy(NO_EXPLORE), views()
    teach(p, ws, "small", "code", 0.01, n=5)
    same = WorkerView("small", "http://s", "engine", dataclasses.replace(SMALL))
    assert p.profile(same).num_samples("code", 100) == 5  # an equal copy: kept
    retuned = WorkerView("small", "http://s", "engine", SMALL.with_engine(max_num_seqs=8))
    assert p.profile(retuned).num_samples("code", 100) == 0  # optimizer reload: relearn


def test_slo_depth_speculates_for_a_tight_tpot_that_the_mix_depth_would_miss() -> None:
    """A request whose TPOT SLO the worker's mix depth (k=0 here: a rag-heavy mix) would miss
    goes at the depth fastest for its own domain, its TPOT scaled by the depth policy's
    token times; a request that meets its SLO, or has none, keeps the mix depth."""
    dp = DepthPolicy(PolicyConfig(max_depth=4, step_prior_s=(0.010, 0.0005, 0.001375, 0.0005),
                                  step_prior_weight=1e12,
                                  domain_priors=(("translation", 0.9), ("rag", 0.05))))
    for _ in range(50):
        dp.commit("spec", "rag", 4, 0)
    spec = WorkerView("spec", "http://s", "engine", SMALL, running=3)  # a batch of 4
    on = AdaptivePolicy(NO_EXPLORE, depth_policy=dp)
    times = dp.token_times("spec", "translation", 4, 4)
    own = min(range(5), key=times.__getitem__)
    assert own > 0

    # TPOT at the mix depth (k=0), as the profile predicts it for a batch of 4
    mix_tpot_s = on.profile(spec).predict("translation", 100, 3, 4, 0).tpot_s
    tight = shape("translation", slo_tpot_s=1e-6)  # missed at any depth: the fastest one
    fast = on.candidate(tight, spec)
    assert fast.depth == own
    assert fast.tpot_s == pytest.approx(mix_tpot_s * times[own] / times[0])

    for s in (shape("translation", slo_tpot_s=10.0), shape("translation")):  # met; no SLO
        assert on.candidate(s, spec).depth == 0
        assert on.candidate(s, spec).tpot_s == pytest.approx(mix_tpot_s)
    # a client's own depth is never overridden
    assert on.candidate(shape("translation", slo_tpot_s=1e-6, speculative_depth=1), spec).depth == 1
    # and the pick records the depth it goes at
    assert on.choose(tight, [spec]).spec_depth == own

    # predicted within its SLO at the mix depth, if only just: the mix depth
    assert on.candidate(shape("translation", slo_tpot_s=mix_tpot_s / 0.9), spec).depth == 0


def test_the_proxy_cap_is_the_worker_capacity() -> None:
    """A worker behind a proxy ``max_outstanding`` cap below its batch slots holds no more
    than the cap: at it, a request would wait for a slot there."""
    policy = AdaptivePolicy(seed=0)
    ws = views()
    big = ws[1]
    big.outstanding_requests = 2
    assert not policy.candidate(shape(), big).saturated
    big.max_outstanding = 2
    cand = policy.candidate(shape(), big)
    assert cand.saturated and cand.capacity == 2
