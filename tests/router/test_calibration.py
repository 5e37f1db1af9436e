"""Calibration: the fleet-wide observed / prior ratio, and profiles that start from it."""

from __future__ import annotations

import math

import pytest

from polyinfer.config import CompiledConfig
from router.adaptive import AdaptiveConfig, AdaptivePolicy
from router.base import RequestOutcome, RequestShape, WorkerView
from router.calibration import Calibration
from router.profiles import LatencyPrior, PriorConfig, WorkerProfile


def test_factor_is_the_geometric_mean_of_the_ratios() -> None:
    cal = Calibration(weight=0.01)
    assert cal.factor("tpot") == 1.0
    for observed in (0.01, 0.04):  # ratios 0.5 and 2 against a 20 ms prior
        cal.observe("tpot", observed, 0.02)
    assert cal.factor("tpot") == pytest.approx(1.0)
    assert cal.factor("ttft") == 1.0  # the quantities are separate
    cal.observe("ttft", 0.3, 0.1)
    assert cal.factor("ttft") == pytest.approx(3.0)
    assert cal.num_samples("ttft") == 1 and cal.num_samples("tpot") == 2


def test_bad_samples_are_ignored_and_outliers_bounded() -> None:
    cal = Calibration()
    for observed, prior in ((0.0, 0.02), (-1.0, 0.02), (0.01, 0.0), (math.nan, 0.02),
                            (math.inf, 0.02)):
        cal.observe("tpot", observed, prior)
    assert cal.num_samples("tpot") == 0 and cal.factor("tpot") == 1.0
    cal.observe("tpot", 1e9, 1e-9)
    assert cal.factor("tpot") == pytest.approx(100.0)


def test_follows_a_drift_after_warm_up() -> None:
    cal = Calibration(weight=0.1)
    for _ in range(50):
        cal.observe("tpot", 0.01, 0.02)
    for _ in range(50):
        cal.observe("tpot", 0.04, 0.02)
    assert cal.factor("tpot") == pytest.approx(2.0, rel=0.02)


@pytest.mark.parametrize("weight", [0.0, -0.1, 1.5])
def test_bad_weight(weight: float) -> None:
    with pytest.raises(ValueError, match="weight"):
        Calibration(weight)


def test_unmeasured_profile_predicts_the_calibrated_prior() -> None:
    cal, prior = Calibration(), LatencyPrior(CompiledConfig(), PriorConfig())
    measured = WorkerProfile(prior, calibration=cal)
    fresh = WorkerProfile(LatencyPrior(CompiledConfig(), PriorConfig()), calibration=cal)
    raw = fresh.predict("chat", 100, 0, 1, 0)
    for _ in range(40):  # this machine is 2x faster than the prior says
        measured.observe("chat", 100, 0, 1, 0, ttft_s=raw.ttft_s / 2, tpot_s=raw.tpot_s / 2)
    calibrated = fresh.predict("chat", 100, 0, 1, 0)
    assert calibrated.tpot_s == pytest.approx(raw.tpot_s / 2, rel=0.05)
    assert calibrated.ttft_s == pytest.approx(raw.ttft_s / 2, rel=0.05)
    # its own first sample starts the fit from the calibrated prior, not the raw one
    fresh.observe("qa", 100, 0, 1, 0, ttft_s=raw.ttft_s / 2, tpot_s=raw.tpot_s / 2)
    assert fresh.predict("chat", 100, 0, 1, 0).tpot_s == pytest.approx(raw.tpot_s / 2, rel=0.1)


def test_identical_workers_share_load_after_one_learns() -> None:
    """Regression (bench/routing.py): one learned worker took all the traffic."""
    cfg = CompiledConfig().with_engine(max_num_seqs=8)
    views = [WorkerView(n, f"http://{n}", "engine", cfg) for n in ("a", "b")]
    policy = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0))
    for _ in range(30):  # only "a" has finished requests, 3x faster than the prior
        s = RequestShape("chat", 100, None, 50)
        raw = policy.profile(views[0]).prior
        policy.choose(s, views[:1])
        policy.observe(RequestOutcome("a", s, "ok", completion_tokens=50,
                                      ttft_s=raw.ttft_s("chat", 100, 0) / 3,
                                      tpot_s=raw.tpot_s("chat", 100, 1, 0) / 3))
    views[0].outstanding_requests = 2  # "a" is busy, "b" idle: "b" must look cheaper
    assert policy.choose(RequestShape("chat", 100, None, 50), views).worker == "b"
    b, a = (policy.candidate(RequestShape("chat", 100, None, 50), v) for v in views[::-1])
    assert b.unloaded_cost_s == pytest.approx(a.unloaded_cost_s, rel=0.25)


def test_ttft_is_calibrated_per_prompt_band() -> None:
    """Short prompts' TTFT (overhead) says nothing about a long prompt's (prefill)."""
    cal = Calibration()
    measured = WorkerProfile(LatencyPrior(CompiledConfig(), PriorConfig()), calibration=cal)
    fresh = WorkerProfile(LatencyPrior(CompiledConfig(), PriorConfig()), calibration=cal)
    raw_short, raw_long = (fresh.predict("chat", n, 0, 1, 0).ttft_s for n in (100, 1500))
    for _ in range(20):  # short prompts 5x slower than the prior, on the other worker
        measured.observe("chat", 100, 0, 1, 0, ttft_s=5 * raw_short, tpot_s=None)
    assert fresh.predict("chat", 100, 0, 1, 0).ttft_s == pytest.approx(5 * raw_short, rel=0.05)
    assert fresh.predict("chat", 1500, 0, 1, 0).ttft_s == pytest.approx(raw_long)
    assert cal.snapshot() == {"ttft/0": [pytest.approx(5.0, rel=1e-3), 20]}
