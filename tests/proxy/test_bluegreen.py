"""Blue-green replacement (proxy.bluegreen) on the suite's real engine workers, attached by URL.

The vLLM version (a launched candidate, a stopped old server) is in
tests/vllm/test_vllm_workers.py; here the candidate is the other running
engine, so the shift and drain run in seconds and the old engine (shared by
the suite) is only detached, never stopped.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from proxy import keys
from proxy.bluegreen import ReplacementBusy, ReplaceRequest
from tests.proxy.servers import EngineProcess, ProxyThread, external_config

MODEL = "tiny-target"
ADMIN = {"x-admin-key": "admin-bg"}


def _by_name(engines: list[EngineProcess], name: str) -> EngineProcess:
    return next(e for e in engines if e.spec.name == name)


@pytest.fixture
def bg_proxy(engines: list[EngineProcess], tmp_path: Path):  # type: ignore[no-untyped-def]
    with ProxyThread(external_config(engines, tmp_path, auth={"admin_key": "admin-bg"},
                                     limits={"drain_timeout_s": 30.0})) as p:
        yield p


async def _traffic(url: str, stop: asyncio.Event, statuses: list[int]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as h:
        n = 0
        while not stop.is_set():
            body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 8,
                    "stream": n % 2 == 1}
            r = await h.post("/v1/completions", json=body)
            statuses.append(r.status_code)
            n += 1


def test_replace_by_url_under_traffic_loses_nothing(bg_proxy: ProxyThread,
                                                    engines: list[EngineProcess]):
    latency, throughput = _by_name(engines, "latency"), _by_name(engines, "throughput")

    async def run() -> tuple[httpx.Response, list[int]]:
        stop, statuses = asyncio.Event(), list[int]()
        clients = [asyncio.create_task(_traffic(bg_proxy.url, stop, statuses)) for _ in range(4)]
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient(base_url=bg_proxy.url, timeout=120) as h:
            r = await h.post("/admin/workers/latency/replace", headers=ADMIN, json={
                "url": throughput.url, "config": throughput.spec.config.to_dict()})
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*clients)
        return r, statuses

    r, statuses = asyncio.run(run())
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["old_url"] == latency.url and report["new_url"] == throughput.url
    assert report["num_abandoned"] == 0 and report["total_s"] >= report["drain_s"] >= 0
    assert len(statuses) >= 8 and set(statuses) == {200}
    workers = {w["name"]: w for w in httpx.get(bg_proxy.url + "/admin/workers",
                                               headers=ADMIN).json()["workers"]}
    assert set(workers) == {"latency", "throughput"}
    assert workers["latency"]["url"] == throughput.url and not workers["latency"]["draining"]
    assert latency.proc.poll() is None  # attached by URL: detached, never stopped
    # the name now routes to the candidate's server with the candidate's config
    pool = bg_proxy.app[keys.POOL]
    assert pool.workers["latency"].view.config == throughput.spec.config


def test_second_replacement_of_the_same_worker_is_refused(bg_proxy: ProxyThread,
                                                          engines: list[EngineProcess]):
    other = _by_name(engines, "throughput")

    async def both() -> object:
        bluegreen = bg_proxy.app[keys.BLUEGREEN]
        first = asyncio.create_task(bluegreen.replace("latency", ReplaceRequest(url=other.url)))
        await asyncio.sleep(0)
        assert bluegreen.busy("latency")
        with pytest.raises(ReplacementBusy):
            await bluegreen.replace("latency", ReplaceRequest(url=other.url))
        report = await first
        assert not bluegreen.busy("latency")
        return report

    report = bg_proxy.call(both())
    assert report.new_url == other.url  # type: ignore[attr-defined]


def test_bad_replacements_leave_the_worker_serving(bg_proxy: ProxyThread,
                                                   engines: list[EngineProcess]):
    latency = _by_name(engines, "latency")
    with httpx.Client(base_url=bg_proxy.url, headers=ADMIN, timeout=60) as h:
        assert h.post("/admin/workers/latency/replace", json={},
                      headers={"x-admin-key": "wrong"}).status_code == 401
        r = h.post("/admin/workers/latency/replace", json={})  # attached: needs url or launch
        assert r.status_code == 400 and "url" in r.json()["error"]["message"]
        r = h.post("/admin/workers/latency/replace", json={"url": "ftp://x"})
        assert r.status_code == 400
        r = h.post("/admin/workers/latency/replace", json={"drain_timeout_s": -1})
        assert r.status_code == 400 and "drain_timeout_s" in r.json()["error"]["message"]
        r = h.post("/admin/workers/latency/replace", content=b"not json")
        assert r.status_code == 400
        workers = {w["name"]: w for w in h.get("/admin/workers").json()["workers"]}
        assert set(workers) == {"latency", "throughput"}
        assert workers["latency"]["url"] == latency.url and workers["latency"]["healthy"]
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200


def test_candidate_spec_rules():
    from polyinfer.config import CompiledConfig, ConfigError
    from proxy.bluegreen import CANDIDATE_SUFFIX, candidate_spec
    from proxy.config import LaunchSpec, WorkerSpec, external_worker

    launched = WorkerSpec(name="w", launch=LaunchSpec(port=9000, args=("--x",)),
                          config=CompiledConfig(backend="vllm"))
    new_config = CompiledConfig(backend="vllm", served_model_name="m")
    spec = candidate_spec(launched, ReplaceRequest(config=new_config))
    assert spec.name == "w" + CANDIDATE_SUFFIX and spec.config == new_config
    assert spec.launch is not None and spec.launch.port == 0 and spec.launch.args == ("--x",)
    own = candidate_spec(launched, ReplaceRequest(launch=LaunchSpec(port=9001)))
    assert own.launch == LaunchSpec(port=9001) and own.config == launched.config
    bare = external_worker("http://10.0.0.1:8000", 0)
    moved = candidate_spec(bare, ReplaceRequest(url="http://10.0.0.2:8000/"))
    assert moved.url == "http://10.0.0.2:8000" and moved.discover
    assert not candidate_spec(bare, ReplaceRequest(url="http://10.0.0.2:8000",
                                                   config=new_config)).discover
    with pytest.raises(ConfigError, match="url"):
        candidate_spec(bare, ReplaceRequest())
