"""Capability-aware routing and OpenAI's validation at the proxy, with the real openai client
on real engine workers: a request goes only to workers whose backend serves its options,
what a worker refuses with ``unsupported_option`` is learned, and a request no worker can
serve is a 400 naming the option."""

from __future__ import annotations

import collections
import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from proxy import keys
from proxy.config import ProxyConfig
from tests.proxy.servers import EngineProcess, ProxyThread

MODEL = "tiny-target"
CHAT = [{"role": "user", "content": "Write a python function that adds two numbers."}]


def client(proxy: ProxyThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_engine_options_are_served_through_the_proxy(proxy: ProxyThread) -> None:
    r = client(proxy).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, n=2, temperature=0.9, seed=3,
        logprobs=True, top_logprobs=2, presence_penalty=0.5, logit_bias={"13": 1.0})
    assert [c.index for c in r.choices] == [0, 1]
    assert all(len(c.logprobs.content) >= 1 for c in r.choices)


def test_structured_output_is_served_through_the_proxy(proxy: ProxyThread) -> None:
    r = client(proxy).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=300, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
            "additionalProperties": False}}})
    assert isinstance(json.loads(r.choices[0].message.content)["n"], int)


def test_a_seed_gives_one_text_whatever_depth_the_proxy_picks(proxy: ProxyThread) -> None:
    texts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for _ in range(6):
        raw = client(proxy).chat.completions.with_raw_response.create(
            model=MODEL, messages=CHAT, max_tokens=32, temperature=0.8, seed=42)
        texts[raw.headers["x-polyinfer-worker"]][raw.parse().choices[0].message.content] += 1
    assert all(len(by_text) == 1 for by_text in texts.values()), texts


def test_a_seed_gives_one_text_on_either_engine_worker(proxy: ProxyThread) -> None:
    """Round-robin over the two engine workers (same model and dtype; n-gram speculation at
    depth 3 on one, none on the other): a seed's text is keyed by seed and position alone,
    so 4 identical requests, one after another and then at once, give one text."""
    def seeded() -> tuple[str, str]:
        raw = client(proxy).chat.completions.with_raw_response.create(
            model=MODEL, messages=CHAT, max_tokens=32, temperature=0.8, seed=42)
        return raw.headers["x-polyinfer-worker"], raw.parse().choices[0].message.content

    one_by_one = [seeded() for _ in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        at_once = list(pool.map(lambda _: seeded(), range(4)))
    assert {w for w, _ in one_by_one} == {"latency", "throughput"}  # round-robin: both
    assert len({t for _, t in one_by_one + at_once}) == 1, one_by_one + at_once


def _post(proxy: ProxyThread, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    with httpx.Client(base_url=proxy.url, timeout=60) as h:
        return h.post("/v1/chat/completions", json=body, **kwargs)


def test_no_worker_serves_it_is_a_400_naming_the_option(proxy: ProxyThread) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(proxy).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                              tools=[{"type": "function", "function": {
                                                  "name": "f", "parameters": {}}}])
    assert e.value.code == "unsupported_option" and e.value.param == "tools"
    assert e.value.response.headers["x-polyinfer-worker"] == "none"  # never forwarded


@pytest.mark.parametrize("change, param", [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0]"),
    ({"temperature": 100}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"n": 0}, "n"),
    ({"logprobs": 3}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
])
def test_openai_validation_at_the_proxy(proxy: ProxyThread, change: dict[str, Any],
                                        param: str) -> None:
    r = _post(proxy, {"model": MODEL, "messages": CHAT, "max_tokens": 2, **change})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_only_json_bodies(proxy: ProxyThread) -> None:
    body = b'{"model": "tiny-target", "messages": [{"role": "user", "content": "hi"}]}'
    with httpx.Client(base_url=proxy.url, timeout=60) as h:
        r = h.post("/v1/chat/completions", content=body, headers={"Content-Type": "text/plain"})
        assert r.status_code == 400 and "Content-Type" in r.json()["error"]["message"]
        ok = h.post("/v1/chat/completions", content=body[:-1] + b', "max_tokens": 2}',
                    headers={"Content-Type": "application/json"})
        assert ok.status_code == 200


def _mixed(engines: list[EngineProcess], tmp: Path) -> ProxyConfig:
    """``latency`` declared as an engine; ``throughput`` as an external server, which
    declares nothing: the proxy learns what it refuses."""
    workers = []
    for e in engines:
        cfg = e.spec.config.to_dict()
        if e.spec.name == "throughput":
            cfg = {"backend": "external", "model": e.url, "served_model_name": MODEL}
        workers.append({"name": e.spec.name, "url": e.url, "config": cfg})
    return ProxyConfig.from_dict({
        "server": {"host": "127.0.0.1", "port": 0}, "workers": workers,
        "traces": {"dir": str(tmp / "traces"), "flush_interval_s": 0.1},
        "health": {"interval_s": 0.5, "metrics_interval_s": 0.5},
        "limits": {"max_loop_lag_s": 0}, "run_dir": str(tmp / "run")})


@pytest.fixture
def mixed(engines: list[EngineProcess], tmp_path: Path) -> Iterator[ProxyThread]:
    with ProxyThread(_mixed(engines, tmp_path)) as p:
        yield p


def test_an_option_goes_only_where_it_may_be_served_and_is_learned(mixed: ProxyThread) -> None:
    pool = mixed.app[keys.POOL]
    assert "tools" in pool.workers["latency"].unsupported
    assert not pool.workers["throughput"].unsupported
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    # the first reaches throughput (which refuses); the second goes nowhere
    for tried in ("throughput", "none"):
        with pytest.raises(openai.BadRequestError) as e:
            client(mixed).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                                  tools=tools)
        assert e.value.code == "unsupported_option" and e.value.param == "tools"
        assert e.value.response.headers["x-polyinfer-worker"] == tried
    assert "tools" in pool.workers["throughput"].unsupported
    assert pool.workers["latency"].view.outstanding_requests == 0
    # what both serve still goes to either
    seen = {client(mixed).chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=2, n=2).headers["x-polyinfer-worker"]
        for _ in range(6)}
    assert seen <= {"latency", "throughput"} and seen
