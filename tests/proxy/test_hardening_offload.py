"""A large body's CPU work runs off the proxy's event loop (issue 30: four bodies of 100k
messages held the loop for 1.25 s). The same four bodies through two real proxies on
loopback, one with ``limits.offload_body_bytes: 0`` (every body on the loop, as before):
the loop's worst lateness, measured by a probe on that loop while they are served, and a
small request's latency beside them."""

from __future__ import annotations

import asyncio
import statistics
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
ROUNDS = 3
HELD_S = 0.02  # a wake later than this: the loop held


def _config(up: FakeHeldUpstream, tmp: Path, offload_body_bytes: int) -> ProxyConfig:
    return ProxyConfig.from_dict({
        "server": {"host": "127.0.0.1", "port": 0},
        "workers": [{"name": "held", "url": up.url,
                     "config": {"backend": "external", "model": MODEL}}],
        "health": {"interval_s": 0.5, "metrics_interval_s": 0},
        "traces": {"enabled": False},
        "limits": {"max_loop_lag_s": 0, "offload_body_bytes": offload_body_bytes},
        "run_dir": str(tmp / "run")})


async def _probe(stop: threading.Event, period_s: float = 0.005) -> list[float]:
    """The event loop's lateness at each wake of a 5 ms sleeper, until ``stop``."""
    lags = []
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(period_s)
        lags.append(time.perf_counter() - t - period_s)
    return lags


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
    lags = probe.result(30)
    # the time the loop was held in stretches of more than HELD_S: a body's work done at
    # once; the interpreter's 5 ms switches and the machine's scheduling stay under it
    return {"held_s": sum(lag for lag in lags if lag > HELD_S), "worst_lag_s": max(lags),
            "statuses": statuses, "small_max_s": max(small_s)}


def test_four_bodies_of_100k_messages_do_not_stall_the_loop(tmp_path: Path) -> None:
    big = orjson.dumps({"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"}
        for i in range(NUM_MESSAGES)]})
    results: dict[str, list[dict[str, Any]]] = {"on_loop": [], "offloaded": []}
    with FakeHeldUpstream() as up:
        up.set_release(True)
        # NOTE: interleaved rounds, so a burst of the machine's other work lands on both
        for i in range(ROUNDS):
            for name, threshold in (("on_loop", 0), ("offloaded", 64 << 10)):
                with ProxyThread(_config(up, tmp_path / f"{name}{i}", threshold)) as p:
                    results[name].append(_serve_large_bodies(p, big))
    on_loop, offloaded = results["on_loop"], results["offloaded"]
    assert all(r["statuses"] == [200] * 4 for r in on_loop + offloaded), results
    # The work is the same; only where it runs differs. NOTE: not to zero: orjson's parse
    # in the lane's thread holds the GIL for a whole body (~25 ms each on a 2-core box,
    # bounded by limits.max_body_bytes); the Python work of checking, counting and
    # rendering 100k messages (~110 ms a body) no longer holds the loop. Over three rounds
    # on a 2-core box the loop was held 1.2-1.9 s on the loop against 0.26-0.74 s offloaded
    # (0.21-0.39x, a core kept busy beside it included); a worst single lag alone moved
    # too much to tell them apart (1.35x to 2.6x in CI runs).
    held = {name: sum(r["held_s"] for r in rs) for name, rs in results.items()}
    assert held["offloaded"] < 0.75 * held["on_loop"], results
    # the small request waits out the GIL-held parses either way; its slowest answer a
    # round, the median round: 0.12-0.27x of the on-loop one there
    small = {name: statistics.median(r["small_max_s"] for r in rs)
             for name, rs in results.items()}
    assert small["offloaded"] < 0.8 * small["on_loop"], results
