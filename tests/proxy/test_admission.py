"""Per-worker concurrency caps and the proxy's admission queue (proxy.admission), on real
engine workers with the real openai client."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from polyinfer.config import ConfigError
from proxy import keys
from proxy.admission import AdmissionQueue, priority
from proxy.config import ProxyConfig
from tests.proxy.servers import EngineProcess, ProxyThread, eventually, external_config, read_traces

MODEL = "tiny-target"


def capped_config(engines: list[EngineProcess], tmp_path: Path, cap: int, **sections: object
                  ) -> ProxyConfig:
    config = external_config(engines, tmp_path, **sections)
    return dataclasses.replace(config, workers=tuple(
        dataclasses.replace(w, max_outstanding=cap) for w in config.workers))


class PeakOutstanding:
    """The most requests the proxy had outstanding on any one worker, polled from the test
    thread while a load runs."""

    def __init__(self, proxy: ProxyThread) -> None:
        self.workers = list(proxy.app[keys.POOL].workers.values())
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max([self.peak] + [w.view.outstanding_requests for w in self.workers])
            time.sleep(0.001)

    def __enter__(self) -> PeakOutstanding:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def many(proxy: ProxyThread, n: int, max_tokens: int, ignore_eos: bool = False
               ) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0,
                                timeout=120)
    async def one(i: int) -> str:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count to ten, take {i}."}],
            max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True} if ignore_eos else None)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()


def test_caps_hold_requests_in_the_proxy(engines: list[EngineProcess], tmp_path: Path) -> None:
    """With one slot per worker, eight concurrent requests never put two on a worker; the
    rest wait in the proxy, and every one is served in full."""
    with ProxyThread(capped_config(engines, tmp_path, cap=1)) as p, PeakOutstanding(p) as peak:
        texts = asyncio.run(many(p, 8, max_tokens=12))
        assert all(texts)
        stats = httpx.get(f"{p.url}/stats").json()["admission"]
        metrics = {s.name: s.value for f in text_string_to_metric_families(
            httpx.get(f"{p.url}/metrics").text) for s in f.samples}
        assert eventually(lambda: len(read_traces(tmp_path / "traces")) >= 8)
    assert peak.peak == 1
    assert stats["waiting"] == 0
    assert stats["queued_total"] >= 6  # two slots, eight requests at once
    assert stats["queued_seconds_total"] > 0
    assert metrics["polyinfer_queued_total"] == stats["queued_total"]
    assert metrics["polyinfer_queue_waiting"] == 0
    assert metrics["polyinfer_queued_seconds_total"] > 0
    traces = read_traces(tmp_path / "traces")
    assert sum(t["queue_s"] > 0 for t in traces) == stats["queued_total"]
    assert all(t["status"] == "ok" and t["ttft_s"] >= t["queue_s"] for t in traces)


def test_no_cap_sends_at_once(engines: list[EngineProcess], tmp_path: Path) -> None:
    with ProxyThread(capped_config(engines, tmp_path, cap=0)) as p:
        assert all(asyncio.run(many(p, 6, max_tokens=4)))
        assert httpx.get(f"{p.url}/stats").json()["admission"]["queued_total"] == 0


def test_a_waiter_goes_anyway_after_max_queue_s(engines: list[EngineProcess],
                                                tmp_path: Path) -> None:
    """``limits.max_queue_s``: a request waits no longer than that for room, then goes to a
    worker at its cap."""
    config = capped_config(engines, tmp_path, cap=1, limits={"max_queue_s": 0.05})
    with ProxyThread(config) as p, PeakOutstanding(p) as peak:
        assert all(asyncio.run(many(p, 8, max_tokens=48)))
    assert peak.peak >= 2


def test_a_client_gone_while_waiting_leaves_no_waiter(engines: list[EngineProcess],
                                                      tmp_path: Path) -> None:
    with ProxyThread(capped_config(engines, tmp_path, cap=1)) as p:
        async def run() -> None:
            slow = asyncio.create_task(many(p, 2, max_tokens=400, ignore_eos=True))
            views = [w.view for w in p.app[keys.POOL].workers.values()]
            while not all(v.outstanding_requests for v in views):  # both slots taken
                await asyncio.sleep(0.01)
            client = openai.AsyncOpenAI(base_url=f"{p.url}/v1", api_key="unused",
                                        max_retries=0, timeout=0.2)
            with pytest.raises(openai.APITimeoutError):
                await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            await client.close()
            await slow
        asyncio.run(run())
        assert eventually(lambda: p.app[keys.RELAY].admission._waiters == [])
        assert httpx.get(f"{p.url}/stats").json()["admission"]["waiting"] == 0
        # still serving
        assert asyncio.run(many(p, 1, max_tokens=2))


def test_release_wakes_the_earliest_deadline_first_and_the_late_last() -> None:
    async def run() -> list[str]:
        queue = AdmissionQueue()
        order: list[str] = []
        now = time.perf_counter()
        async def waiter(name: str, deadline: float, arrival: float) -> None:
            await queue.wait(deadline, arrival, 5.0)
            order.append(name)
        tasks = [asyncio.create_task(waiter("relaxed", now + 10, now - 3)),
                 asyncio.create_task(waiter("late", now - 1, now - 5)),
                 asyncio.create_task(waiter("urgent", now + 1, now - 2)),
                 asyncio.create_task(waiter("later", now - 0.5, now - 4))]
        await asyncio.sleep(0.01)
        assert len(queue) == 4
        queue.release()
        await asyncio.gather(*tasks)
        assert len(queue) == 0
        return order
    assert asyncio.run(run()) == ["urgent", "relaxed", "late", "later"]
    assert priority(5.0, 1.0, now=4.0) < priority(6.0, 0.0, now=4.0) < priority(3.0, 2.0, 4.0)


def test_a_wait_ends_at_its_timeout() -> None:
    async def run() -> float:
        queue = AdmissionQueue()
        t = time.perf_counter()
        await queue.wait(t + 1, t, 0.05)
        assert len(queue) == 0
        return time.perf_counter() - t
    assert 0.04 <= asyncio.run(run()) < 1.0


@pytest.mark.parametrize("value", [-1, 1.5, True, "4"])
def test_bad_max_outstanding_is_named(value: object) -> None:
    data = {"workers": [{"name": "w", "url": "http://127.0.0.1:1", "max_outstanding": value}]}
    with pytest.raises(ConfigError, match=r"max_outstanding"):
        ProxyConfig.from_dict(data)


@pytest.mark.parametrize("value", [0, -1, "x"])
def test_bad_max_queue_s_is_named(value: object) -> None:
    with pytest.raises(ConfigError, match=r"limits\.max_queue_s"):
        ProxyConfig.from_dict({"limits": {"max_queue_s": value}})
