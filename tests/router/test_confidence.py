"""router.confidence: the running prediction error, the error-band rule, and the adaptive
policy leaning on least-outstanding's pick where its model is unproven or poor."""

from __future__ import annotations

import math
import random

import pytest

from polyinfer.config import CompiledConfig
from router.adaptive import AdaptiveConfig, AdaptivePolicy
from router.base import RequestOutcome, RequestShape, WorkerView
from router.confidence import ConfidenceConfig, PredictionErrors

SMALL = CompiledConfig().with_engine(max_num_seqs=4, max_num_batched_tokens=256,
                                     spec_method="ngram", spec_max_depth=4)
BIG = CompiledConfig().with_engine(max_num_seqs=32, max_num_batched_tokens=2048)


def test_band_is_infinite_until_min_samples_then_the_rms_log_error() -> None:
    errors = PredictionErrors(ConfidenceConfig(min_samples=2))
    # one token: the end-to-end time is the TTFT alone
    errors.observe("w", "code", 100, (0.1, 0.01), (0.2, 0.01), 1)  # TTFT 2x, TPOT exact
    assert errors.band("w", "code", 100) == math.inf
    errors.observe("w", "code", 100, (0.1, 0.01), (0.05, 0.01), 1)  # TTFT 0.5x
    # mean of ln(2)^2 and ln(0.5)^2 = ln(2)^2: the RMS is ln 2; TPOT's is 0
    assert errors.band("w", "code", 100) == pytest.approx(math.log(2))
    # another prompt band or domain, unproven on its own: the worker's band over all shapes
    assert errors.band("w", "code", 2000) == pytest.approx(math.log(2))
    assert errors.band("w", "chat", 100) == pytest.approx(math.log(2))
    assert errors.band("v", "code", 100) == math.inf  # a worker with no outcomes
    snap = errors.snapshot()["w"]["code/0"]
    assert snap["ttft_bias_log"] == pytest.approx(0.0) and snap["num_tpot"] == 2
    assert errors.summary()["ttft_rms_log"] == pytest.approx(math.log(2), abs=1e-4)
    # a key with some outcomes of its own, but fewer than min_samples: the larger band
    errors.observe("w", "chat", 100, (0.1, 0.01), (0.4, 0.01), 1)  # TTFT 4x
    assert errors.band("w", "chat", 100) == pytest.approx(math.log(4))


def test_an_unmeasured_latency_is_skipped() -> None:
    errors = PredictionErrors(ConfidenceConfig(min_samples=1))
    errors.observe("w", "code", 100, (0.1, 0.01), (None, 0.02), 11)
    assert errors.band("w", "code", 100) == math.inf  # no end-to-end sample yet
    assert errors.snapshot()["w"]["code/0"]["num_tpot"] == 1
    # 11 tokens: predicted 0.1 + 10 x 0.01 = 0.2 s, measured 0.1 + 10 x 0.02 = 0.3 s
    errors.observe("w", "code", 100, (0.1, 0.01), (0.1, 0.02), 11)
    assert errors.band("w", "code", 100) == pytest.approx(math.log(1.5))


def test_distinguishable_needs_a_gap_wider_than_half_the_bands() -> None:
    errors = PredictionErrors()
    # bands 0.3 and 0.4 together: hypot = 0.5, half of it 0.25; the gap must exceed it in
    # log space
    assert errors.distinguishable(1.0, 0.3, math.exp(0.26), 0.4)
    assert not errors.distinguishable(1.0, 0.3, math.exp(0.24), 0.4)
    assert not errors.distinguishable(1.0, math.inf, 100.0, 0.0)
    assert errors.distinguishable(1.0, 0.0, 1.001, 0.0)  # an exact model: any real gap
    whole = PredictionErrors(ConfidenceConfig(margin_bands=1.0))  # a whole band: 0.5
    assert whole.distinguishable(1.0, 0.3, math.exp(0.51), 0.4)
    assert not whole.distinguishable(1.0, 0.3, math.exp(0.49), 0.4)


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        ConfidenceConfig(min_samples=0)
    with pytest.raises(ValueError):
        ConfidenceConfig(weight=0.0)
    with pytest.raises(ValueError):
        ConfidenceConfig(margin_bands=-0.1)


def views() -> list[WorkerView]:
    return [WorkerView("small", "http://s", "engine", SMALL),
            WorkerView("big", "http://b", "engine", BIG)]


def run(policy: AdaptivePolicy, ws: list[WorkerView], n: int, tpot_of: dict[str, float],
        scale_of: dict[str, float] | None = None) -> list[tuple[str, str]]:
    """``n`` code requests one at a time, each finishing before the next: the worker's
    TPOT as ``tpot_of`` says, TTFT 50 ms, both x ``scale_of`` (a model that mispredicts)."""
    out = []
    for _ in range(n):
        s = RequestShape("code", 100, None, 100)
        d = policy.choose(s, ws)
        out.append((d.worker, d.reason))
        k = (scale_of or {}).get(d.worker, 1.0)
        tpot = tpot_of[d.worker] * k
        policy.observe(RequestOutcome(d.worker, s, "ok", completion_tokens=100,
                                      ttft_s=0.05 * k, tpot_s=tpot, e2e_s=0.05 * k + 99 * tpot))
    return out


def test_unproven_model_balances_as_least_outstanding() -> None:
    policy = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0,
                                           confidence=ConfidenceConfig(min_samples=8)))
    picks = run(policy, views(), 8, {"small": 0.01, "big": 0.05})
    # nothing proven yet: LO's pick every time, and LO rotates between idle workers (where
    # LO's pick is the model's too, the model's reason stays)
    assert [w for w, _ in picks] == ["big", "small"] * 4
    assert [r for w, r in picks if w == "big"] == ["balance"] * 4
    assert policy.stats()["prediction_error"]["fleet"]["num_ttft"] == 8


def test_a_proven_model_routes_by_cost() -> None:
    policy = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0,
                                           confidence=ConfidenceConfig(min_samples=4)))
    ws = views()
    run(policy, ws, 40, {"small": 0.01, "big": 0.05})  # LO's picks teach both profiles
    late = run(policy, ws, 10, {"small": 0.01, "big": 0.05})
    # small is 5x faster per token, far beyond the learned error: the model's pick wins
    assert all(w == "small" for w, _ in late)
    err = policy.stats()["prediction_error"]["workers"]
    assert set(err) == {"small", "big"} and err["small"]["code/0"]["num_tpot"] > 4


def test_a_poor_model_keeps_balancing() -> None:
    policy = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0,
                                           confidence=ConfidenceConfig(min_samples=4)))
    ws = views()
    # each request's latency swings 8x at random: no profile predicts it. NOTE: at random,
    # not every other request: LO alternates between the two idle workers, so an
    # alternating swing would always land on the same one and make it look 8x slower.
    rng = random.Random(0)
    picks = []
    for _ in range(60):
        swing = rng.choice((1.0, 8.0))
        picks += run(policy, ws, 1, {"small": 0.01, "big": 0.012}, {"small": swing, "big": swing})
    late = picks[30:]
    # the two workers differ by 1.2x, well inside the error: LO's rotation goes on, and
    # wherever the model's pick differs from LO's, LO's goes
    assert sum(1 for _, r in late if r == "balance") >= 10
    assert min(sum(1 for w, _ in late if w == name) for name in ("small", "big")) >= 10
    assert policy.stats()["prediction_error"]["fleet"]["tpot_rms_log"] > 0.5
