"""The proxy's own load neither fails a healthy worker's probe nor queues without bound
(issue 30): a real proxy on loopback whose event loop is made late and busy by work of its
own, in front of real engine workers (and a FakeBrokenUpstream that stops)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from proxy import keys
from proxy.config import ProxyConfig
from tests.proxy.servers import EngineProcess, ProxyThread, eventually, external_config
from tests.proxy.test_broken_upstream import FakeBrokenUpstream

MODEL = "tiny-target"
BODY = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


def _stall(p: ProxyThread, seconds: float, busy: bool) -> None:
    """Hold the proxy's event loop for ``seconds``: spinning (its own CPU work) or asleep."""
    done = threading.Event()

    def hold() -> None:
        end = time.perf_counter() + seconds
        if busy:
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(seconds)
        done.set()
    p.loop.call_soon_threadsafe(hold)
    done.wait(seconds + 10)


def test_a_late_loop_marks_no_healthy_worker_down(engines: list[EngineProcess],
                                                  tmp_path: Path) -> None:
    config = external_config(engines, tmp_path, health={"interval_s": 0.2, "timeout_s": 0.5})
    with ProxyThread(config) as p, httpx.Client(base_url=p.url, timeout=30) as http:
        pool = p.app[keys.POOL]
        for _ in range(4):  # each stall far past the probe's timeout
            _stall(p, 1.5, busy=False)
            time.sleep(0.3)
            assert all(w.probe_ok for w in pool.workers.values()), \
                {w.name: w.probe_streak for w in pool.workers.values()}
        assert http.post("/v1/chat/completions", json=BODY).status_code == 200


def test_a_dead_worker_is_marked_down_after_failed_probes_in_a_row(tmp_path: Path) -> None:
    fake = FakeBrokenUpstream().__enter__()
    config = ProxyConfig.from_dict({
        "server": {"host": "127.0.0.1", "port": 0},
        "workers": [{"name": "w", "url": fake.url,
                     "config": {"backend": "external", "model": MODEL}}],
        "health": {"interval_s": 0.2, "timeout_s": 0.5, "probe_failures": 3,
                   "metrics_interval_s": 0},
        "traces": {"enabled": False}, "limits": {"max_loop_lag_s": 0},
        "run_dir": str(tmp_path / "run")})
    with ProxyThread(config) as p:
        worker = p.app[keys.POOL].workers["w"]
        assert worker.probe_ok
        fake.__exit__()
        t0 = time.monotonic()
        assert eventually(lambda: not worker.probe_ok, 10)
        down_after = time.monotonic() - t0
        assert worker.probe_streak >= 3
    assert down_after >= 0.4, down_after  # not on the first failed probe


def test_a_saturated_proxy_sheds_at_the_door(engines: list[EngineProcess],
                                             tmp_path: Path) -> None:
    config = external_config(engines, tmp_path, limits={"max_loop_lag_s": 0.1})
    statuses: list[int] = []
    shed: list[httpx.Response] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=p.url, timeout=30) as http:
            while not stop.is_set():
                r = http.post("/v1/chat/completions", json=BODY)
                statuses.append(r.status_code)
                if r.status_code == 429:
                    shed.append(r)

    with ProxyThread(config) as p:
        threads = [threading.Thread(target=client) for _ in range(4)]
        for t in threads:
            t.start()
        for _ in range(10):  # the proxy's own CPU work holds its loop, over and over
            _stall(p, 0.3, busy=True)
            time.sleep(0.02)
        stop.set()
        for t in threads:
            t.join(30)
        num_shed = p.app[keys.RELAY].num_shed_at_door
        with httpx.Client(base_url=p.url, timeout=30) as http:
            assert eventually(lambda: http.post("/v1/chat/completions", json=BODY
                                                ).status_code == 200, 10)
    assert set(statuses) <= {200, 429}, statuses
    assert shed and num_shed > 0, (statuses.count(200), statuses.count(429))
    r = shed[0]
    # no request id: it would name a record, and a request refused at the door has none
    assert r.headers["Retry-After"] == "1" and "x-request-id" not in r.headers
    assert r.json()["error"]["code"] == "overloaded"
