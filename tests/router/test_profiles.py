"""RLS, the config-derived prior and the blended per-worker profile, with answers written out."""

from __future__ import annotations

import random

import numpy as np
import pytest

from polyinfer.config import CompiledConfig, DeclaredFit
from router.profiles import (
    BayesianRLS,
    LatencyPrior,
    PriorConfig,
    WorkerProfile,
    prompt_band,
)


def test_rls_starts_at_the_prior_and_recovers_a_linear_function() -> None:
    rls = BayesianRLS((0.5, 0.0, 0.0), prior_variance=1.0, forgetting=1.0)
    assert rls.predict((1.0, 3.0, 3.0)) == pytest.approx(0.5)
    # y = 0.1 + 0.2 * x1 + 0.3 * x2, exercised in every direction
    xs = [(0, 0), (1, 0), (0, 1), (2, 3), (4, 1), (3, 3)] * 50
    for x1, x2 in xs:
        rls.update((1.0, x1, x2), 0.1 + 0.2 * x1 + 0.3 * x2)
    assert rls.predict((1.0, 5.0, 2.0)) == pytest.approx(0.1 + 1.0 + 0.6, abs=1e-2)


def test_rls_keeps_unexercised_slopes_at_the_prior() -> None:
    rls = BayesianRLS((0.02, 0.01, 0.16), prior_variance=1.0, forgetting=0.98)
    for _ in range(500):  # queue (x2) is always 0: only the intercept is observed
        rls.update((1.0, 0.1, 0.0), 0.05)
    w0, _, w2 = rls.coef
    assert w0 + 0.1 * rls.coef[1] == pytest.approx(0.05, rel=0.02)
    assert w2 == pytest.approx(0.16, rel=0.05)


def test_prompt_bands() -> None:
    assert [prompt_band(n) for n in (0, 255, 256, 1023, 1024, 5000)] == [0, 0, 1, 1, 2, 3]


def test_prior_from_config() -> None:
    p = PriorConfig(step_s=0.02, step_per_seq_s=0.002, prefill_s_per_token=0.0002,
                    spec_speedup=0.75, fit_bonus=0.5)
    cfg = CompiledConfig().with_engine(max_num_seqs=4, max_num_batched_tokens=256,
                                       spec_method="ngram")
    prior = LatencyPrior(cfg, p)
    # TPOT at batch 2 on a copy-heavy domain: (0.02 + 0.002 * 2) * 0.75
    assert prior.tpot_s("code", 10, 2, 3) == pytest.approx(0.018)
    assert prior.tpot_s("chat", 10, 2, 0) == pytest.approx(0.024)
    assert prior.tpot_s("chat", 10, 50, 0) == pytest.approx(0.028)  # batch capped at 4
    # TTFT of 512 tokens, queue 2: 0.02 + 0.512 * 1000 * (0.0002 + 0.02 / 256) + 2 * 0.02
    assert prior.ttft_s("chat", 512, 2) == pytest.approx(0.02 + 0.1024 + 0.04 + 0.04)
    # the default fit declares nothing; a declared fit halves the cost of covered shapes
    assert prior.factor("chat", 10) == 1.0
    fitted = LatencyPrior(CompiledConfig(fit=DeclaredFit(domains=("chat",))), p)
    assert fitted.tpot_s("chat", 10, 1, 0) == pytest.approx(0.5 * fitted.tpot_s("qa", 10, 1, 0))


def test_profile_moves_from_prior_to_measurements() -> None:
    prof = WorkerProfile(LatencyPrior(CompiledConfig(), PriorConfig()), forgetting=0.98)
    before = prof.predict("math", 100, 0, 1, 0)
    assert before.tpot_s == pytest.approx(0.02 + 0.002)
    for _ in range(200):
        prof.observe("math", 100, 0, 1, 0, ttft_s=0.5, tpot_s=0.1)
    after = prof.predict("math", 100, 0, 1, 0)
    assert after.tpot_s == pytest.approx(0.1, rel=0.02)
    assert after.ttft_s == pytest.approx(0.5, rel=0.02)
    assert after.num_samples == 200 and prof.num_samples("qa", 100) == 0
    # another domain has no samples of its own but starts from the worker-level fit
    assert prof.predict("qa", 100, 0, 1, 0).tpot_s == pytest.approx(0.1, rel=0.05)


