"""Failure and scale: a supervised worker killed mid-run, 200 concurrent streams,
client disconnects, and SIGTERM draining. All on real engine workers."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import openai
import pytest

from proxy import keys
from proxy.config import (
    HealthConfig,
    LaunchSpec,
    LimitsConfig,
    ProxyConfig,
)
from proxy.pool import parse_metrics
from proxy.supervisor import free_port
from tests.proxy.servers import (
    EngineProcess,
    ProxyThread,
    eventually,
    launched_config,
    read_traces,
    wait_healthy,
)

MODEL = "tiny-target"
LONG = {"ignore_eos": True}


def _embedded_default(tmp: Path) -> ProxyConfig:
    return launched_config(
        tmp, LaunchSpec(restart_backoff_s=0.5, max_backoff_s=2.0),
        LimitsConfig(max_loop_lag_s=0),
        HealthConfig(interval_s=0.3, metrics_interval_s=0.5, breaker_failures=1,
                     breaker_cooldown_s=1.0))


@pytest.mark.timeout(400)
def test_embedded_default_survives_a_worker_killed_mid_run(tmp_path: Path) -> None:
    num_clients = 16
    with ProxyThread(_embedded_default(tmp_path)) as p:
        pool = p.app[keys.POOL]
        assert sorted(pool.workers) == ["latency", "throughput"]
        victim = pool.workers["latency"].supervisor
        assert victim is not None and victim.running
        outcomes = asyncio.run(_streams_with_a_kill(p.url, num_clients, victim.pid))
        assert len(outcomes) == num_clients, "every client returned (none hung)"
        broken = [o for o in outcomes if o.startswith("error")]
        assert any("failed mid-stream" in o for o in broken), outcomes
        assert all(o == "ok" or "failed mid-stream" in o for o in outcomes), outcomes
        # the supervisor restarts the worker, the probe sees it, and it gets traffic again
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not pool.workers["latency"].view.healthy:
            time.sleep(0.5)
        assert victim.num_restarts >= 1 and pool.workers["latency"].view.healthy
        c = openai.OpenAI(base_url=f"{p.url}/v1", api_key="x", max_retries=0, timeout=60)
        used = {c.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2)
                .headers["x-polyinfer-worker"] for _ in range(4)}
        assert "latency" in used
        num_sent = num_clients + 4
        p.stop()
    records = read_traces(tmp_path / "traces")
    assert len(records) == num_sent, "one trace record per request, errors included"
    assert sum(r["status"] == "error" for r in records) == len(broken)
    assert (tmp_path / "run" / "logs" / "latency.log").stat().st_size > 0, "worker logs kept"


async def _streams_with_a_kill(url: str, num_clients: int, pid: int | None) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    started = 0
    all_started = asyncio.Event()

    async def one(i: int) -> str:
        nonlocal started
        try:
            stream = await client.completions.create(
                model=MODEL, prompt=f"story {i}:", max_tokens=600, stream=True, extra_body=LONG)
            first = True
            async for _ in stream:
                if first:
                    first = False
                    started += 1
                    if started == num_clients:
                        all_started.set()
            return "ok"
        except openai.APIError as e:
            return f"error: {e}"

    tasks = [asyncio.create_task(one(i)) for i in range(num_clients)]
    await asyncio.wait_for(all_started.wait(), 60)
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    await client.close()
    return list(results)


@pytest.mark.timeout(300)
async def test_200_concurrent_streaming_clients(proxy: ProxyThread) -> None:
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0,
                                timeout=120)

    async def one(i: int) -> int:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Say {i}"}], max_tokens=8,
            stream=True, temperature=0)
        return len([1 async for c in stream if c.choices and c.choices[0].delta.content])

    # NOTE: greedy: one CI run had a stream with no content at the default temperature;
    # sampled, a stream's 8 tokens can all be held back as pieces of a multi-byte character
    # (engine/detokenizer.py), or decode to nothing
    counts = await asyncio.gather(*(one(i) for i in range(200)))
    await client.close()
    assert len(counts) == 200 and all(n >= 1 for n in counts), counts
    stats = proxy.app[keys.STATS]
    assert eventually(lambda: stats.in_flight == 0)
    assert sum(n for (_, _, s), n in stats.requests.items() if s == "ok") >= 200


def _running(engine: EngineProcess) -> float:
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=5) as r:
        return parse_metrics(r.read().decode()).get("running", 0.0)


def test_client_disconnect_cancels_the_upstream_request(proxy: ProxyThread,
                                                        engines: list[EngineProcess]) -> None:
    body = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 1500, "stream": True,
            **LONG}
    with httpx.Client(base_url=proxy.url, timeout=30) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            worker = r.headers["x-polyinfer-worker"]
            next(r.iter_bytes())
        # the client is gone; the engine must stop generating long before 1500 tokens
    engine = next(e for e in engines if e.spec.name == worker)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (_running(engine) or proxy.app[keys.STATS].in_flight):
        time.sleep(0.1)
    assert _running(engine) == 0 and proxy.app[keys.STATS].in_flight == 0
    stats = proxy.app[keys.STATS]
    assert stats.requests[(worker, next(iter({d for (_, d, _) in stats.requests})),
                           "cancelled")] == 1


def test_sigterm_drains_in_flight_requests(engines: list[EngineProcess], tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve", "--port", str(port),
                             "--worker", engines[1].url], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "serve.log", "wb"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 60, proc)
        got: dict[str, object] = {}
        first_chunk = threading.Event()

        def stream() -> None:
            body = {"model": MODEL, "prompt": "a", "max_tokens": 300, "stream": True, **LONG}
            with httpx.Client(timeout=60) as h, h.stream("POST", f"{url}/v1/completions",
                                                         json=body) as r:
                chunks = []
                for chunk in r.iter_bytes():
                    chunks.append(chunk)
                    first_chunk.set()
                got["body"] = b"".join(chunks)

        t = threading.Thread(target=stream)
        t.start()
        assert first_chunk.wait(30)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "b"})
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert refused.json()["error"]["code"] == "shutting_down"
        t.join(60)
        assert got["body"].rstrip().endswith(b"data: [DONE]")  # type: ignore[union-attr]
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    records = read_traces(tmp_path / "traces")
    statuses = sorted(r["status"] for r in records)
    assert statuses == ["error", "ok"], statuses
    ok = next(r for r in records if r["status"] == "ok")
    assert ok["completion_tokens"] == 300 and ok["worker"] == "w0"
