"""Admin API, load shedding, retry on another worker, circuit breaker and recovery."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from proxy import keys
from proxy.supervisor import free_port
from tests.proxy.servers import EngineProcess, ProxyThread, eventually, external_config

MODEL = "tiny-target"
ADMIN = {"x-admin-key": "admin-test"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_admin_requires_key_and_lists_workers(proxy: ProxyThread) -> None:
    with httpx.Client(base_url=proxy.url) as h:
        r = h.get("/admin/workers")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert h.get("/admin/workers", headers={"x-admin-key": "wrong"}).status_code == 401
        workers = h.get("/admin/workers", headers=ADMIN).json()["workers"]
        assert {w["name"] for w in workers} == {"latency", "throughput"}


def test_admin_disabled_without_key(engines: list[EngineProcess], tmp_path) -> None:  # type: ignore[no-untyped-def]
    with ProxyThread(external_config(engines, tmp_path)) as p, httpx.Client(base_url=p.url) as h:
        assert h.get("/admin/workers", headers=ADMIN).status_code == 403


def test_drain_undrain_remove_add(proxy: ProxyThread, engines: list[EngineProcess]) -> None:
    with httpx.Client(base_url=proxy.url, timeout=30) as h:
        assert h.post("/admin/workers/latency/drain", headers=ADMIN).json()["draining"]
        for _ in range(4):
            r = h.post("/v1/chat/completions", json=CHAT)
            assert r.headers["x-polyinfer-worker"] == "throughput"
        h.post("/admin/workers/latency/undrain", headers=ADMIN)
        seen = {h.post("/v1/chat/completions", json=CHAT).headers["x-polyinfer-worker"]
                for _ in range(4)}
        assert seen == {"latency", "throughput"}  # round robin over both again
        assert h.delete("/admin/workers/latency", headers=ADMIN).json() == {"removed": "latency"}
        assert h.post("/admin/workers/nope/drain", headers=ADMIN).status_code == 404
        assert {h.post("/v1/chat/completions", json=CHAT).headers["x-polyinfer-worker"]
                for _ in range(3)} == {"throughput"}
        latency = next(e for e in engines if e.spec.name == "latency")
        r = h.post("/admin/workers", headers=ADMIN,
                   json={"name": "again", "url": latency.url, "config": {"backend": "engine"}})
        assert r.status_code == 201, r.text
        assert r.json()["healthy"] and r.json()["models"] == [MODEL]
        bad = h.post("/admin/workers", headers=ADMIN, json={"name": "x", "url": "ftp://a"})
        assert bad.status_code == 400 and "url" in bad.json()["error"]["message"]


def test_switch_policy_at_run_time(proxy: ProxyThread) -> None:
    with httpx.Client(base_url=proxy.url, timeout=30) as h:
        assert h.get("/admin/policy", headers=ADMIN).json() == {"policy": "round_robin"}
        r = h.put("/admin/policy", headers=ADMIN, json={"policy": "least_outstanding"})
        assert r.json() == {"policy": "least_outstanding", "previous": "round_robin"}
        h.post("/v1/chat/completions", json=CHAT)
        stats = h.get("/stats").json()
        assert stats["policy"] == "least_outstanding"
        assert stats["decision_reasons"].get("least_outstanding") == 1
        assert h.put("/admin/policy", headers=ADMIN, json={"policy": "bogus"}).status_code == 400
        assert h.put("/admin/policy", headers=ADMIN, json={"policy": "random", "seed": 3}).json()[
            "policy"] == "random"


def test_sheds_load_past_max_in_flight(engines: list[EngineProcess], tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = external_config(engines, tmp_path, limits={"max_in_flight": 2, "retry_after_s": 2})

    async def burst(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as h:
            body = {**CHAT, "max_tokens": 48, "messages": [{"role": "user", "content": "go " * 50}]}
            return await asyncio.gather(*(h.post("/v1/chat/completions", json=body)
                                          for _ in range(12)))

    with ProxyThread(config) as p:
        responses = asyncio.run(burst(p.url))
        codes = sorted(r.status_code for r in responses)
        assert 200 in codes and 429 in codes, codes
        shed = next(r for r in responses if r.status_code == 429)
        assert shed.headers["Retry-After"] == "2"
        assert shed.json()["error"]["type"] == "rate_limit_exceeded"
        assert p.app[keys.STATS].rejected[429] == codes.count(429)


def test_sheds_while_the_event_loop_lags(engines: list[EngineProcess], tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Any real loop is some nanoseconds late: with this limit every request is shed.
    config = external_config(engines, tmp_path, limits={"max_loop_lag_s": 1e-9})
    with ProxyThread(config) as p, httpx.Client(base_url=p.url, timeout=30) as h:
        assert eventually(lambda: p.app[keys.RELAY].loop_lag_s > 1e-9)
        r = h.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 429 and "saturated" in r.json()["error"]["message"]
        assert r.headers["Retry-After"] == "1"
        assert h.get("/stats").json()["loop_lag_ms"] > 0


def test_limits_itself_when_its_own_work_saturates_the_loop_not_when_only_late(  # type: ignore[no-untyped-def]
        engines: list[EngineProcess], tmp_path) -> None:
    # The lag limit is out of reach: only the busy rule can act here, by lowering the
    # in-flight limit (tests/proxy/test_hardening_door.py sheds with it).
    config = external_config(engines, tmp_path, limits={
        "max_loop_lag_s": 30, "busy_loop_lag_s": 0.005, "max_loop_busy": 0.3})
    stop = threading.Event()

    def block_loop(burn: bool) -> None:
        """20 ms per loop iteration on the loop's thread: on the CPU, or asleep (the
        lag a noisy neighbour's CPU steal causes, with nothing of its own to do)."""
        t = time.thread_time() if burn else time.perf_counter()
        while burn and time.thread_time() - t < 0.02:
            pass
        if not burn:
            time.sleep(0.02)
        if not stop.is_set():
            p.loop.call_soon(block_loop, burn)

    with ProxyThread(config) as p, httpx.Client(base_url=p.url, timeout=30) as h:
        relay = p.app[keys.RELAY]
        maximum = relay.in_flight_limit.floor  # the idle limit (proxy.admission.InFlightLimit)
        assert eventually(lambda: relay.in_flight_limit.value == maximum, 20)  # start-up's work
        p.loop.call_soon_threadsafe(block_loop, False)
        assert eventually(lambda: relay.loop_lag_s > 0.01)
        assert relay.loop_busy < 0.3
        assert h.post("/v1/chat/completions", json=CHAT).status_code == 200, "late, not busy"
        assert relay.in_flight_limit.value == maximum, "late, not busy"
        stop.set()
        time.sleep(0.2)
        stop.clear()
        p.loop.call_soon_threadsafe(block_loop, True)
        try:
            assert eventually(lambda: relay.in_flight_limit.value < maximum), \
                (relay.loop_busy, relay.loop_lag_s)
        finally:
            stop.set()
        assert eventually(lambda: relay.loop_busy < 0.3)
        assert h.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert eventually(lambda: relay.in_flight_limit.value == maximum, 20)
        assert 0 <= h.get("/stats").json()["loop_busy"] < 0.3


