"""Arrival processes: trace timing, time scale, window, rates, burstiness, limits."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from loadgen.arrivals import arrivals, rate_offsets
from loadgen.config import ArrivalConfig, ClientConfig, LengthConfig
from loadgen.errors import LoadgenConfigError, TraceError
from loadgen.request import TraceRequest


def _trace(*stamps: float) -> list[TraceRequest]:
    return [TraceRequest(line=i + 1, timestamp_s=t, prompt_tokens=10, output_tokens=2)
            for i, t in enumerate(stamps)]


def _offsets(records: list[TraceRequest], **cfg: object) -> list[float]:
    return [round(t, 9) for t, _ in arrivals(records, ArrivalConfig(**cfg))]  # type: ignore[arg-type]


def test_trace_time_scale_multiplies_gaps() -> None:
    records = _trace(1000.0, 1001.0, 1003.0)
    assert _offsets(records) == [0.0, 1.0, 3.0]
    assert _offsets(records, time_scale=0.1) == [0.0, 0.1, 0.3]
    assert _offsets(records, time_scale=2.0) == [0.0, 2.0, 6.0]


def test_trace_is_sorted_and_windowed() -> None:
    records = _trace(10.0, 12.0, 11.0, 15.0, 20.0)
    pairs = arrivals(records, ArrivalConfig(window_start_s=1.0, window_end_s=6.0))
    assert [(round(t, 9), r.line) for t, r in pairs] == [(0.0, 3), (1.0, 2), (4.0, 4)]


def test_limits_on_requests_and_duration() -> None:
    records = _trace(*range(10))
    assert _offsets(records, max_requests=3) == [0.0, 1.0, 2.0]
    assert _offsets(records, duration_s=4.5) == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_trace_arrivals_need_timestamps() -> None:
    with pytest.raises(TraceError, match="line 2 has no timestamp"):
        arrivals([*_trace(1.0), TraceRequest(line=2)], ArrivalConfig())


def test_poisson_mean_rate_and_seed() -> None:
    t = rate_offsets(20001, rate=50.0, burstiness=1.0, seed=3)
    gaps = np.diff(t)
    assert t[0] == 0.0 and gaps.mean() == pytest.approx(1 / 50, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    assert np.array_equal(t, rate_offsets(20001, 50.0, 1.0, 3))


def test_gamma_burstiness_keeps_the_rate_and_raises_variance() -> None:
    gaps = np.diff(rate_offsets(20001, rate=50.0, burstiness=0.25, seed=1))
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.08)  # CV = 1/sqrt(shape)


def test_rate_modes_cycle_prompts_to_the_limit() -> None:
    records = [TraceRequest(line=i + 1, prompt="p") for i in range(3)]
    pairs = arrivals(records, ArrivalConfig(mode="poisson", rate=100.0, max_requests=7))
    assert [r.line for _, r in pairs] == [1, 2, 3, 1, 2, 3, 1]
    timed = arrivals(records, ArrivalConfig(mode="poisson", rate=100.0, duration_s=0.5))
    assert all(t < 0.5 for t, _ in timed) and len(timed) > 20
    closed = arrivals(records, ArrivalConfig(mode="concurrency", concurrency=2))
    assert [t for t, _ in closed] == [0.0, 0.0, 0.0]


def test_bad_arrival_configs() -> None:
    with pytest.raises(LoadgenConfigError, match="rate"):
        ArrivalConfig(mode="poisson")
    with pytest.raises(LoadgenConfigError, match="time_scale"):
        ArrivalConfig(time_scale=0)
    with pytest.raises(LoadgenConfigError, match="window end"):
        ArrivalConfig(window_start_s=5, window_end_s=2)


@pytest.mark.parametrize(("make", "key"), [
    (lambda: ArrivalConfig(time_scale=float("inf")), "time_scale"),  # was: NaN first arrival, a hang
    (lambda: ArrivalConfig(mode="gamma", rate=5.0, burstiness=float("inf")), "burstiness"),
    (lambda: ArrivalConfig(mode="poisson", rate=float("inf")), "rate"),
    (lambda: ArrivalConfig(duration_s=float("inf")), "duration_s"),
    (lambda: ArrivalConfig(window_start_s=float("nan")), "window start"),
    (lambda: ArrivalConfig(window_end_s=float("inf")), "window end"),
    (lambda: LengthConfig(prompt_scale=float("inf")), "prompt_scale"),
    (lambda: ClientConfig("http://h:1", timeout_s=float("inf")), "timeout_s"),
])
def test_non_finite_values_are_rejected(make: Any, key: str) -> None:
    with pytest.raises(LoadgenConfigError, match=f"^{key}: expected .*finite"):
        make()
