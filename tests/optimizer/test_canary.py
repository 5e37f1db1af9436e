"""The per-shape canary's rule on written-out records (optimizer.canary)."""

from __future__ import annotations

import random

import pytest

from optimizer.canary import (
    CanaryConfig,
    ShapeCanary,
    baseline,
    binomial_tail,
    shape_name,
    shape_of,
    t_quantile,
)
from polyinfer.trace import STATUS_ERROR, TraceRecord

LIMITS = {"ttft_s": 0.5, "tpot_s": 0.15}


def records(domain: str, prompt_tokens: int, ttft_s: float, tpot_s: float, n: int,
            seed: int, ts: float = 1000.0, spread: float = 0.1) -> list[TraceRecord]:
    """``n`` requests of one shape (16 tokens), latencies log-normal around the medians."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ttft, tpot = (v * rng.lognormvariate(0, spread) for v in (ttft_s, tpot_s))
        out.append(TraceRecord(ts + i * 0.1, domain, prompt_tokens, 16, 16, ttft_s=ttft,
                               tpot_s=tpot, e2e_s=ttft + 15 * tpot))
    return out


def test_quantiles_match_the_tables() -> None:
    assert t_quantile(0.025, 10) == pytest.approx(2.228, abs=0.005)
    assert t_quantile(0.05, 5) == pytest.approx(2.015, abs=0.01)
    assert t_quantile(0.001, 30) == pytest.approx(3.385, abs=0.01)
    assert binomial_tail(0, 5, 0.3) == pytest.approx(1.0)
    assert binomial_tail(2, 2, 0.5) == pytest.approx(0.25)


def test_shape_classes_follow_the_router_bands() -> None:
    assert shape_of(TraceRecord(0.0, "code", 100)) == ("code", 0)
    assert shape_name(("code", 0)) == "code/prompt 0-256"
    assert shape_name(shape_of(TraceRecord(0.0, "chat", 5000))) == "chat/prompt 4096-inf"


def test_same_traffic_after_the_switch_is_not_a_regression() -> None:
    before = records("code", 100, 0.05, 0.01, 40, 1) + records("chat", 600, 0.2, 0.012, 40, 2)
    after = records("code", 100, 0.05, 0.01, 40, 3) + records("chat", 600, 0.2, 0.012, 40, 4)
    verdict = ShapeCanary(CanaryConfig(), before, LIMITS, looks=10).judge(after)
    assert verdict.regressed is None and verdict.num_judged == 4
    assert set(verdict.shapes) == {"code/prompt 0-256", "chat/prompt 256-1024"}


def test_one_shape_regressing_is_caught_where_the_worker_mean_is_flat() -> None:
    # long chat prompts start 2.5x slower, short code prompts 2.5x faster, so the
    # whole worker's mean TTFT hardly moves; per shape the chat regression is plain
    before = records("code", 100, 0.25, 0.01, 30, 1) + records("chat", 600, 0.10, 0.01, 30, 2)
    after = records("code", 100, 0.10, 0.01, 30, 3) + records("chat", 600, 0.25, 0.01, 30, 4)
    mean = lambda rs: sum(r.ttft_s for r in rs) / len(rs)  # noqa: E731
    assert mean(after) == pytest.approx(mean(before), rel=0.1)
    verdict = ShapeCanary(CanaryConfig(), before, LIMITS, looks=10).judge(after)
    found = verdict.regressed
    assert found is not None and found.shape == "chat/prompt 256-1024"
    assert found.metric == "ttft_s" and found.ratio_low > 1.5
    assert "chat/prompt 256-1024" in found.reason() and "TTFT" in found.reason()


def test_a_tpot_for_ttft_trade_that_finishes_sooner_is_kept() -> None:
    # a bigger batch: each token 3x later, but no queueing, so the request ends sooner
    before = records("chat", 100, 0.50, 0.004, 30, 1)
    after = records("chat", 100, 0.05, 0.012, 30, 2)
    verdict = ShapeCanary(CanaryConfig(), before, LIMITS).judge(after)
    row = verdict.shapes["chat/prompt 0-256"]
    assert row["tpot_s"]["ratio_low"] > 2 and row["e2e_s"]["ratio_high"] < 1
    assert verdict.regressed is None
    # the same TPOT without the TTFT gain is a regression
    slower = records("chat", 100, 0.50, 0.012, 30, 3)
    found = ShapeCanary(CanaryConfig(), before, LIMITS).judge(slower).regressed
    assert found is not None and found.metric == "tpot_s"


def test_a_small_slowdown_within_the_tolerance_is_kept() -> None:
    before = records("qa", 50, 0.1, 0.010, 60, 1, spread=0.02)
    after = records("qa", 50, 0.1, 0.011, 60, 2, spread=0.02)  # +10% TPOT, tolerated 15%
    verdict = ShapeCanary(CanaryConfig(), before, LIMITS).judge(after)
    assert verdict.regressed is None
    assert 1.0 < verdict.shapes["qa/prompt 0-256"]["tpot_s"]["ratio_low"] < 1.15


def test_too_few_samples_are_not_judged() -> None:
    before = records("qa", 50, 0.1, 0.01, 20, 1)
    after = records("qa", 50, 1.0, 0.1, 5, 2)  # 10x slower but 5 < min_samples
    canary = ShapeCanary(CanaryConfig(min_samples=8), before, LIMITS)
    verdict = canary.judge(after)
    assert verdict.regressed is None and verdict.num_judged == 0
    assert not canary.ready(after) and canary.ready(records("qa", 50, 0.1, 0.01, 8, 3))


def test_errors_on_one_shape_roll_back() -> None:
    before = records("math", 80, 0.1, 0.01, 40, 1)
    after = records("math", 80, 0.1, 0.01, 16, 2) + [
        TraceRecord(2000.0 + i, "math", 80, 16, status=STATUS_ERROR, error="HTTP 500")
        for i in range(4)]
    verdict = ShapeCanary(CanaryConfig(), before, LIMITS, looks=10).judge(after)
    assert verdict.regressed is not None and verdict.regressed.metric == "errors"
    assert "errors 20% of 20" in verdict.regressed.reason()
    # one error is below min_errors: not judged
    one = after[:-3]
    assert ShapeCanary(CanaryConfig(), before, LIMITS).judge(one).regressed is None


def test_baseline_keeps_what_finished_before_the_switch() -> None:
    recs = [TraceRecord(100.0, "code", 10, e2e_s=1.0),   # finished at 101: kept
            TraceRecord(104.0, "code", 10, e2e_s=2.0),   # still running at 105: dropped
            TraceRecord(106.0, "code", 10, e2e_s=0.1),   # after the switch began
            TraceRecord(1.0, "code", 10, e2e_s=0.1)]     # older than the window
    kept = baseline(recs, 105.0, CanaryConfig(before_window_s=60))
    assert [r.ts for r in kept] == [100.0]
