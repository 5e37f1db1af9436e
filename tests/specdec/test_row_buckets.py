"""GPU pricing in the depth policy: a term per power-of-two bucket of a step's rows.

On a GPU with captured graphs a step costs the replay of its rows' bucket, flat within
a bucket and not linear across them; the engine's feed carries per-bucket sums and the
policy (``price_row_buckets``) fits one term per bucket beside its line. The synthetic
step time below has that shape (host 0.2 ms + 0.01 ms per sequence, plus a device time
per row bucket loosely after the H200 replays), so every answer is written out.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.metrics import EngineMetrics
from specdec.errors import ProposerConfigError
from specdec.policy import DepthPolicy, PolicyConfig, choose_depth
from specdec.step_feed import ROW_STATS, DecodeStep, StepFeed, StepSums, parse_step_sums
from specdec.step_model import StepTimeModel, row_bucket

# device ms per row bucket: 1, 2, 3-4, 5-8, 9-16, 17-32, 33-64, 65-128, 129-256, 257-512
DEVICE_MS = [0.30, 0.40, 0.42, 0.44, 0.46, 0.48, 0.55, 0.65, 0.80, 1.10]


def true_ms(batch: int, k: int) -> float:
    return 0.2 + 0.01 * batch + DEVICE_MS[row_bucket(batch * (1 + k))]


def gpu_steps(reps: int = 40) -> list[DecodeStep]:
    return [DecodeStep(b, b * k, k, true_ms(b, k) / 1e3) for _ in range(reps)
            for b in (1, 4, 16) for k in (0, 1, 2, 4, 8, 16)]


def fed_policy(price: bool, steps: list[DecodeStep], **config: float) -> DepthPolicy:
    """A policy fed ``steps`` through the engine's exposition and the step feed."""
    metrics = EngineMetrics("tiny")
    for s in steps:
        metrics.decode_steps.add(s)
    policy = DepthPolicy(PolicyConfig(max_depth=16, price_row_buckets=price,
                                      step_feed_decay=1.0, **config))  # type: ignore[arg-type]
    assert StepFeed(policy).on_metrics("w", metrics.expose().decode()) == len(steps)
    return policy


# qa-like tokens per step at k = 0..16: saturating near 2.1 (bench/RESULTS.md, the H200 run)
QA_TOKENS = [1.0, 1.55, 1.8, 1.92, 2.0, 2.02, 2.04, 2.06, 2.08, 2.09, 2.10, 2.11, 2.12, 2.13,
             2.14, 2.15, 2.16]


def test_row_bucket_is_the_power_of_two_at_or_above() -> None:
    assert [row_bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 272)] == \
        [0, 0, 1, 2, 2, 3, 3, 4, 4, 5, 9]
    assert row_bucket(2048) == 11 and row_bucket(10**6) == 11  # the last bucket takes the rest


def test_the_line_alone_misprices_deep_k_at_batch_1() -> None:
    """True: t(1, 4) = 0.2 + 0.01 + 0.44 = 0.65 ms (5 rows), t(1, 16) = 0.69 ms (17 rows):
    1.062x. The line through batch and draft tokens puts k=16 at >= 1.10x k=4 and, with
    qa's tokens per step, picks k=4, where the true goodput is best at k=15
    (2.15 / 0.67 = 3.209 tokens/ms; k=16: 2.16 / 0.69 = 3.130; k=4: 2.0 / 0.65 = 3.077)."""
    assert true_ms(1, 4) == pytest.approx(0.65) and true_ms(1, 16) == pytest.approx(0.69)
    best = max(range(17), key=lambda k: QA_TOKENS[k] / true_ms(1, k))
    assert best == 15
    line = fed_policy(False, gpu_steps()).step_time("w")
    assert line.predict(1, 16) / line.predict(1, 4) > 1.10
    k = choose_depth(0.5, 1, line, 16, 1.0, QA_TOKENS)
    assert k == 4  # 3.077 tokens/ms: 4% below the best
    assert QA_TOKENS[k] / true_ms(1, k) < 0.96 * QA_TOKENS[15] / true_ms(1, 15)


