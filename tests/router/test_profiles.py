"""RLS, the config-derived prior and the blended per-worker profile, with answers written out."""

from __future__ import annotations

import pytest

from engine.config import CompiledConfig, DeclaredFit
from router.affinity import PrefixAffinity
from router.profiles import (
    LatencyPrior,
    PriorConfig,
    RecursiveLeastSquares,
    WorkerProfile,
    prompt_band,
)


def test_rls_recovers_a_linear_function() -> None:
    rls = RecursiveLeastSquares(3, forgetting=1.0, delta=1e6)
    # y = 0.1 + 0.2 * x1 + 0.3 * x2
    for x1, x2 in [(0, 0), (1, 0), (0, 1), (2, 3), (4, 1), (3, 3)]:
        rls.update((1.0, x1, x2), 0.1 + 0.2 * x1 + 0.3 * x2)
    assert rls.predict((1.0, 5.0, 2.0)) == pytest.approx(0.1 + 1.0 + 0.6, abs=1e-4)


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
    # TTFT of 512 tokens with a 256-token prefill budget: 2 chunks * 0.02 + 512 * 0.0002
    assert prior.ttft_s("chat", 512, 0) == pytest.approx(0.1424)
    # declared fit halves the cost of covered shapes
    fitted = LatencyPrior(CompiledConfig(fit=DeclaredFit(domains=("chat",))), p)
    assert fitted.tpot_s("chat", 10, 1, 0) == pytest.approx(0.5 * fitted.tpot_s("qa", 10, 1, 0))


def test_profile_moves_from_prior_to_measurements() -> None:
    prof = WorkerProfile(LatencyPrior(CompiledConfig(), PriorConfig(weight_samples=8)),
                         forgetting=1.0)
    before = prof.predict("math", 100, 0, 1, 0)
    for _ in range(200):
        prof.observe("math", 100, 0, 1, 0, ttft_s=0.5, tpot_s=0.1)
    after = prof.predict("math", 100, 0, 1, 0)
    assert before.tpot_s == pytest.approx(0.022)
    assert after.tpot_s == pytest.approx(0.1, rel=0.05)
    assert after.ttft_s == pytest.approx(0.5, rel=0.05)
    assert after.num_samples == 200 and prof.num_samples("qa", 100) == 0
    # another domain shares the worker-level model but not the bucket
    assert prof.predict("qa", 100, 0, 1, 0).tpot_s > before.tpot_s


def test_profile_ignores_bad_samples() -> None:
    prof = WorkerProfile(LatencyPrior(CompiledConfig(), PriorConfig()))
    prof.observe("qa", 10, 0, 1, 0, ttft_s=float("nan"), tpot_s=-1.0)
    assert prof.snapshot()["num_samples"] == 0


def test_prefix_affinity_lru() -> None:
    aff = PrefixAffinity(capacity=3)
    aff.record((1, 2), "a")
    aff.record((1, 2, 3), "b")
    assert aff.lookup((1, 2, 3, 4)) == ("b", 3)
    assert aff.lookup((9,)) is None
    aff.record((7, 8), "c")  # evicts the oldest (hash 1)
    assert len(aff) == 3 and aff.lookup((1,)) is None
    aff.forget_worker("c")
    assert aff.lookup((1, 2, 3, 7, 8)) == ("b", 3)
