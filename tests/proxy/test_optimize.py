"""`polyinfer serve --optimize`: the optimizer runs beside the proxy and sees its traffic."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from proxy.optimize import OptimizeSetupError
from tests.proxy.servers import ProxyThread, external_config


def _stats(url: str) -> dict:
    return httpx.get(url + "/stats", timeout=10).json()


def test_optimizer_observes_live_traffic_and_shows_in_stats(engines, tmp_path: Path):
    board = tmp_path / "board.sqlite"
    # min_records above what the test sends: the service starts its measurement
    # engine, then watches traffic without starting a (minutes-long) campaign.
    config = external_config(engines, tmp_path, optimize={
        "enabled": True, "min_records": 1000, "board_path": str(board)})
    with ProxyThread(config) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", timeout=120)
        for i in range(4):
            done = client.completions.create(model="tiny-target", prompt=f"def f{i}(x):",
                                              max_tokens=4, temperature=0)
            assert done.choices[0].text is not None
        deadline = time.monotonic() + 240
        while True:  # one optimizer per engine worker, each seeing its own worker's records
            docs = _stats(proxy.url)["optimizers"]
            if (all(d["state"] == "waiting for traffic" for d in docs.values())
                    and sum(d["records"] for d in docs.values()) >= 4):
                break
            for doc in docs.values():
                assert doc["state"] != "failed", doc["last_error"]
            assert time.monotonic() < deadline, docs
            time.sleep(0.5)
        assert set(docs) == {e.spec.name for e in engines}
        for name, doc in docs.items():
            assert doc["worker"] == name
            assert doc["timings"]["cold_start_s"] > 0  # its own persistent measurement engine
            assert doc["bad_records"] == 0
            assert doc["board"] == str(tmp_path / f"board-{name}.sqlite")
        # the proxy keeps serving while the optimizer runs
        again = client.completions.create(model="tiny-target", prompt="x = ", max_tokens=2)
        assert again.usage.completion_tokens >= 1
    assert all((tmp_path / f"board-{e.spec.name}.sqlite").exists() for e in engines)


def test_optimize_names_an_unknown_worker(engines, tmp_path: Path):
    config = external_config(engines, tmp_path, optimize={"enabled": True, "worker": "nope"})
    with pytest.raises(OptimizeSetupError, match="optimize.worker"):
        with ProxyThread(config):
            pass


def test_stats_has_no_optimizer_section_when_off(proxy):
    assert "optimizer" not in _stats(proxy.url)


def test_serve_flags_turn_the_optimizer_on():
    from proxy.cli import build_parser
    from proxy.serve_cli import build_config

    args = build_parser().parse_args(["serve", "--worker", "http://127.0.0.1:9", "--optimize"])
    config = build_config(args)
    assert config.optimize.enabled and config.optimize.worker == ""
    args = build_parser().parse_args(["serve", "--optimize-worker", "latency"])
    config = build_config(args)
    assert config.optimize.enabled and config.optimize.worker == "latency"
    assert not build_config(build_parser().parse_args(["serve"])).optimize.enabled


def test_serve_flags_enable_every_agent_and_the_llm_endpoint():
    from optimizer.service import AGENT_NAMES
    from proxy.cli import build_parser
    from proxy.serve_cli import build_config

    args = build_parser().parse_args([
        "serve", "--optimize", "--optimize-agents", "costmodel,bayes,evolution",
        "--optimize-llm-url", "http://127.0.0.1:9/v1", "--optimize-llm-model", "fake-llm"])
    opt = build_config(args).optimize
    assert opt.enabled and set(opt.agents) == set(AGENT_NAMES)
    assert opt.llm_url == "http://127.0.0.1:9/v1" and opt.llm_model == "fake-llm"


def test_every_engine_worker_is_tuned_in_declared_order(tmp_path: Path):
    from polyinfer.config import CompiledConfig
    from proxy.config import HealthConfig, OptimizeConfig, WorkerSpec
    from proxy.optimize import _board_for, pick_workers
    from proxy.pool import WorkerPool

    pool = WorkerPool(HealthConfig(), tmp_path)
    for name, backend in (("throughput", "engine"), ("gpu", "vllm"), ("latency", "engine")):
        spec = WorkerSpec(name=name, url=f"http://127.0.0.1:1/{name}",
                          config=CompiledConfig(backend=backend))
        pool.workers[name] = pool._make_worker(spec, spec.url, None)
    # the pool holds them as they became healthy; the config declares latency first
    declared = ("latency", "gpu", "throughput")
    picked = pick_workers(pool, OptimizeConfig(enabled=True), declared)
    assert [w.name for w in picked] == ["latency", "throughput"]
    assert [w.name for w in pick_workers(pool, OptimizeConfig(worker="throughput"),
                                         declared)] == ["throughput"]
    assert _board_for(Path("/r/board.sqlite"), "latency", 2) == "/r/board-latency.sqlite"
    assert _board_for(Path("/r/board.sqlite"), "latency", 1) == "/r/board.sqlite"
