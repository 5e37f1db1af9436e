"""TTFT is timed at the first generated token, not at the stream's first event.

A chat stream opens with a role-only chunk that engines (ours and vLLM) send before
prefill; a proxy that timed that event would report prefill and queueing as zero to
the traces and to the router's TTFT model.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import orjson
import pytest
from aiohttp import web

from proxy import keys
from proxy.config import ProxyConfig
from proxy.relay import _carries_output
from tests.proxy.servers import ProxyThread, eventually, read_traces

MODEL = "scripted"
PREFILL_S = 0.3  # how long the scripted worker waits between the role chunk and the text


@pytest.mark.parametrize(("events", "expected"), [
    (b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n', False),
    (b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n', False),
    (b'data: {"choices":[{"delta":{"content":null}}]}\n\n', False),
    (b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n', True),
    (b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n', True),  # spaced JSON
    (b'data: {"choices":[{"text":"","index":0}]}\n\n', False),
    (b'data: {"choices":[{"text":" once","index":0}]}\n\n', True),
    (b'data: {"choices":[{"delta":{"reasoning_content":"so"}}]}\n\n', True),
    (b'data: {"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}\n\n', True),
    (b'data: {"choices":[{"delta":{"tool_calls":[]}}]}\n\n', False),
    # a key inside generated text is escaped, and the text itself is empty here
    (b'data: {"choices":[{"delta":{"role":"assistant","content":""}}],'
     b'"x":"\\"content\\":\\"y\\""}\n\n', False),
    # role chunk and first token in one read: output
    (b'data: {"choices":[{"delta":{"content":""}}]}\n\n'
     b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', True),
    (b"data: [DONE]\n\n", False),
])
def test_carries_output(events: bytes, expected: bool) -> None:
    assert _carries_output(events) is expected


def _chunk(delta: dict[str, object], finish: str | None = None) -> bytes:
    body = {"id": "c1", "object": "chat.completion.chunk", "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def _chat(request: web.Request) -> web.StreamResponse:
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_chunk({"role": "assistant", "content": ""}))
    await asyncio.sleep(PREFILL_S)  # the prefill a real worker would spend here
    for word in ("Hello", " there"):
        await resp.write(_chunk({"content": word}))
    await resp.write(_chunk({}, finish="stop"))
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


class ScriptedWorker:
    """FAKE worker (test fixture): sends a role chunk, waits PREFILL_S, then the text.

    A real engine's prefill time varies with the machine; the assertion needs a known
    gap between the first event and the first token.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", _health)
        app.router.add_get("/v1/models", _models)
        app.router.add_post("/v1/chat/completions", _chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> ScriptedWorker:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture
def scripted_proxy(tmp_path: Path) -> Iterator[tuple[ProxyThread, Path]]:
    with ScriptedWorker() as worker:
        config = ProxyConfig.from_dict({
            "server": {"host": "127.0.0.1", "port": 0},
            "workers": [{"name": "scripted", "url": worker.url, "discover": False,
                         "config": {"backend": "external", "model": MODEL}}],
            "traces": {"dir": str(tmp_path / "traces"), "flush_interval_s": 0.1},
            "health": {"interval_s": 0.2, "metrics_interval_s": 0},
            "limits": {"max_loop_lag_s": 0},
            "run_dir": str(tmp_path / "run"),
        })
        with ProxyThread(config) as proxy:
            yield proxy, tmp_path / "traces"


def test_stream_ttft_is_timed_at_the_first_token(scripted_proxy: tuple[ProxyThread, Path]
                                                 ) -> None:
    proxy, traces = scripted_proxy
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none")
    assert eventually(lambda: bool(proxy.app[keys.POOL].model_names()), 10.0)
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "Hello there"
    assert time.perf_counter() - start >= PREFILL_S
    assert eventually(lambda: len(read_traces(traces)) == 1, 10.0)
    (record,) = read_traces(traces)
    assert record["status"] == "ok"
    # the role chunk arrived at once; the first token PREFILL_S later
    assert record["ttft_s"] >= PREFILL_S
    assert record["e2e_s"] >= record["ttft_s"]
