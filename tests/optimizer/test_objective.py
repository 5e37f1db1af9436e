"""What the objective measures: per-request tok/s at the replayed load, and when it is chosen."""

from __future__ import annotations

import aiohttp
import pytest

from loadgen.request import RequestResult
from optimizer.errors import MeasurementError, OptimizerError
from optimizer.measure import EngineClient, Measurer, Tier, _stats
from optimizer.profile import TrafficProfile, build_profile
from optimizer.sample import ReplayRequest
from optimizer.service import OptimizerConfig, OptimizerService
from optimizer.space import DEFAULT_KNOBS, SearchSpace, thread_counts
from polyinfer.config import TINY_TARGET, CompiledConfig
from polyinfer.trace import TraceRecord

pytestmark = pytest.mark.timeout(30)


def result(index: int, ok: bool, tokens: int, e2e_s: float, queue_s: float = 0.0) -> RequestResult:
    r = RequestResult(index=index, line=index + 1, scheduled_s=0.0)
    r.ok, r.completion_tokens, r.e2e_s, r.queue_s = ok, tokens, e2e_s, queue_s
    r.ttft_s, r.tpot_s = 0.1, 0.01
    return r


def test_per_request_rate_counts_queueing_and_failures() -> None:
    results = [result(0, True, 10, 0.5, queue_s=0.5), result(1, True, 20, 1.0),
               result(2, False, 0, 0.2)]
    stats = _stats(results, wall_s=2.0, open_loop=True)
    # 10 tokens over 1 s (half of it queued), 20 over 1 s, a failure at 0 tokens/s
    assert stats.request_tokens_per_s == pytest.approx((10.0 + 20.0 + 0.0) / 3)
    assert stats.tokens_per_s == pytest.approx(30 / 2.0)
    assert stats.in_flight == pytest.approx((1.0 + 1.0 + 0.2) / 2.0)
    assert stats.num_errors == 1
    # closed loop: the slot wait is the replay's own queue, not the traffic's
    closed = _stats(results, wall_s=2.0)
    assert closed.request_tokens_per_s == pytest.approx((20.0 + 20.0 + 0.0) / 3)
    assert closed.in_flight == pytest.approx((0.5 + 1.0 + 0.2) / 2.0)


async def test_request_objective_is_known_and_tier_flag_is_kept() -> None:
    tier = Tier("fast", None, 4, open_loop=True)
    assert tier.apply(CompiledConfig(model=str(TINY_TARGET))).engine.measure_num_layers is None
    sample = {"fast": [ReplayRequest("code", "def f():", 3, 8, 0.0)]}
    async with aiohttp.ClientSession() as session:
        engine = EngineClient("http://127.0.0.1:9", session)
        with pytest.raises(MeasurementError):
            Measurer(engine, sample, [tier], objective="tokens")
        m = Measurer(engine, sample, [tier], objective="request")
    assert m.objective == "request" and m.tiers["fast"].open_loop


def profile(rate_rps: float, e2e_s: float) -> TrafficProfile:
    return build_profile([TraceRecord(i / rate_rps, "code", 100, completion_tokens=32, e2e_s=e2e_s)
                          for i in range(40)])


@pytest.mark.parametrize(("rate", "e2e", "expected"), [
    (0.5, 2.0, "request"),  # ~1 in flight: latency-bound, throughput only echoes the load
    (4.0, 2.5, "wall"),  # ~10 in flight: throughput (no engine CPU clock here)
])
def test_auto_objective_follows_the_traffic_load(rate: float, e2e: float, expected: str) -> None:
    service = OptimizerService(OptimizerConfig(measure_url="http://127.0.0.1:9"))
    assert service._objective(profile(rate, e2e)) == expected


def test_auto_objective_without_latencies_is_throughput() -> None:
    recs = [TraceRecord(float(i), "chat", 50, completion_tokens=8) for i in range(10)]
    service = OptimizerService(OptimizerConfig(measure_url="http://127.0.0.1:9"))
    assert service._objective(build_profile(recs)) == "wall"


def test_explicit_objectives_and_bad_values() -> None:
    service = OptimizerService(OptimizerConfig(objective="request"))
    assert service._objective(profile(4.0, 2.5)) == "request"
    with pytest.raises(OptimizerError, match="objective"):
        OptimizerConfig(objective="latency")
    with pytest.raises(OptimizerError, match="latency_bound_concurrency"):
        OptimizerConfig(latency_bound_concurrency=-1.0)
    with pytest.raises(OptimizerError, match="needs a measurement engine"):
        OptimizerService(OptimizerConfig(objective="cpu"))._objective(
            profile(0.5, 2.0))


def test_threads_are_a_knob_of_the_default_space() -> None:
    assert thread_counts(1) == (0, 1)
    assert thread_counts(6) == (0, 1, 2, 4)
    assert thread_counts(16) == (0, 1, 2, 4, 8, 16)
    assert "num_threads" in {k.name for k in DEFAULT_KNOBS}
    space = SearchSpace.default(CompiledConfig(model=str(TINY_TARGET)))
    assert space.build({"num_threads": 1}).engine.num_threads == 1
    assert space.point_of(space.base)["num_threads"] == 0  # the shipped default: auto
