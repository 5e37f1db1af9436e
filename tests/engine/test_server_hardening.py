"""The engine's HTTP server against oversized, malformed and unauthorised requests (issue 30):
a real engine process on loopback."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from engine.server import ADMIN_KEY_ENV
from tests.engine.conftest import EngineProcess

pytestmark = pytest.mark.timeout(300)
KEY = "engine-admin-secret"
SECRET_PROMPT = "SECRET-PROMPT-TEXT-4242"


@pytest.fixture(scope="module")
def keyed_engine(tiny_model_dir: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    config = {"backend": "engine", "model": str(tiny_model_dir), "served_model_name": "tiny",
              "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 256,
                         "kv_cache_tokens": 8192, "max_model_len": 2048}}
    os.environ[ADMIN_KEY_ENV] = KEY  # inherited by the engine's process only
    try:
        proc = EngineProcess(config, tmp_path_factory.mktemp("engine"), log_level="INFO")
    finally:
        del os.environ[ADMIN_KEY_ENV]
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def _admin(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/admin/config") as r:
            config = await r.json()
        for path, body in (("/admin/reload", config), ("/reset_prefix_cache", None)):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-admin-key": ""}):
                async with s.post(url + path, json=body, headers=headers) as r:
                    assert r.status == 401, (path, headers, await r.text())
                    assert (await r.json())["error"]["code"] == "invalid_api_key"
            for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-admin-key": KEY}):
                async with s.post(url + path, json=body, headers=headers) as r:
                    assert r.status == 200, (path, await r.text())


def test_admin_endpoints_want_the_key(keyed_engine: EngineProcess) -> None:
    asyncio.run(_admin(keyed_engine.base_url))


async def _oversized(url: str, pid: int) -> None:
    big = "hello world " * 700_000  # 8.4 MB, ~2 M tokens for a 2,048-token context
    bodies = [("/v1/completions", {"model": "tiny", "prompt": big, "max_tokens": 1}),
              ("/v1/chat/completions", {"model": "tiny", "max_tokens": 1,
                                        "messages": [{"role": "user", "content": big}]}),
              ("/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "messages": [
                  {"role": "user", "content": "hi"}] * 100_000}),
              ("/v1/completions", {"model": "tiny", "prompt": [1] * 3_000_000,
                                   "max_tokens": 1})]
    rss_before = _rss_mb(pid)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def health_latencies(stop: asyncio.Event) -> list[float]:
            out = []
            while not stop.is_set():
                t0 = time.perf_counter()
                async with s.get(url + "/health") as r:
                    assert r.status == 200
                out.append(time.perf_counter() - t0)
                await asyncio.sleep(0.05)
            return out

        for path, body in bodies:
            raw = orjson.dumps(body)
            stop = asyncio.Event()
            probe = asyncio.create_task(health_latencies(stop))
            t0 = time.perf_counter()
            async with s.post(url + path, data=raw,
                              headers={"Content-Type": "application/json"}) as r:
                error = (await r.json())["error"]
                took = time.perf_counter() - t0
            stop.set()
            health = await probe
            assert r.status == 400 and error["type"] == "invalid_request_error", error
            assert "context length" in error["message"]
            assert took < 5, (path, took)
            assert max(health) < 1.0, (path, max(health))
        async with s.post(url + "/v1/completions", json={
                "model": "tiny", "prompt": "hello", "max_tokens": 2}) as r:
            assert r.status == 200
    assert _rss_mb(pid) - rss_before < 300, (rss_before, _rss_mb(pid))


def test_oversized_prompts_are_refused_without_stalling(keyed_engine: EngineProcess) -> None:
    asyncio.run(_oversized(keyed_engine.base_url, keyed_engine.proc.pid))


def test_malformed_http_leaves_no_secret_in_the_log(keyed_engine: EngineProcess) -> None:
    body = orjson.dumps({"model": "tiny", "prompt": SECRET_PROMPT, "max_tokens": 1})
    head = (b"POST /v1/completions HTTP/1.1\nHost: x\nAuthorization: Bearer %s\n"
            b"Content-Length: %d\n\n" % (KEY.encode(), len(body)))
    with socket.create_connection(("127.0.0.1", keyed_engine.port), timeout=10) as s:
        s.sendall(head + body)
        answer = s.recv(65536)
    assert b" 400 " in answer.split(b"\r\n", 1)[0], answer[:200]
    time.sleep(0.5)
    keyed_engine.log.flush()
    log = Path(keyed_engine.log.name).read_text()
    assert "malformed HTTP request" in log
    assert KEY not in log and SECRET_PROMPT not in log
