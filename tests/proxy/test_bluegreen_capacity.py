"""A blue-green switch at the worker's capacity loses no request and cuts no stream.

The proxy supervises one real engine worker (launched, so the switch stops a real
process). Clients keep it at capacity: more streams in flight than its batch, so
requests queue on it. The optimizer's switch (proxy.promotion.PoolSwitch, what a
promotion calls) replaces it with a new server while they run. The drain used to
stop at a fixed deadline; here ``limits.drain_timeout_s`` is 0.2 s, shorter than
the drain needs, and every request must still finish where it started: HTTP
200, every stream whole (all its tokens, then ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import httpx
import orjson
import pytest

from proxy import keys
from proxy.config import HealthConfig, LaunchSpec, LimitsConfig, default_config
from proxy.promotion import PoolSwitch
from tests.proxy.servers import ProxyThread, launched_config

MODEL = "tiny-target"
MAX_TOKENS = 32
NUM_CLIENTS = 12  # the worker batches 4: the rest queue on it
DRAIN_TIMEOUT_S = 0.2  # limits.drain_timeout_s: far below what the drain needs


async def _client(url: str, stop: asyncio.Event, lost: list[str], done: list[int]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as h:
        while not stop.is_set():
            body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": MAX_TOKENS,
                    "ignore_eos": True, "stream": True, "temperature": 0,
                    "stream_options": {"include_usage": True}}
            try:
                async with h.stream("POST", "/v1/completions", json=body) as r:
                    lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            except httpx.HTTPError as e:
                lost.append(f"transport: {e!r}")
                continue
            if r.status_code != 200 or not lines or lines[-1] != "data: [DONE]":
                lost.append(f"HTTP {r.status_code}, last line {lines[-1:]!r}")
                continue
            usage = orjson.loads(lines[-2][6:]).get("usage") or {}
            if usage.get("completion_tokens") != MAX_TOKENS:
                lost.append(f"cut stream: {usage}")
                continue
            done.append(1)


@pytest.mark.timeout(420)
def test_switch_at_capacity_loses_no_request(tmp_path: Path) -> None:
    worker = next(w for w in default_config().workers if w.config.engine.spec_method == "none")
    worker = dataclasses.replace(worker, config=worker.config.with_engine(max_num_seqs=4))
    config = launched_config(tmp_path, LaunchSpec(startup_timeout_s=240.0),
                             LimitsConfig(max_loop_lag_s=0, drain_timeout_s=DRAIN_TIMEOUT_S),
                             HealthConfig(interval_s=0.3, metrics_interval_s=0.5), (worker,))
    with ProxyThread(config) as proxy:
        pool = proxy.app[keys.POOL]
        (name, live), = pool.workers.items()
        old_url = live.url
        winner = live.view.config.with_engine(max_num_seqs=8)

        async def run():  # type: ignore[no-untyped-def]
            stop, lost, done = asyncio.Event(), list[str](), list[int]()
            clients = [asyncio.create_task(_client(proxy.url, stop, lost, done))
                       for _ in range(NUM_CLIENTS)]
            await asyncio.sleep(3.0)  # the worker is at capacity
            switch = PoolSwitch(proxy.app[keys.BLUEGREEN], pool)
            switched = await switch.replace(old_url, winner)
            stop.set()
            await asyncio.gather(*clients)
            return switched, lost, len(done)

        switched, lost, num_done = proxy.call(run(), timeout_s=360)
        report = proxy.app[keys.BLUEGREEN].last  # the replacement the switch made
    print(f"in flight at the shift: {report.num_in_flight_at_shift}, drain {report.drain_s:.1f} s,"
          f" requests ok: {num_done}, lost: {len(lost)}")
    assert lost == []
    assert report.num_abandoned == 0 and report.num_in_flight_at_shift > 4
    assert report.drain_s > DRAIN_TIMEOUT_S  # longer than the limit: it used to cut here
    assert switched.worker_url != old_url and pool.workers[name].url == switched.worker_url
    assert pool.workers[name].view.config.engine.max_num_seqs == 8
