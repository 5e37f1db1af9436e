"""The OpenAI API through the proxy, with the real openai client, on real engine workers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy import keys
from tests.proxy.servers import EngineProcess, ProxyThread, eventually, external_config, read_traces

MODEL = "tiny-target"
CODE_PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"


def client(proxy: ProxyThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_chat_non_stream_sync_client_and_headers(proxy: ProxyThread) -> None:
    raw = client(proxy).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=8)
    resp = raw.parse()
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage is not None and 1 <= resp.usage.completion_tokens <= 8
    assert raw.headers["x-polyinfer-worker"] in ("latency", "throughput")
    assert raw.headers["x-polyinfer-domain"] != "none"
    assert raw.headers["x-request-id"]
    assert "x-polyinfer-spec-depth" in raw.headers
    with httpx.Client(base_url=proxy.url) as h:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        assert h.post("/v1/completions", json=body,
                      headers={"x-request-id": "trace-42"}).headers["x-request-id"] == "trace-42"
        odd = h.post("/v1/completions", json=body, headers={"x-request-id": "x" * 500})
        assert odd.headers["x-request-id"].startswith("pi-")


def test_completions_stream_relays_chunks_and_strips_usage(proxy: ProxyThread) -> None:
    stream = client(proxy).completions.create(model=MODEL, prompt=CODE_PROMPT, max_tokens=12,
                                              stream=True)
    chunks = list(stream)
    assert len(chunks) >= 2
    assert all(c.usage is None for c in chunks), "the proxy asked for usage; the client did not"
    assert "".join(c.choices[0].text for c in chunks if c.choices)


def test_chat_stream_with_client_usage_is_kept(proxy: ProxyThread) -> None:
    stream = client(proxy).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": CODE_PROMPT}], max_tokens=10,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens >= 1
    stats = proxy.app[keys.STATS]
    assert eventually(lambda: stats.latency["ttft"]["all"].count >= 1)
    assert sum(n for (_, _, s), n in stats.requests.items() if s == "ok") == 1


async def test_async_client_concurrent_streams(proxy: ProxyThread) -> None:
    aclient = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0,
                                 timeout=60)

    async def one(i: int) -> str:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count to {i}"}],
            max_tokens=6, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    texts = await asyncio.gather(*(one(i) for i in range(12)))
    assert all(isinstance(t, str) for t in texts) and any(texts)
    await aclient.close()


def test_openai_fields_reach_the_worker(proxy: ProxyThread) -> None:
    # The worker answers logprobs in OpenAI's shape: proof the proxy passed the fields through.
    raw = client(proxy).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        logprobs=True, top_logprobs=2)
    assert raw.headers["x-polyinfer-worker"] in ("latency", "throughput")
    content = raw.parse().choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 for t in content)
    # `tools`, which no worker serves, is refused by the proxy naming the field
    with pytest.raises(openai.BadRequestError) as e:
        client(proxy).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert "tools" in str(e.value)


def test_models_merged_and_unknown_model_404(proxy: ProxyThread) -> None:
    c = client(proxy)
    assert [m.id for m in c.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="no-such-model",
                                  messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_engine_worker_gets_speculative_depth_and_reports_acceptance(proxy: ProxyThread) -> None:
    c = client(proxy)
    for _ in range(4):
        raw = c.completions.with_raw_response.create(
            model=MODEL, prompt=CODE_PROMPT * 3, max_tokens=24, extra_body={"speculative_depth": 3})
        assert raw.headers["x-polyinfer-spec-depth"] == "3"
    stats = proxy.app[keys.STATS]
    assert stats.spec_depths["3"] == 4
    drafted = sum(d for (w, _), (d, _) in stats.spec_tokens.items() if w == "latency")
    if any(w == "latency" for (w, _, _) in stats.requests):
        assert drafted > 0, "the n-gram worker reported usage.spec_decode"


def test_stats_metrics_dashboard_health(proxy: ProxyThread) -> None:
    client(proxy).chat.completions.create(model=MODEL, max_tokens=4,
                                          messages=[{"role": "user", "content": "hi"}])
    with httpx.Client(base_url=proxy.url) as h:
        stats = h.get("/stats").json()
        assert stats["requests_total"] >= 1 and stats["in_flight"] == 0
        assert {w["name"] for w in stats["workers"]} == {"latency", "throughput"}
        assert all(w["healthy"] for w in stats["workers"])
        assert stats["latency_s"]["e2e"]["all"]["count"] >= 1
        for key in ("requests_by_domain_worker", "spec_depths", "acceptance", "decision_reasons",
                    "errors", "depth_policy"):
            assert key in stats
        # the depth policy's learned state: per worker it has picked depths for
        assert set(stats["depth_policy"]) <= {"latency", "throughput"}
        text = h.get("/metrics").text
        assert "polyinfer_requests_total{" in text and "polyinfer_e2e_seconds_bucket" in text
        assert 'polyinfer_worker_healthy{backend="engine",worker="latency"} 1.0' in text
        page = h.get("/")
        assert page.status_code == 200 and "polyinfer" in page.text
        assert h.get("/health").json()["status"] == "ok"
        assert "x-request-id" in h.get("/health").headers


def test_worker_metrics_are_scraped(proxy: ProxyThread) -> None:
    latency = proxy.app[keys.POOL].workers["latency"]
    c = client(proxy)
    for _ in range(2):  # round robin: one of the two lands on the n-gram worker
        c.completions.create(model=MODEL, prompt=CODE_PROMPT * 3, max_tokens=24,
                             extra_body={"speculative_depth": 3})
    # the scrape loop reads the engine's vllm:spec_decode_* counters into the pool
    assert eventually(lambda: latency.scraped_draft_tokens > 0, timeout_s=10)
    assert 0 <= latency.scraped_accepted_tokens <= latency.scraped_draft_tokens


def test_one_trace_record_per_request(proxy: ProxyThread, tmp_path) -> None:  # type: ignore[no-untyped-def]
    c = client(proxy)
    c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "secret prompt"}],
                              max_tokens=3)
    list(c.completions.create(model=MODEL, prompt="hello", max_tokens=3, stream=True))
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="hello", max_tokens=3)
    proxy.stop()
    records = read_traces(tmp_path / "traces")
    assert len(records) == 3
    ok = [r for r in records if r["status"] == "ok"]
    assert len(ok) == 2 and all(r["e2e_s"] > 0 and r["completion_tokens"] for r in ok)
    streamed = next(r for r in ok if r["stream"])
    assert streamed["ttft_s"] is not None and streamed["ttft_s"] <= streamed["e2e_s"]
    expected = {"ts", "request_id", "model", "endpoint", "stream", "domain", "prompt_tokens",
                "max_tokens", "completion_tokens", "worker", "spec_depth", "spec_draft_tokens",
                "spec_accepted_tokens", "ttft_s", "tpot_s", "e2e_s", "queue_s", "status", "error",
                "prefix_hashes", "prefix_block_tokens", "num_attempts"}
    assert all(set(r) == expected for r in records)
    assert "secret" not in (tmp_path / "traces").joinpath(
        next((tmp_path / "traces").glob("*.jsonl")).name).read_text()


def test_prompt_text_only_when_enabled(engines, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.proxy.servers import external_config
    config = external_config(engines, tmp_path, traces={"record_prompt_text": True})
    with ProxyThread(config) as p:
        client(p).chat.completions.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "my secret words"}])
    (record,) = read_traces(tmp_path / "traces")
    assert "my secret words" in record["prompt_text"]


def test_tcp_nodelay_on_both_sides(proxy: ProxyThread) -> None:
    import socket

    # one connection stays on the lean hot-path protocol, the other is handed to aiohttp
    with httpx.Client(base_url=proxy.url) as h, httpx.Client(base_url=proxy.url) as g:
        h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        g.get("/v1/models")

        def nodelay(transport) -> bool:  # type: ignore[no-untyped-def]
            sock = transport.get_extra_info("socket")
            return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        runner = proxy.server._runner  # type: ignore[union-attr]
        (site,) = runner.sites
        lean = [c.transport for c in site._fast.connections if c.transport is not None]
        handed_over = [c.transport for c in runner.server.connections
                       if c.transport is not None]
        upstream = [conn.transport for pool in
                    proxy.app[keys.RELAY].client._pools.values()  # type: ignore[union-attr]
                    for conn in pool.idle if conn.transport is not None]
        assert lean and handed_over and upstream
        assert all(nodelay(t) for t in lean + handed_over + upstream)


def test_bare_worker_url_discovers_models_and_engine_config(engines, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    from proxy.config import external_worker
    from tests.proxy.servers import external_config
    latency = next(e for e in engines if e.spec.name == "latency")
    config = dataclasses.replace(external_config(engines, tmp_path),
                                 workers=(external_worker(latency.url + "/", 0),))
    with ProxyThread(config) as p:
        worker = p.app[keys.POOL].workers["w0"]
        assert worker.models == {MODEL}
        assert worker.backend == "engine" and worker.view.config.engine.spec_method == "ngram"
        raw = client(p).completions.with_raw_response.create(model=MODEL, prompt=CODE_PROMPT,
                                                             max_tokens=4)
        assert raw.headers["x-polyinfer-worker"] == "w0"
        assert raw.headers["x-polyinfer-spec-depth"] != "default"  # adaptive depth was sent


def slo_requests(engines: list[EngineProcess]) -> dict[str, float]:
    """polyinfer:slo_requests_total by SLO, summed over the engine workers."""
    total = {"ttft": 0.0, "tpot": 0.0}
    for e in engines:
        for family in text_string_to_metric_families(httpx.get(f"{e.url}/metrics").text):
            if family.name == "polyinfer:slo_requests":
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        total[sample.labels["slo"]] += sample.value
    return total


@pytest.mark.parametrize("forward", [True, False])
def test_engine_workers_get_the_request_slos(engines: list[EngineProcess], tmp_path: Path,
                                             forward: bool) -> None:
    """Each request's SLOs reach the engine (engine.pacing), its own field or else its
    domain's from the routing config; ``forward_slos: false`` strips both."""
    routing = {"slo_tpot_s": {"*": 0.5}, "forward_slos": forward}
    with ProxyThread(external_config(engines, tmp_path, routing=routing)) as p:
        before = slo_requests(engines)
        c = client(p)
        for _ in range(2):  # the domain's TPOT SLO only
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        c.completions.create(model=MODEL, prompt="hi", max_tokens=2,  # its own, both
                             extra_body={"slo_ttft_s": 3.0, "slo_tpot_s": 0.2})
        after = slo_requests(engines)
    got = {k: after[k] - before[k] for k in before}
    assert got == ({"ttft": 1, "tpot": 3} if forward else {"ttft": 0, "tpot": 0})