def test_profile_ignores_bad_samples() -> None:
    prof = WorkerProfile(LatencyPrior(CompiledConfig(), PriorConfig()))
    prof.observe("qa", 10, 0, 1, 0, ttft_s=float("nan"), tpot_s=-1.0)
    assert prof.snapshot()["num_samples"] == 0


def test_ttft_counts_only_the_uncached_prompt_tokens() -> None:
    prof = WorkerProfile(LatencyPrior(CompiledConfig(), PriorConfig()))
    full = prof.predict("rag", 1500, 0, 1, 0)
    half = prof.predict("rag", 1500, 0, 1, 0, cached_tokens=750)
    fresh = prof.predict("rag", 750, 0, 1, 0)
    assert half.ttft_s < full.ttft_s and half.prefill_s == pytest.approx(full.prefill_s / 2)
    assert half.ttft_s == pytest.approx(fresh.ttft_s)  # the same band's prior here
    assert half.tpot_s == full.tpot_s  # decoding still attends over the whole prompt
    # a cached prompt still prefills its last token
    assert prof.predict("rag", 1500, 0, 1, 0, cached_tokens=5000).prefill_s > 0


def test_observe_learns_ttft_against_the_uncached_tokens() -> None:
    prof = WorkerProfile(LatencyPrior(CompiledConfig(), PriorConfig()))
    for _ in range(60):  # prefill cost: 0.5 s per 1000 computed tokens + 0.02 s
        prof.observe("rag", 2000, 0, 1, 0, ttft_s=0.02 + 0.5 * 1.0, tpot_s=0.01,
                     cached_tokens=1000)
        prof.observe("rag", 2000, 0, 1, 0, ttft_s=0.02 + 0.5 * 2.0, tpot_s=0.01)
    assert prof.predict("rag", 2000, 0, 1, 0).ttft_s == pytest.approx(1.02, rel=0.05)
    assert prof.predict("rag", 2000, 0, 1, 0, cached_tokens=1500).ttft_s == pytest.approx(
        0.27, rel=0.1)


def test_rls_bounds_an_outliers_pull_but_follows_a_real_shift() -> None:
    rls = BayesianRLS((0.02, 0.0, 0.0), prior_variance=1.0, forgetting=0.98)
    for _ in range(100):
        rls.update((1.0, 0.0, 0.0), 0.02)
    rls.update((1.0, 0.0, 0.0), 5.0)  # one 250x stall
    assert rls.predict((1.0, 0.0, 0.0)) < 0.03
    for _ in range(200):  # the worker really became 10x slower
        rls.update((1.0, 0.0, 0.0), 0.2)
    assert rls.predict((1.0, 0.0, 0.0)) == pytest.approx(0.2, rel=0.05)


def test_rls_stays_bounded_on_weakly_exciting_noisy_data() -> None:
    """Regression (a routing bench run): the old elementwise cap on P made it
    indefinite and a TPOT fit diverged to +-2e10. P must stay positive semi-definite."""
    rng = random.Random(0)
    for trial in range(5):
        rls = BayesianRLS((0.02, 0.016, 0.0), prior_variance=1.0, forgetting=0.98)
        for i in range(3000):  # batch and depth barely vary, heavy-tailed noise
            batch = rng.choice([1, 1, 2, 3, 8, 8, 8, 8]) if i < 1500 else 8
            depth = rng.choice([0, 0, 0, 1]) if i % 700 < 600 else 0
            rls.update((1.0, batch / 8, depth / 4),
                       0.004 + 0.001 * batch + rng.expovariate(1 / 0.004))
            assert np.linalg.eigvalsh(rls.p).min() >= -1e-9, (trial, i)
        assert max(abs(c) for c in rls.coef) < 0.05, trial
        assert rls.predict((1.0, 1.0, 0.0)) == pytest.approx(0.016, abs=0.004)
