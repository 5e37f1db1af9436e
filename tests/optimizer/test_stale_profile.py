"""A winner tuned on traffic that has since moved is not promoted (the profile is refreshed)."""

from __future__ import annotations

import asyncio

from optimizer.profile import build_profile
from optimizer.service import OptimizerConfig, OptimizerService
from polyinfer.trace import TraceRecord


def _records(domain: str, prompt_tokens: int, n: int, t0: float) -> list[TraceRecord]:
    return [TraceRecord(t0 + i, domain, prompt_tokens, completion_tokens=32, e2e_s=0.5)
            for i in range(n)]


def test_profile_drift_is_seen_before_promotion() -> None:
    service = OptimizerService(OptimizerConfig(min_records=10, window_records=40))
    tuned_on = _records("code", 60, 20, 0.0)
    for r in tuned_on:
        service.observe(r)
    service.profile = build_profile(tuned_on)
    assert asyncio.run(service._profile_drift()) is None  # the same traffic: promote
    for r in _records("summarization", 900, 40, 100.0):  # the traffic moved since
        service.observe(r)
    drift = asyncio.run(service._profile_drift())
    assert drift is not None and drift >= service.config.shift_threshold
