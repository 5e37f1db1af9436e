"""The engine's per-step feed into the policy's step-time model (specdec.step_feed)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.metrics import EngineMetrics
from specdec.policy import DepthPolicy, PolicyConfig, choose_depth
from specdec.step_feed import DecodeStep, StepFeed, StepSums, parse_step_sums
from specdec.step_model import NUM_FEATURES, StepTimeModel, step_features


def _true_t(b: int, num_drafted: int, max_drafted: int, num_prefill: int = 0) -> float:
    # 3 ms + 1 ms per sequence + 0.3 ms per draft token + 0.75 ms once anything is proposed
    # + 0.1 ms per prompt token of a prefill chunk in the same step + 0.2 ms per sequence
    # verifying a proposal (here every sequence, once anything is proposed)
    return (0.003 + 0.001 * b + 0.0003 * num_drafted + (0.00075 if max_drafted else 0.0)
            + 0.0001 * num_prefill + (0.0002 * b if max_drafted else 0.0))


def _steps() -> list[DecodeStep]:
    return [DecodeStep(b, b * k, k, _true_t(b, b * k, k, p), p)
            for b in (1, 2, 4, 8, 16) for k in (0, 1, 2, 4, 8) for p in (0, 0, 0, 512)]


def test_sums_are_the_weighted_normal_equations() -> None:
    steps = _steps()
    sums = StepSums()
    for s in steps:
        sums.add(s)
    x = np.array([step_features(s.num_seqs, s.num_drafted, s.max_drafted, s.num_prefill,
                                s.num_seqs if s.max_drafted else 0) for s in steps])
    y = np.array([s.seconds for s in steps])
    w = 1.0 / y**2
    xtx, xty = sums.matrices()
    np.testing.assert_allclose(xtx, (x * w[:, None]).T @ x, rtol=1e-12)
    np.testing.assert_allclose(xty, (x * w[:, None]).T @ y, rtol=1e-12)
    assert sums.num_steps == len(steps)
    assert sums.num_prefill == 512 * len(steps) / 4


def test_bad_steps_are_not_added() -> None:
    sums = StepSums()
    sums.add(DecodeStep(0, 0, 0, 0.01))
    sums.add(DecodeStep(2, 0, 0, 0.0))
    sums.add(DecodeStep(2, 0, 0, float("nan")))
    assert sums.num_steps == 0 and not any(sums.values)


def test_engine_exposition_round_trips_and_the_policy_recovers_the_step_time() -> None:
    metrics = EngineMetrics("tiny")
    for s in _steps() * 5:
        metrics.decode_steps.add(s)
    text = metrics.expose().decode()
    parsed = parse_step_sums(text)
    assert parsed is not None and parsed.num_steps == 500 and parsed.num_prefill == 125 * 512
    np.testing.assert_allclose(parsed.values, metrics.decode_steps.values, rtol=1e-12)

    policy = DepthPolicy(PolicyConfig(step_feed_decay=1.0))
    assert StepFeed(policy).on_metrics("w", text) == 500
    model = policy.step_time("w")
    assert model.num_fed_steps == 500 and model.mean_prefill == 128.0
    # the prior (4 pseudo-samples against 500 steps) moves the fit by about 1%
    np.testing.assert_allclose(model.coef,
                               [0.003, 0.001, 0.0003, 0.0, 0.00075, 0.0001, 0.0002],
                               rtol=0.02, atol=1e-6)
    assert model.predict(16, 4, prefill=0) == pytest.approx(_true_t(16, 64, 4), rel=0.01)
    # by default a step is priced beside the mean prefill its decode steps shared
    assert model.predict(16, 4) == pytest.approx(_true_t(16, 64, 4, 128), rel=0.01)


def test_feed_takes_only_new_steps_and_survives_a_restart() -> None:
    metrics = EngineMetrics("tiny")
    policy = DepthPolicy()
    feed = StepFeed(policy)
    assert feed.on_metrics("w", metrics.expose().decode()) == 0  # no steps yet
    assert feed.on_metrics("w", "vllm:num_requests_running 1\n") == 0  # no feed at all
    for s in _steps():
        metrics.decode_steps.add(s)
    assert feed.on_metrics("w", metrics.expose().decode()) == 100
    assert feed.on_metrics("w", metrics.expose().decode()) == 0  # nothing new
    metrics.decode_steps.add(DecodeStep(4, 8, 2, 0.01))
    assert feed.on_metrics("w", metrics.expose().decode()) == 1
    restarted = EngineMetrics("tiny")
    for s in _steps()[:3]:
        restarted.decode_steps.add(s)
    assert feed.on_metrics("w", restarted.expose().decode()) == 3
    assert policy.step_time("w").num_fed_steps == 104


def test_parse_sums_label_sets_and_skips_garbage() -> None:
    text = "\n".join([
        '# TYPE polyinfer:decode_step_fit_total counter',
        'polyinfer:decode_step_fit_total{model_name="a",term="steps"} 2.0',
        'polyinfer:decode_step_fit_total{model_name="b",term="steps"} 3.0',
        'polyinfer:decode_step_fit_total{model_name="a",term="xty_1"} 1.5',
        'polyinfer:decode_step_fit_total{model_name="b",term="prefill_tokens"} 64.0',
        'polyinfer:decode_step_fit_total{model_name="a",term="xty_9"} 7.0',  # unknown term
        'polyinfer:decode_step_fit_total{model_name="a",term="xtx_0_0"} not-a-number',
    ])
    sums = parse_step_sums(text)
    assert sums is not None and sums.num_steps == 5.0 and sums.num_prefill == 64.0
    _, xty = sums.matrices()
    assert xty == [0.0, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_engine_steps_replace_the_client_averages() -> None:
    # Client averages that say depth is free (t flat in k) ...
    model = StepTimeModel.from_prior((0.010, 0.0005, 0.0003, 0.0005), 4.0)
    for _ in range(50):
        for k in (0, 2, 4):
            model.observe(16, k, 0.030)
    assert model.predict(16, 4) / model.predict(16, 0) < 1.1
    # ... then the engine reports 200 steps where each k at batch 16 costs 4.8 ms.
    sums = StepSums()
    for s in _steps() * 2:
        sums.add(s)
    xtx, xty = sums.matrices()
    model.observe_sums(xtx, xty, int(sums.num_steps), sums.num_prefill)
    assert model.predict(16, 4) / model.predict(16, 0) == pytest.approx(
        _true_t(16, 64, 4, 128) / _true_t(16, 0, 0, 128), rel=0.03)
    model.observe(16, 4, 0.030)  # later client averages no longer enter the fit
    assert model.num_samples == 150


def test_feed_decay_forgets_old_steps() -> None:
    model = StepTimeModel.from_prior((0.010, 0.0005, 0.0003, 0.0005), 4.0, feed_decay=0.99)

    def feed(scale: float) -> None:
        sums = StepSums()
        for s in _steps() * 6:
            sums.add(DecodeStep(s.num_seqs, s.num_drafted, s.max_drafted, s.seconds * scale,
                                s.num_prefill))
        xtx, xty = sums.matrices()
        model.observe_sums(xtx, xty, int(sums.num_steps))

    feed(1.0)
    # the machine got twice as slow: 600 steps at 0.99 leave 0.2% of the old weight (x4, as
    # twice-as-slow steps weigh 1/4 in a relative-error fit)
    feed(2.0)
    assert model.predict(4, 2, prefill=0) == pytest.approx(2.0 * _true_t(4, 8, 2), rel=0.1)


def test_observe_sums_rejects_malformed_input() -> None:
    model = StepTimeModel.from_prior((0.010, 0.0005, 0.0003, 0.0005), 4.0)
    before = model.coef.copy()
    model.observe_sums([[1.0]], [1.0], 3)
    model.observe_sums(np.full((NUM_FEATURES, NUM_FEATURES), np.nan), np.zeros(NUM_FEATURES), 3)
    model.observe_sums(np.eye(NUM_FEATURES), np.zeros(NUM_FEATURES), 0)
    assert model.num_fed_steps == 0
    np.testing.assert_array_equal(model.coef, before)


def test_the_clients_wait_beyond_the_engine_step_favours_a_deeper_k() -> None:
    model = StepTimeModel.from_prior((0.010, 0.0005, 0.0003, 0.0005), 4.0)
    sums = StepSums()
    for s in _steps() * 2:
        if not s.num_prefill:  # pure decode steps: predictions carry no prefill share
            sums.add(s)
    xtx, xty = sums.matrices()
    model.observe_sums(xtx, xty, int(sums.num_steps), sums.num_prefill)
    # batch 1: t(k) = 4 ms + 0.3 ms per draft token + 0.75 ms if k > 0; depth 8 measured
    # better than 3..7 (an n-gram run accepted whole)
    tokens = [1.0, 1.5, 2.2, 2.25, 2.25, 2.25, 2.25, 2.25, 2.8]
    assert model.overhead(1) == 0.0
    # E / t: k=2 2.2 / 5.35 ms = 0.411 per ms, k=3 0.398, k=8 2.8 / 7.15 = 0.392
    assert choose_depth(0.5, 1, model, 8, tokens_per_step=tokens) == 2
    for _ in range(10):  # clients see 3 ms more per step than the engine's steps take
        for k in (0, 2, 8):
            model.observe(1, k, _true_t(1, k, k) + 0.003, float(k))
    assert model.overhead(1) == pytest.approx(0.003, rel=0.05)
    assert model.overhead(2) == model.overhead(1)  # the nearest measured batch size
    assert model.num_samples == 0  # the fit itself is still the engine's
    # with 3 ms per step more: k=2 2.2 / 8.35 = 0.263, k=3 0.260, k=8 2.8 / 10.15 = 0.276
    assert choose_depth(0.5, 1, model, 8, tokens_per_step=tokens) == 8
    for _ in range(100):  # a residual below zero (noise) never makes steps cheaper
        model.observe(16, 0, _true_t(16, 0, 0) * 0.5)
    assert model.overhead(16) == 0.0 and model.overhead(1) > 0.0


def _host_bound_ms(b: int, k: int) -> float:
    """A GPU step whose replay hardly grows with rows, so host work per speculating
    sequence dominates what depth costs: 0.5 ms + 0.05 ms per sequence, and at k > 0
    0.05 ms once + 0.08 ms per sequence verifying + 0.002 ms per draft token (k / 2
    drafted per sequence: proposals run short of k)."""
    if k == 0:
        return 0.5 + 0.05 * b
    return 0.5 + 0.05 * b + 0.05 + 0.08 * b + 0.002 * b * k / 2


def test_the_cost_per_verifying_sequence_stops_speculation_under_load() -> None:
    """t(1, 8) / t(1, 0) = 0.688 / 0.55 = 1.251 and t(16, 8) / t(16, 0) = 2.758 / 1.3 =
    2.122. At qa-like 2.0 tokens per step from k=4 on, speculation pays at batch 1
    (2.0 / (0.684 / 0.55) = 1.61x at k=4) and loses at batch 16 (at best 1.8 / (2.694 /
    1.3) = 0.87x at k=2): k=0 there. Without the feature per verifying sequence the
    line puts that cost on the draft tokens and the batch, and misprices both."""
    steps = [DecodeStep(b, b * k // 2, k // 2, _host_bound_ms(b, k) / 1e3, 0,
                        b if k else 0)
             for _ in range(20) for b in (1, 2, 4, 8, 16) for k in (0, 2, 4, 8)]
    sums = StepSums()
    for s in steps:
        sums.add(s)
    model = StepTimeModel.from_prior(PolicyConfig().step_prior_s, 4.0)
    xtx, xty = sums.matrices()
    model.observe_sums(xtx, xty, int(sums.num_steps))
    for b, k in ((1, 8), (16, 8), (16, 2)):
        ratio = _host_bound_ms(b, k) / _host_bound_ms(b, 0)
        assert model.predict(b, k, drafted=k / 2) / model.predict(b, 0) == pytest.approx(
            ratio, rel=0.02), (b, k)
    tokens = [1.0, 1.6, 1.8, 1.9, 2.0, 2.0, 2.0, 2.0, 2.0]
    drafted = [k / 2 for k in range(9)]
    assert choose_depth(0.5, 1, model, 8, 1.01, tokens, drafted) == 4  # 2.0 first at k=4
    assert choose_depth(0.5, 16, model, 8, 1.01, tokens, drafted) == 0