def test_retry_on_another_worker_and_breaker(engines: list[EngineProcess], tmp_path) -> None:  # type: ignore[no-untyped-def]
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    config = external_config(engines[:1], tmp_path, health={"interval_s": 30,
                                                             "breaker_failures": 2,
                                                             "breaker_cooldown_s": 60})
    with ProxyThread(config) as p:
        pool = p.app[keys.POOL]
        # a worker that passed its probe, then died: only the request path can notice
        from polyinfer.config import CompiledConfig
        from proxy.config import WorkerSpec
        spec = WorkerSpec(name="dead", url=dead, config=CompiledConfig(backend="external",
                                                                       served_model_name=MODEL))
        worker = pool._make_worker(spec, dead, None)
        worker.probe_ok = True
        pool.workers["dead"] = worker
        c = openai.OpenAI(base_url=f"{p.url}/v1", api_key="x", max_retries=0)
        for _ in range(6):
            raw = c.chat.completions.with_raw_response.create(**CHAT)
            assert raw.headers["x-polyinfer-worker"] == engines[0].spec.name
        stats = p.app[keys.STATS]
        assert stats.retries == 2, "round robin sent two requests to the dead worker, retried"
        assert worker.breaker.state == "open" and not worker.view.healthy


def test_recovered_worker_used_again(engines: list[EngineProcess], tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = external_config(engines, tmp_path, health={"interval_s": 0.2,
                                                        "breaker_failures": 1,
                                                        "breaker_cooldown_s": 60})
    with ProxyThread(config) as p:
        pool = p.app[keys.POOL]
        latency = pool.workers["latency"]
        latency.breaker.record_failure()  # as if a request had just failed on it
        assert not latency.refresh_health(time.monotonic())
        latency.probe_ok = False  # as if a probe had failed; the next passing one recovers it
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not latency.refresh_health(time.monotonic()):
            time.sleep(0.1)
        assert latency.breaker.state == "closed"
        with httpx.Client(base_url=p.url, timeout=30) as h:
            seen = {h.post("/v1/chat/completions", json=CHAT).headers["x-polyinfer-worker"]
                    for _ in range(4)}
        assert "latency" in seen


@pytest.mark.parametrize("name", ["round_robin", "least_outstanding", "random", "adaptive"])
def test_every_named_policy_routes(engines: list[EngineProcess], tmp_path, name: str) -> None:  # type: ignore[no-untyped-def]
    with ProxyThread(external_config(engines, tmp_path, routing={"policy": name})) as p, \
            httpx.Client(base_url=p.url, timeout=30) as h:
        for _ in range(3):
            r = h.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
        assert h.get("/stats").json()["policy"] == name
