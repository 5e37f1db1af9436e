"""A winner that changes a restart-only field reaches a live engine worker by blue-green.

The proxy supervises one real engine worker; the optimizer's Promoter switches it to
``data_parallel_size: 2`` through the proxy's blue-green (proxy.promotion.PoolSwitch):
a new server is launched with the winner, traffic moves to it, the old one is stopped.
The promotion then watches, and tells the sinks about, the new server, not the old URL.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import httpx
import pytest

from optimizer.promote import Promoter, PromotionConfig
from proxy import keys
from proxy.config import (
    HealthConfig,
    LaunchSpec,
    LimitsConfig,
    ProxyConfig,
    default_config,
)
from proxy.promotion import PoolConfigSink, PoolSwitch
from tests.proxy.servers import ProxyThread, launched_config

MODEL = "tiny-target"


def _one_launched_worker(tmp: Path) -> ProxyConfig:
    workers = default_config().workers
    worker = next((w for w in workers if w.config.engine.spec_method == "none"), workers[0])
    return launched_config(tmp, LaunchSpec(startup_timeout_s=240.0),
                           LimitsConfig(max_loop_lag_s=0, drain_timeout_s=30.0),
                           HealthConfig(interval_s=0.3, metrics_interval_s=0.5), (worker,))


@pytest.mark.timeout(400)
def test_restart_only_winner_is_promoted_by_blue_green(tmp_path: Path) -> None:
    with ProxyThread(_one_launched_worker(tmp_path)) as proxy:
        pool = proxy.app[keys.POOL]
        (name, worker), = pool.workers.items()
        old_url, previous = worker.url, worker.view.config
        assert previous.engine.data_parallel_size == 0
        winner = previous.with_engine(data_parallel_size=2)

        async def promote():  # type: ignore[no-untyped-def]
            async with aiohttp.ClientSession() as session:
                promoter = Promoter(session, PromotionConfig(watch_s=0.2, max_watch_s=0.5),
                                    sinks=(PoolConfigSink(pool),),
                                    blue_green=PoolSwitch(proxy.app[keys.BLUEGREEN], pool))
                return await promoter.promote(old_url, "engine", winner, previous, 100.0)

        outcome = proxy.call(promote(), timeout_s=360)
        assert outcome.status == "promoted", outcome
        assert outcome.worker_url and outcome.worker_url != old_url
        assert outcome.switch_s > 0
        live = pool.workers[name]
        assert live.url == outcome.worker_url  # the name now serves from the new server
        assert live.view.config.engine.data_parallel_size == 2  # the sink saw the new URL
        served = httpx.get(f"{outcome.worker_url}/admin/config", timeout=10).json()
        assert served["engine"]["data_parallel_size"] == 2
        with pytest.raises(httpx.HTTPError):  # the old server was stopped
            httpx.get(f"{old_url}/health", timeout=2)
        r = httpx.post(f"{proxy.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "def add(a, b):", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
