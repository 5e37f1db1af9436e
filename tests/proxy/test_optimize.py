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
        deadline = time.monotonic() + 180
        while True:
            doc = _stats(proxy.url)["optimizer"]
            if doc["state"] == "waiting for traffic" and doc["records"] >= 4:
                break
            assert doc["state"] != "failed", doc["last_error"]
            assert time.monotonic() < deadline, doc
            time.sleep(0.5)
        assert doc["timings"]["cold_start_s"] > 0  # its own persistent measurement engine
        assert doc["bad_records"] == 0
        assert doc["board"] == str(board)
        # the proxy keeps serving while the optimizer runs
        again = client.completions.create(model="tiny-target", prompt="x = ", max_tokens=2)
        assert again.usage.completion_tokens >= 1
    assert board.exists()


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
