"""A real engine server on loopback, driven by the real `openai` client and aiohttp."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import openai
import pytest

from tests.engine.conftest import EngineProcess
from tests.engine.prompts import mixed_prompts

pytestmark = pytest.mark.timeout(300)


def client(server: EngineProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def aclient(server: EngineProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


async def metrics(server: EngineProcess) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(server.base_url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z0-9_:]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m and not line.startswith("#"):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


async def wait_idle(server: EngineProcess, timeout_s: float = 30.0) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        m = await metrics(server)
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            return m
        assert loop.time() < deadline, f"engine still busy: {m}"
        await asyncio.sleep(0.2)


def test_models_health_and_metric_names(engine_server: EngineProcess) -> None:
    models = client(engine_server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    m = asyncio.run(metrics(engine_server))
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count",
                 "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total"):
        assert name in m, name


def test_completion_stream_equals_non_stream(engine_server: EngineProcess) -> None:
    c = client(engine_server)
    prompt = mixed_prompts(3)[2]
    full = c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    assert full.usage is not None and full.usage.completion_tokens <= 20
    assert full.usage.model_extra["spec_decode"] == {"num_draft_tokens": 0,
                                                     "num_accepted_tokens": 0}
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == \
        full.choices[0].finish_reason


def test_chat_stream_with_usage_and_spec_depth(engine_server: EngineProcess) -> None:
    c = client(engine_server)
    messages = [{"role": "user", "content": "Repeat: one two three one two three one two three"}]
    full = c.chat.completions.create(model="tiny", messages=messages, max_tokens=30,
                                     temperature=0, extra_body={"speculative_depth": 3,
                                                                "ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 30
    spec = full.usage.model_extra["spec_decode"]
    assert spec["num_draft_tokens"] > 0
    stream = c.chat.completions.create(model="tiny", messages=messages, max_tokens=30,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content  # depth 3 == depth 0 under greedy
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    m = asyncio.run(metrics(engine_server))
    assert m["vllm:spec_decode_num_draft_tokens_total"] >= spec["num_draft_tokens"]


def test_stop_string_is_trimmed(engine_server: EngineProcess) -> None:
    c = client(engine_server)
    prompt = mixed_prompts(1)[0]
    ref = c.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0,
                               extra_body={"ignore_eos": True}).choices[0].text
    stop = ref[10:14]
    got = c.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0,
                               stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert got.finish_reason == "stop" and got.text == ref[: ref.index(stop)]


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (json.dumps({"model": "nope", "prompt": "hi"}).encode(), 404, "model"),
    (json.dumps({"prompt": "hi", "n": 0}).encode(), 400, "n"),
    (json.dumps({"prompt": "hi", "max_tokens": -3}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "word " * 3000}).encode(), 400, "prompt"),
    (json.dumps({"max_tokens": 3}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "hi", "temperature": "hot"}).encode(), 400, "temperature"),
])
def test_bad_requests_get_openai_errors_and_engine_keeps_serving(
        engine_server: EngineProcess, body: bytes, status: int, param: str | None) -> None:
    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            async with s.post(engine_server.base_url + "/v1/completions", data=body,
                              headers={"Content-Type": "application/json"}) as r:
                assert r.status == status
                err = (await r.json())["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]
                assert err["param"] == param
    asyncio.run(go())
    ok = client(engine_server).completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_openai_client_raises_on_bad_request(engine_server: EngineProcess) -> None:
    with pytest.raises(openai.BadRequestError):
        client(engine_server).completions.create(model="tiny", prompt="hi", max_tokens=2,
                                                 best_of=3)
    with pytest.raises(openai.NotFoundError):
        client(engine_server).chat.completions.create(
            model="gpt-x", messages=[{"role": "user", "content": "hi"}])


async def test_client_disconnect_aborts_and_frees_cache(engine_server: EngineProcess) -> None:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(engine_server.base_url + "/v1/completions", json=body) as r:
            await r.content.readline()
            await r.content.readline()
            m = await metrics(engine_server)
            assert m["vllm:kv_cache_usage_perc"] > 0
    await wait_idle(engine_server)  # the stream's close aborted the request
    body["stream"] = False
    with pytest.raises(asyncio.TimeoutError):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as s:
            async with s.post(engine_server.base_url + "/v1/completions", json=body) as r:
                await r.read()
    await wait_idle(engine_server)


async def test_reload_under_load_loses_nothing(engine_server: EngineProcess) -> None:
    ac = aclient(engine_server)
    prompts = mixed_prompts(12)

    async def one(p: str) -> tuple[str, int]:
        r = await ac.completions.create(model="tiny", prompt=p, max_tokens=40, temperature=0,
                                        extra_body={"ignore_eos": True})
        return r.choices[0].text, r.usage.completion_tokens

    reference = await asyncio.gather(*(one(p) for p in prompts))
    async with aiohttp.ClientSession() as s:
        async with s.get(engine_server.base_url + "/admin/config") as r:
            live = await r.json()
        new = json.loads(json.dumps(live))
        new["engine"].update(max_num_seqs=4, max_num_batched_tokens=128, kv_cache_tokens=4096)
        tasks = [asyncio.create_task(one(p)) for p in prompts]
        await asyncio.sleep(0.5)
        async with s.post(engine_server.base_url + "/admin/reload", json=new) as r:
            assert r.status == 200
            answer = await r.json()
        assert answer["reload_s"] > 0 and answer["config"]["engine"]["max_num_seqs"] == 4
        results = await asyncio.gather(*tasks)
        assert results == reference  # every request completed, same greedy text
        async with s.post(engine_server.base_url + "/admin/reload",
                          json={"engine": {"max_num_seqs": 0}}) as r:
            assert r.status == 400 and "max_num_seqs" in (await r.json())["error"]["message"]
        async with s.post(engine_server.base_url + "/admin/reload", json=live) as r:
            assert r.status == 200
        async with s.get(engine_server.base_url + "/admin/config") as r:
            assert (await r.json()) == live


async def test_reload_refuses_what_this_device_cannot_run(engine_server: EngineProcess) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(engine_server.base_url + "/admin/config") as r:
            live = await r.json()
        bad = json.loads(json.dumps(live))
        bad["engine"]["execution"] = "cuda_graph"
        async with s.post(engine_server.base_url + "/admin/reload", json=bad) as r:
            assert r.status == 400 and "CUDA" in (await r.json())["error"]["message"]
        other = dict(live, model="/nonexistent/model")
        async with s.post(engine_server.base_url + "/admin/reload", json=other) as r:
            assert r.status == 400 and "model" in (await r.json())["error"]["message"]
        async with s.post(engine_server.base_url + "/admin/reload", data=b"nope") as r:
            assert r.status == 400
        async with s.get(engine_server.base_url + "/admin/config") as r:
            assert (await r.json()) == live
    ok = client(engine_server).completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_cli_rejects_a_bad_config(tmp_path) -> None:
    import subprocess
    import sys

    path = tmp_path / "bad.yaml"
    path.write_text("engine:\n  max_num_seqs: -1\n")
    proc = subprocess.run([sys.executable, "-m", "engine", "--config", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "max_num_seqs" in proc.stderr
