"""Restart-only knobs (data_parallel_size): refused without a pool, priced, promoted by blue-green.

The pool test starts a real engine with two engine-core processes on the
bundled model (loopback HTTP): a few seconds of start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from optimizer.board import Board
from optimizer.campaign import SearchConfig, experiment_cost
from optimizer.cli import add_arguments, build_config
from optimizer.engine_proc import process_cpu_seconds
from optimizer.errors import MeasurementError, OptimizerError, PromotionError, ReloadRejected
from optimizer.measure import EngineClient, Measurement, Measurer, Tier
from optimizer.pool import EnginePool, restart_class
from optimizer.profile import build_profile
from optimizer.promote import Promoter, PromotionConfig
from optimizer.sample import DomainPromptSynthesizer, SampleConfig, build_replay
from optimizer.service import OptimizerConfig, OptimizerService
from optimizer.space import Knob, SearchSpace, dp_sizes
from optimizer.verify import VerifyConfig
from polyinfer.config import TINY_TARGET, CompiledConfig, needs_restart
from polyinfer.trace import TraceRecord

pytestmark = pytest.mark.timeout(300)

BASE = CompiledConfig(model=str(TINY_TARGET)).with_engine(kv_cache_tokens=8192, max_model_len=1024)


def replay_sample(n: int = 3) -> list:
    records = [TraceRecord(float(i), "code", 40, completion_tokens=8) for i in range(n)]
    synth = DomainPromptSynthesizer(TINY_TARGET / "tokenizer.json", seed=0)
    return build_replay(records, synth, SampleConfig(max_prompt_tokens=48, max_output_tokens=8))


def test_needs_restart_names_the_restart_only_fields() -> None:
    assert needs_restart(BASE, BASE.with_engine(data_parallel_size=2))
    assert needs_restart(BASE, BASE.with_engine(device="cuda"))
    assert needs_restart(BASE, CompiledConfig(model="other-model"))
    assert not needs_restart(BASE, BASE.with_engine(max_num_seqs=4, num_threads=2,
                                                    spec_method="ngram", spec_default_depth=2))
    vllm = CompiledConfig(backend="vllm", model="m")
    assert not needs_restart(vllm, vllm)
    assert needs_restart(vllm, CompiledConfig(backend="vllm", model="m", served_model_name="x"))


def test_restart_class_and_space_knob() -> None:
    assert restart_class(BASE) == restart_class(BASE.with_engine(max_num_seqs=2))
    assert restart_class(BASE) != restart_class(BASE.with_engine(data_parallel_size=2))
    space = SearchSpace.default(BASE, 1 << 30, (Knob("max_num_seqs", (8, 32)),
                                                Knob("data_parallel_size", (0, 2))))
    keys = {space.key(c) for c in space.grid()}
    assert len(keys) == 4 and any(json.loads(k)["data_parallel_size"] == 2 for k in keys)


def test_experiment_cost_prices_the_cold_start() -> None:
    plain = Measurement("fast", 10.0, (10.0,), seconds=1.0, reload_s=0.1, num_errors=0)
    started = Measurement("fast", 10.0, (10.0,), seconds=5.0, reload_s=0.1, num_errors=0,
                          restart_s=4.0)
    assert experiment_cost(plain) == 1.0
    assert experiment_cost(started) == pytest.approx(5.0)


def test_a_restart_costs_a_cold_start_when_pricing_the_switch() -> None:
    cfg = PromotionConfig(restart_cost_s=120.0, payback_horizon_s=1800.0)
    assert cfg.switch_cost_s("engine", 0.1) == pytest.approx(0.1)
    assert cfg.switch_cost_s("engine", 0.1, restart=True) == 120.0
    # +5% saves 1800 * 0.05 / 1.05 = 86 s: worth a reload, not a restart
    assert cfg.worth_switching(0.05, "engine", 0.1)
    assert not cfg.worth_switching(0.05, "engine", 0.1, restart=True)
    assert cfg.worth_switching(0.3, "engine", 0.1, restart=True)


async def test_promoting_a_restart_only_change_needs_blue_green() -> None:
    async with aiohttp.ClientSession() as s:
        promoter = Promoter(s, PromotionConfig(watch_s=0.01))
        with pytest.raises(PromotionError, match="blue-green"):
            await promoter.promote("http://127.0.0.1:9", "engine",
                                   BASE.with_engine(data_parallel_size=2), BASE, 100.0)


async def test_without_a_pool_a_restart_only_candidate_is_refused(
        engines: tuple[str, str]) -> None:
    url, _ = engines
    reqs = replay_sample()
    async with aiohttp.ClientSession() as s:
        engine = EngineClient(url, s)
        await engine.wait_ready()
        m = Measurer(engine, {"fast": reqs}, [Tier("fast", None, 2, concurrency=2,
                                                   warmup_requests=0)])
        with pytest.raises(ReloadRejected, match="restart"):
            await m.measure(BASE.with_engine(data_parallel_size=2), "fast")
        ok = await m.measure(BASE.with_engine(max_num_seqs=4), "fast")
    assert ok.restart_s == 0.0 and ok.num_errors == 0


async def test_pool_measures_a_dp_candidate_on_its_own_engine(model_dir: object) -> None:
    reqs = replay_sample()
    dp2 = BASE.with_engine(data_parallel_size=2)
    async with aiohttp.ClientSession() as s:
        pool = EnginePool(s, max_engines=1)
        try:
            m = Measurer(EngineClient("http://127.0.0.1:9", s), {"fast": reqs},
                         [Tier("fast", None, 3, concurrency=2, warmup_requests=0)],
                         objective="cpu", pool=pool)
            first = await m.measure(dp2, "fast")
            again = await m.measure(dp2.with_engine(max_num_seqs=4), "fast")
            handle, start_s = await pool.get(dp2)
            served = await handle.client.config()
            assert handle.process is not None
            # the engine-core processes' CPU time is counted with the HTTP process's: the
            # clock exceeds the HTTP process's own (read first: both keep growing)
            own = process_cpu_seconds(handle.process._proc.pid)  # type: ignore[union-attr]
            assert handle.process.cpu_seconds() > own > 0
        finally:
            await pool.close()
    assert served.engine.data_parallel_size == 2 and served.engine.max_num_seqs == 4
    assert first.restart_s > 0 and first.seconds > first.restart_s
    assert again.restart_s == 0.0 and start_s == 0.0
    assert first.num_errors == again.num_errors == 0 and first.value > 0
    assert pool.num_starts == 1


async def test_cpu_objective_needs_a_clock_on_the_measuring_engine(
        engines: tuple[str, str]) -> None:
    """An adopted engine without a process has no CPU clock: 'cpu' scores cannot be made."""
    url, _ = engines
    async with aiohttp.ClientSession() as s:
        client = EngineClient(url, s)
        pool = EnginePool(s)
        await pool.adopt(BASE, client)
        assert client.model == "tiny-target"  # learnt on adoption: completions name it
        m = Measurer(client, {"fast": replay_sample(1)},
                     [Tier("fast", None, 1, concurrency=1, warmup_requests=0)],
                     cpu_seconds=lambda: 0.0, objective="cpu", pool=pool)
        with pytest.raises(MeasurementError, match="CPU clock"):
            await m.measure(BASE, "fast")
        await pool.close()  # adopted without a process: left running
        assert (await client.config()).engine.max_num_seqs == BASE.engine.max_num_seqs


def test_pool_refuses_no_engines() -> None:
    with pytest.raises(MeasurementError, match="max_engines"):
        EnginePool(None, max_engines=0)  # type: ignore[arg-type]


def test_service_drops_restart_only_knobs_on_an_engine_it_did_not_start() -> None:
    knobs = (Knob("max_num_seqs", (8, 32)), Knob("data_parallel_size", (0, 2)))
    service = OptimizerService(OptimizerConfig(base=BASE, measure_url="http://127.0.0.1:9",
                                               knobs=knobs))
    space, _, _ = service._build_models()
    assert [k.name for k in space.knobs] == ["max_num_seqs"]


def test_dp_sizes_and_the_kv_budget_counts_every_core() -> None:
    assert dp_sizes(1) == (0,) and dp_sizes(2) == (0, 2) and dp_sizes(6) == (0, 2, 4)
    per_token = 2 * 8 * 2 * 64 * 4  # layers x kv heads x head_dim x fp32, K and V
    space = SearchSpace.default(BASE, 8192 * per_token, (Knob("data_parallel_size", (0, 2)),))
    assert space.is_valid(BASE) and space.is_valid(BASE.with_engine(data_parallel_size=1))
    assert "KV cache" in " ".join(space.violations(BASE.with_engine(data_parallel_size=2)))
    with pytest.raises(OptimizerError, match="max_measure_engines"):
        OptimizerConfig(max_measure_engines=0)
    with pytest.raises(OptimizerError, match="throughput_objective"):
        OptimizerConfig(throughput_objective="request")


async def test_service_measures_a_restart_only_candidate_on_an_engine_it_starts(
        tmp_path: Path) -> None:
    """The service's own engine plus a dp=2 engine from its pool; the restart is priced."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({
        "ts": 100.0 + i, "domain": "code", "prompt_tokens": 40, "max_tokens": 8,
        "completion_tokens": 8, "status": "ok", "e2e_s": 0.5}) + "\n" for i in range(12)))
    cfg = OptimizerConfig(
        base=BASE, traces=(str(trace),), board_path=str(tmp_path / "board.sqlite"),
        knobs=(Knob("data_parallel_size", (0, 2)),), agents=("evolution",),
        fast=Tier("fast", None, 2, concurrency=2, warmup_requests=0),
        slow=Tier("slow", None, 2, repeats=2, concurrency=2, warmup_requests=0),
        sample=SampleConfig(max_prompt_tokens=48, max_output_tokens=8),
        search=SearchConfig(fast_budget=2, finalists=1, idle_timeout_s=15),
        verify=VerifyConfig(max_batch=8, max_tokens=(2, 4)), min_records=10, once=True)
    service = OptimizerService(cfg)
    await asyncio.wait_for(service.run(), 240)
    (entry,) = service.history
    results = Board(cfg.board_path).results(entry["campaign"], "fast")
    by_dp = {json.loads(r.key)["data_parallel_size"]: r for r in results}
    assert set(by_dp) == {0, 2}
    assert by_dp[2].details["restart_s"] > 0 and by_dp[0].details["restart_s"] == 0
    assert by_dp[2].seconds > by_dp[2].details["restart_s"]
    campaign = service.campaign.snapshot()  # type: ignore[union-attr]
    # the incumbent costs 1; the dp=2 candidate its seconds over its seconds without the start
    assert campaign["budget_used"] > campaign["fast_experiments"] == 2


def test_cli_throughput_objective_reaches_the_service() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert build_config(p.parse_args([])).throughput_objective == "wall"
    cfg = build_config(p.parse_args(["--throughput-objective", "cpu"]))
    assert cfg.throughput_objective == "cpu"
    service = OptimizerService(cfg)
    service._cpu_clock = lambda: 0.0  # as when the service started its measurement engine
    busy = [TraceRecord(i / 4.0, "chat", 100, completion_tokens=32, e2e_s=2.5) for i in range(40)]
    assert service._objective(build_profile(busy)) == "cpu"
    service = OptimizerService(build_config(p.parse_args([])))
    service._cpu_clock = lambda: 0.0
    assert service._objective(build_profile(busy)) == "wall"
    with pytest.raises(SystemExit):
        p.parse_args(["--throughput-objective", "request"])
