"""Against real engines on the bundled model: measurement tiers, verification, promotion, service."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import aiohttp
import pytest

from optimizer.board import Board
from optimizer.campaign import SearchConfig
from optimizer.measure import EngineClient, Measurer, Tier
from optimizer.promote import Promoter, PromotionConfig
from optimizer.sample import DomainPromptSynthesizer, SampleConfig, build_replay
from optimizer.service import OptimizerConfig, OptimizerService
from optimizer.verify import (
    Reference,
    VerifyConfig,
    reference_outputs,
    verification_plan,
    verify_candidate,
)
from polyinfer.config import TINY_TARGET, CompiledConfig
from polyinfer.trace import TraceRecord

pytestmark = pytest.mark.timeout(300)

BASE = CompiledConfig(model=str(TINY_TARGET)).with_engine(kv_cache_tokens=8192, max_model_len=1024)
SAMPLE = SampleConfig(max_prompt_tokens=64, max_output_tokens=12)


def synth() -> DomainPromptSynthesizer:
    return DomainPromptSynthesizer(TINY_TARGET / "tokenizer.json", seed=0)


def write_trace(path: Path, n: int = 30, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"ts": 100.0 + i, "domain": rng.choice(["code", "chat", "qa"]),
                                "prompt_tokens": rng.randint(20, 200), "max_tokens": 32,
                                "completion_tokens": rng.randint(8, 32), "status": "ok",
                                "e2e_s": 0.5}) + "\n")
        f.write("{broken\n")
    return path


async def test_measurer_fast_tier_loads_few_layers(engines: tuple[str, str]) -> None:
    url, _ = engines
    records = [TraceRecord(float(i), "code", 60, completion_tokens=10) for i in range(6)]
    reqs = build_replay(records, synth(), SAMPLE)
    async with aiohttp.ClientSession() as s:
        engine = EngineClient(url, s)
        await engine.wait_ready()
        m = Measurer(engine, {"fast": reqs, "slow": reqs},
                     [Tier("fast", 2, 4, concurrency=2, warmup_requests=1),
                      Tier("slow", None, 6, repeats=2, concurrency=3)])
        fast = await m.measure(BASE.with_engine(max_num_seqs=4), "fast")
        live = await engine.config()
        assert live.engine.measure_num_layers == 2 and live.engine.max_num_seqs == 4
        slow = await m.measure(BASE, "slow")
        assert (await engine.config()).engine.measure_num_layers is None
    assert fast.num_errors == 0 and slow.num_errors == 0
    assert fast.value > 0 and len(slow.values) == 2 and all(v > 0 for v in slow.values)
    assert fast.details["num_tokens"] == 4 * 10 and slow.details["num_tokens"] == 6 * 10
    assert m.num_experiments == {"fast": 1, "slow": 1}
    assert set(m.experiments_per_hour()) == {"fast", "slow"}


async def test_open_loop_replay_keeps_the_arrival_pattern(engines: tuple[str, str]) -> None:
    url, _ = engines
    # two requests at once, then one 1.5 s later: an open-loop replay must wait for it
    records = [TraceRecord(t, "code", 40, completion_tokens=6) for t in (10.0, 10.0, 11.5)]
    reqs = build_replay(records, synth(), SAMPLE)
    async with aiohttp.ClientSession() as s:
        engine = EngineClient(url, s)
        await engine.wait_ready()
        m = Measurer(engine, {"open": reqs, "closed": reqs},
                     [Tier("open", None, 3, concurrency=4, open_loop=True, warmup_requests=0),
                      Tier("closed", None, 3, concurrency=4, warmup_requests=0)],
                     objective="request")
        opened = await m.measure(BASE, "open")
        closed = await m.measure(BASE, "closed")
    assert opened.num_errors == 0 and closed.num_errors == 0
    assert opened.details["wall_s"] >= 1.5 > 0 < closed.details["wall_s"]
    assert opened.value == opened.details["request_tokens_per_s"] > 0
    # idle between arrivals: fewer requests in flight on average than with all due at once
    assert opened.details["in_flight"] < closed.details["in_flight"]


async def test_verification_passes_speculation_and_catches_another_model(
        engines: tuple[str, str]) -> None:
    url, _ = engines
    vcfg = VerifyConfig(max_batch=8, prompt_tokens=(56, 96), max_tokens=(6, 10))
    plan = verification_plan(synth(), vcfg)
    async with aiohttp.ClientSession() as s:
        engine = EngineClient(url, s)
        await engine.wait_ready()
        ref = await reference_outputs(engine, BASE, plan)
        # Lossless speculation and a smaller batch must not change outputs, greedy or seeded.
        same = BASE.with_engine(max_num_seqs=4, max_num_batched_tokens=256, spec_method="ngram",
                                spec_max_depth=4, spec_default_depth=3)
        ok = await verify_candidate(engine, same, plan, ref, vcfg)
        assert ok.ok, (ok.reason, ok.details)
        assert ok.coverage["preemptions"] > 0 and ok.coverage["prefix_hit_tokens"] > 0
        # A reference from a different model (first 2 layers) must be told apart.
        await engine.reload(BASE.with_engine(measure_num_layers=2))
        two_layer = [await engine.generate(r.body(engine.model)) for r in plan]
        assert tuple(two_layer) != ref.outputs
        caught = await verify_candidate(engine, BASE, plan, Reference(BASE, tuple(two_layer)), vcfg)
        assert not caught.ok and set(caught.mismatches) == {"batch", "cached", "pressure"}


async def test_hot_reload_promotion_drops_no_requests(engines: tuple[str, str]) -> None:
    _, live = engines
    prompts = [r.prompt for r in verification_plan(synth(), VerifyConfig(max_batch=8))]
    winner = BASE.with_engine(max_num_seqs=8, max_num_batched_tokens=512)
    async with aiohttp.ClientSession() as s:
        engine = EngineClient(live, s)
        await engine.wait_ready()
        await engine.reload(BASE)
        stop = asyncio.Event()

        async def load() -> list[str]:
            out = []
            while not stop.is_set():
                out.extend(await asyncio.gather(*(engine.complete(p, 8) for p in prompts[:3])))
            return out

        loader = asyncio.create_task(load())
        promoter = Promoter(s, PromotionConfig(watch_s=1.0, min_requests=1))
        outcome = await promoter.promote(live, "engine", winner, BASE, tokens_per_s=1.0)
        stop.set()
        texts = await loader  # raises if any request failed
        live_cfg = await engine.config()
    assert len(texts) >= 3
    assert outcome.switch_s >= 0 and outcome.status in ("promoted", "rolled_back")
    expected = winner if outcome.status == "promoted" else BASE
    assert live_cfg.engine.max_num_seqs == expected.engine.max_num_seqs


async def test_service_runs_one_campaign_end_to_end(engines: tuple[str, str],
                                                    tmp_path: Path) -> None:
    measure_url, live_url = engines
    trace = write_trace(tmp_path / "trace.jsonl")
    cfg = OptimizerConfig(
        base=BASE, traces=(str(trace),), board_path=str(tmp_path / "board.sqlite"),
        worker_url=live_url, measure_url=measure_url,
        fast=Tier("fast", 2, 4, concurrency=4, warmup_requests=1),
        slow=Tier("slow", None, 4, repeats=2, concurrency=4, warmup_requests=1),
        sample=SAMPLE, search=SearchConfig(fast_budget=4, finalists=1, idle_timeout_s=20,
                                           max_pairs=3),
        promotion=PromotionConfig(watch_s=0.5, max_watch_s=1.0),
        verify=VerifyConfig(max_batch=8, max_tokens=(4, 8)),
        min_records=10, once=True)
    service = OptimizerService(cfg)
    assert service.snapshot()["state"] == "starting"
    await asyncio.wait_for(service.run(), 240)
    snap = service.snapshot()
    assert snap["state"] == "done" and snap["bad_records"] == 1 and snap["records"] == 30
    assert snap["experiments"]["fast"] >= 4 and snap["hardware"]["matmul_gflops"] > 0
    (entry,) = snap["history"]
    assert entry["fast_experiments"] == 4
    # 1 request/s x 0.5 s recorded e2e: half a request in flight -> per-request tokens/s
    assert entry["objective"] == "request" and entry["concurrency"] == 1
    assert entry["status"] in ("no_candidate", "within_noise", "verification_failed",
                               "promoted", "rolled_back", "not_worth_switching", "profile_stale")
    board = Board(cfg.board_path)
    results = board.results(entry["campaign"], "fast")
    assert len(results) >= 4
    assert len({r.agent for r in results}) >= 2  # the incumbent + at least one agent
    assert sum(entry["agents"].values()) >= 3
    assert board.notes(entry["campaign"], kind="incumbent")
    json.dumps(snap)  # /stats must be able to serve it


async def test_promotion_updates_the_proxy_pool_view(engines: tuple[str, str],
                                                     tmp_path: Path) -> None:
    from proxy.config import HealthConfig, WorkerSpec
    from proxy.pool import WorkerPool
    from proxy.promotion import PoolConfigSink

    _, live = engines
    pool = WorkerPool(HealthConfig(), tmp_path)
    try:
        await pool.add(WorkerSpec(name="w0", url=live, config=BASE))
        winner = BASE.with_engine(max_num_seqs=4, max_num_batched_tokens=256)
        async with aiohttp.ClientSession() as s:
            promoter = Promoter(s, PromotionConfig(watch_s=0.2, max_watch_s=0.5),
                                sinks=(PoolConfigSink(pool),))
            outcome = await promoter.promote(live, "engine", winner, BASE, tokens_per_s=1.0)
            live_cfg = await EngineClient(live, s).config()
    finally:
        await pool.close()
    assert outcome.status == "promoted"  # no live traffic: nothing to roll back on
    assert pool.workers["w0"].view.config is winner
    assert live_cfg.engine.max_num_seqs == 4
