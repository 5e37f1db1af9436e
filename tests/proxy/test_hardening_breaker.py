"""Poison requests cannot take workers out (issue 30): the breaker counts what says
something about the worker, and a request that fails on two workers is not tried on a
third. The workers are FakeBrokenUpstream servers (answers no real engine gives on
purpose) on loopback, behind a real proxy."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy.config import ProxyConfig
from tests.proxy.servers import ProxyThread
from tests.proxy.test_broken_upstream import FakeBrokenUpstream

MODEL = "tiny-target"
ADMIN = {"x-admin-key": "adm"}


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[ProxyThread, list[FakeBrokenUpstream]]]:
    """Three fakes answering as each body asks (fake_mode), except the third, which answers
    every request with a 500."""
    fakes = [FakeBrokenUpstream(), FakeBrokenUpstream(), FakeBrokenUpstream("echo_500")]
    for f in fakes:
        f.__enter__()
    config = ProxyConfig.from_dict({
        "server": {"host": "127.0.0.1", "port": 0},
        "workers": [{"name": f"w{i}", "url": f.url,
                     "config": {"backend": "external", "model": MODEL}}
                    for i, f in enumerate(fakes)],
        "routing": {"policy": "round_robin", "shape_estimator": "heuristic"},
        "traces": {"dir": str(tmp_path / "traces"), "flush_interval_s": 0.1},
        "health": {"interval_s": 60, "metrics_interval_s": 0, "breaker_failures": 3,
                   "breaker_cooldown_s": 60},
        "auth": {"admin_key": "adm"},
        "limits": {"max_loop_lag_s": 0, "max_attempts": 3},
        "run_dir": str(tmp_path / "run"),
    })
    try:
        with ProxyThread(config) as p:
            yield p, fakes
    finally:
        for f in fakes:
            f.__exit__()


def _breakers(http: httpx.Client) -> dict[str, str]:
    return {w["name"]: w["breaker"] for w in http.get("/admin/workers", headers=ADMIN
                                                      ).json()["workers"]}


def test_a_poison_body_opens_no_breaker_and_is_not_tried_everywhere(
        fleet: tuple[ProxyThread, list[FakeBrokenUpstream]]) -> None:
    p, fakes = fleet
    poison = {"model": MODEL, "fake_mode": "echo_500",
              "messages": [{"role": "user", "content": "the same body every time"}]}
    with httpx.Client(base_url=p.url, timeout=30) as http:
        for _ in range(6):
            r = http.post("/v1/chat/completions", json=poison)
            assert r.status_code == 502, r.text
            assert "not retried" in r.json()["error"]["message"]
        # two workers tried per request, never the third
        assert sum(f.num_posts for f in fakes) == 12
        assert set(_breakers(http).values()) == {"closed"}, _breakers(http)
        for i in range(6):  # every client of the model still served
            r = http.post("/v1/chat/completions", json={
                "model": MODEL, "stream": True,
                "messages": [{"role": "user", "content": f"fine {i}"}]})
            assert r.status_code == 200, r.text


def test_a_worker_failing_many_requests_is_taken_out(
        fleet: tuple[ProxyThread, list[FakeBrokenUpstream]]) -> None:
    p, fakes = fleet
    with httpx.Client(base_url=p.url, timeout=30) as http:
        for i in range(12):
            r = http.post("/v1/chat/completions", json={
                "model": MODEL, "stream": True,
                "messages": [{"role": "user", "content": f"request {i}"}]})
            assert r.status_code == 200, r.text  # failed over from w2 when it was chosen
        breakers = _breakers(http)
    assert breakers["w2"] == "open" and breakers["w0"] == breakers["w1"] == "closed", breakers
    assert fakes[2].num_posts == 3  # no more after its breaker opened
