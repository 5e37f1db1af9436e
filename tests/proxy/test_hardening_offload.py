"""A large body's CPU work runs off the proxy's event loop (issue 30: four bodies of 100k
messages held the loop for 1.25 s). The same four bodies through two real proxies on
loopback, one with ``limits.offload_body_bytes: 0`` (every body on the loop, as before):
the loop's worst lateness, measured by a probe on that loop while they are served, and a
small request's latency beside them."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from proxy.config import ProxyConfig
from tests.proxy.servers import ProxyThread
from tests.proxy.test_hardening_door import BODY, MODEL, FakeHeldUpstream

NUM_MESSAGES = 100_000


def _config(up: FakeHeldUpstream, tmp: Path, offload_body_bytes: int) -> ProxyConfig:
    return ProxyConfig.from_dict({
        "server": {"host": "127.0.0.1", "port": 0},
        "workers": [{"name": "held", "url": up.url,
                     "config": {"backend": "external", "model": MODEL}}],
        "health": {"interval_s": 0.5, "metrics_interval_s": 0},
        "traces": {"enabled": False},
        "limits": {"max_loop_lag_s": 0, "offload_body_bytes": offload_body_bytes},
        "run_dir": str(tmp / "run")})


async def _probe(stop: threading.Event, period_s: float = 0.005) -> float:
    """The event loop's worst lateness waking a 5 ms sleeper, until ``stop``."""
    worst = 0.0
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(period_s)
        worst = max(worst, time.perf_counter() - t - period_s)
    return worst


def _serve_large_bodies(p: ProxyThread, big: bytes) -> dict[str, Any]:
    stop = threading.Event()
    probe = asyncio.run_coroutine_threadsafe(_probe(stop), p.loop)
    statuses: list[int] = []
    small_s: list[float] = []

    def send_big() -> None:
        with httpx.Client(base_url=p.url, timeout=120) as http:
            statuses.append(http.post("/v1/chat/completions", content=big, headers={
                "Content-Type": "application/json"}).status_code)

    threads = [threading.Thread(target=send_big) for _ in range(4)]
    with httpx.Client(base_url=p.url, timeout=120) as http:
        http.post("/v1/chat/completions", json=BODY)  # connection and caches warm
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            t0 = time.perf_counter()
            assert http.post("/v1/chat/completions", json=BODY).status_code == 200
            small_s.append(time.perf_counter() - t0)
    for t in threads:
        t.join()
    stop.set()
    return {"worst_lag_s": probe.result(30), "statuses": statuses,
            "small_max_s": max(small_s)}


def test_four_bodies_of_100k_messages_do_not_stall_the_loop(tmp_path: Path) -> None:
    big = orjson.dumps({"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"}
        for i in range(NUM_MESSAGES)]})
    results = {}
    with FakeHeldUpstream() as up:
        up.set_release(True)
        for name, threshold in (("on_loop", 0), ("offloaded", 64 << 10)):
            with ProxyThread(_config(up, tmp_path / name, threshold)) as p:
                results[name] = _serve_large_bodies(p, big)
    on_loop, offloaded = results["on_loop"], results["offloaded"]
    assert on_loop["statuses"] == offloaded["statuses"] == [200] * 4, results
    # The work is the same; only where it runs differs. NOTE: not to zero: orjson's parse
    # in the lane's thread and the re-encoding on the loop hold the GIL for a whole body
    # (~30-160 ms each here, bounded by limits.max_body_bytes); the Python work of
    # checking, counting and rendering 100k messages no longer holds the loop. The lag
    # fell 2.6x in one CI run and 1.93x in another (0.107 s against 0.207 s), so the
    # bound is a third less: the GIL-held parses leave the rest to the machine.
    assert offloaded["worst_lag_s"] < 0.67 * on_loop["worst_lag_s"], results
    # NOTE: the small request waits out the GIL-held parses either way, so its gain moves
    # with the machine: on a 2-core box it waited 1.11 s on the loop against 0.41 s
    # offloaded (2.7x), 3.8 s against 0.35 s under load, and in one CI run 0.55 s against
    # 0.33 s (1.7x, the lag there 2.6x): a fifth less at the least
    assert offloaded["small_max_s"] < 0.8 * on_loop["small_max_s"], results
