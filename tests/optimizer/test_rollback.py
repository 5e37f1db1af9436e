"""A switch that regresses live traffic is rolled back by itself, with the reason.

A real engine worker serves four concurrent clients; the "winner" is planted to
regress them (max_num_seqs 1: requests queue behind each other, so their time to
first token grows several-fold). The promoter's live watch sees the regression
beyond its threshold, switches back, and says why; the worker runs the previous
config again and no client request failed.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from optimizer.measure import EngineClient
from optimizer.promote import Promoter, PromotionConfig
from polyinfer.config import TINY_TARGET, CompiledConfig

pytestmark = pytest.mark.timeout(300)

BASE = CompiledConfig(model=str(TINY_TARGET)).with_engine(kv_cache_tokens=8192, max_model_len=1024)


async def test_live_regression_rolls_back_with_its_reason(engines: tuple[str, str]) -> None:
    _, live = engines
    regressing = BASE.with_engine(max_num_seqs=1, max_num_batched_tokens=256)
    async with aiohttp.ClientSession() as s:
        engine = EngineClient(live, s)
        await engine.wait_ready()
        await engine.reload(BASE)
        stop = asyncio.Event()

        async def client(i: int) -> int:
            n = 0
            while not stop.is_set():
                await engine.complete(f"def f{i}_{n}(x):", 16)  # raises if a request fails
                n += 1
            return n

        clients = [asyncio.create_task(client(i)) for i in range(4)]
        promoter = Promoter(s, PromotionConfig(watch_s=3.0, min_requests=4, max_watch_s=60))
        outcome = await promoter.promote(live, "engine", regressing, BASE, tokens_per_s=1.0)
        stop.set()
        served = await asyncio.gather(*clients)
        live_cfg = await engine.config()
    assert outcome.status == "rolled_back", outcome
    assert "TTFT" in outcome.reason or "TPOT" in outcome.reason
    assert live_cfg.engine.max_num_seqs == BASE.engine.max_num_seqs
    assert sum(served) >= 8