def test_row_bucket_terms_follow_the_bucketed_step_time() -> None:
    model = fed_policy(True, gpu_steps()).step_time("w")
    for b in (1, 4, 16):
        for k in (0, 1, 2, 4, 8, 16):
            assert model.predict(b, k) * 1e3 == pytest.approx(true_ms(b, k), rel=0.015), (b, k)
    assert model.predict(1, 16) / model.predict(1, 4) == pytest.approx(0.69 / 0.65, rel=0.01)
    # k = 7, 15, 16 are within 2.5% of each other in truth (flat buckets): whichever the
    # fit picks must be within 3% of the best, which k=4 (the line's pick) is not
    k = choose_depth(0.5, 1, model, 16, 1.0, QA_TOKENS)
    assert QA_TOKENS[k] / true_ms(1, k) > 0.97 * QA_TOKENS[15] / true_ms(1, 15), k
    # the terms are fitted seconds beside the line, one per bucket seen: 1..272 rows
    assert sorted(model.row_terms) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_a_bucket_seen_in_few_steps_is_pulled_towards_the_line() -> None:
    """One step in the 129-256-row bucket: its term is shrunk by the ridge of
    ``row_prior_steps`` steps, so the prediction there lies between the line and the step."""
    steps = [s for s in gpu_steps() if s.num_rows <= 128]
    one = DecodeStep(16, 160, 10, 2.0e-3)  # 176 rows, 2 ms where the line says ~1.2 ms
    line = fed_policy(False, steps + [one]).step_time("w").predict(16, 10)
    priced = fed_policy(True, steps + [one]).step_time("w")
    heavy = fed_policy(True, steps + [one], row_prior_steps=50.0).step_time("w")
    assert line < priced.predict(16, 10) < 2.0e-3
    assert line < heavy.predict(16, 10) < priced.predict(16, 10)


def test_off_keeps_the_line_exactly() -> None:
    """``price_row_buckets`` off (the default, the CPU's): the row sums change nothing."""
    fed = fed_policy(False, gpu_steps()).step_time("w")
    sums = StepSums()
    for s in gpu_steps():
        sums.add(s)
    xtx, xty = sums.matrices()
    plain = StepTimeModel.from_prior(PolicyConfig().step_prior_s, 4.0)
    plain.observe_sums(xtx, xty, int(sums.num_steps), sums.num_prefill)  # no row sums
    np.testing.assert_array_equal(fed.coef, plain.coef)
    assert fed.row_residual(17) == 0.0
    assert all(fed.predict(b, k) == plain.predict(b, k) for b in (1, 4, 16) for k in (0, 4, 16))


def test_row_sums_per_bucket_round_trip_and_window() -> None:
    sums = StepSums()
    sums.add(DecodeStep(1, 4, 4, 0.002))  # 5 rows: bucket 3
    sums.add(DecodeStep(2, 0, 0, 0.001, num_prefill=30))  # 32 rows: bucket 5
    sums.add(DecodeStep(1, 0, 0, 0.001))  # 1 row: bucket 0
    assert sorted(sums.rows) == [0, 3, 5]
    w = 1.0 / 0.002**2
    assert sums.rows[3] == pytest.approx([1.0, w, w, w, 4 * w, 4 * w, w, 0.0, w, w * 0.002])
    metrics = EngineMetrics("tiny")
    metrics.decode_steps.rows, metrics.decode_steps.num_steps = sums.rows, 3.0
    parsed = parse_step_sums(metrics.expose().decode())
    assert parsed is not None and parsed.rows.keys() == sums.rows.keys()
    for b, v in sums.rows.items():
        np.testing.assert_allclose(parsed.rows[b], v, rtol=1e-12)
    later = StepSums(list(sums.values), sums.num_steps,
                     rows={b: list(v) for b, v in sums.rows.items()})
    later.add(DecodeStep(1, 4, 4, 0.004))
    window = later.minus(sums)
    assert window.rows[3][0] == 1.0 and window.rows[0] == [0.0] * ROW_STATS


def test_malformed_row_terms_are_skipped() -> None:
    lines = ['polyinfer:decode_step_fit_total{term="steps"} 1.0',
             'polyinfer:decode_step_fit_total{term="row3_0"} 2.0',
             'polyinfer:decode_step_fit_total{term="rowx_0"} 1.0',
             'polyinfer:decode_step_fit_total{term="row3_99"} 1.0',
             'polyinfer:decode_step_fit_total{term="row99_0"} 1.0',
             'polyinfer:decode_step_fit_total{term="row4_1"} nan',
             'polyinfer:decode_step_fit_total{term="row_"} 1.0']
    parsed = parse_step_sums("\n".join(lines))
    assert parsed is not None and parsed.rows == {3: [2.0] + [0.0] * (ROW_STATS - 1)}
    model = StepTimeModel.from_prior((0.01, 0.0, 0.0, 0.0), 4.0, price_rows=True)
    xtx, xty = StepSums().matrices()
    model.observe_sums(xtx, xty, 1, 0.0, {3: [1.0, 2.0], 4: [float("inf")] * ROW_STATS,
                                          5: [0.0] * ROW_STATS})
    assert model.row_sums == {} and model.row_terms == {}


def test_row_prior_steps_must_be_positive() -> None:
    with pytest.raises(ProposerConfigError, match="row_prior_steps"):
        PolicyConfig(row_prior_steps=0.0)
