"""FIXTURE: a loopback OpenAI-compatible server whose timing the test scripts.

``ScriptedUpstream`` answers ``/v1/completions`` and ``/v1/chat/completions``
with SSE chunks written on a schedule the test sets (delay before the first
token, delay between chunks, tokens per chunk, what ``usage`` says, status,
headers, a stream cut short). It records, on the same ``perf_counter`` clock
as the client under test (same process), when each request arrived and when
each chunk was written, so tests can check loadgen's measurements against
what really happened.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web


@dataclass(frozen=True)
class Script:
    ttft_s: float = 0.0  # sleep before the first token chunk
    itl_s: float = 0.0  # sleep between token chunks
    tokens_per_chunk: int = 1
    usage_completion_tokens: int | None = None  # None: the true count; -1: send no usage
    status: int = 200
    role_chunk: bool = True  # chat: a role-only chunk, sent at once
    cut_after_chunks: int | None = None  # end the stream early (no usage, no [DONE])
    headers: tuple[tuple[str, str], ...] = ()


@dataclass
class Received:
    path: str
    body: dict[str, Any]
    recv_s: float  # perf_counter when the handler started
    chunk_s: list[float] = field(default_factory=list)  # perf_counter after each token chunk


class ScriptedUpstream:
    """FIXTURE (a fake upstream): real aiohttp server on 127.0.0.1, scripted timing."""

    def __init__(self, script: Script | Callable[[dict[str, Any]], Script] = Script()) -> None:
        self.script = script
        self.received: list[Received] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.model_root: str | None = None  # reported as the model's "root" when set
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        model: dict[str, Any] = {"id": "scripted-model"}
        if self.model_root is not None:
            model["root"] = self.model_root
        return web.json_response({"object": "list", "data": [model]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f"vllm:num_requests_running {self.in_flight}\n"
                                 "vllm:num_requests_waiting 0\n")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        got = Received(request.path, await request.json(), time.perf_counter())
        self.received.append(got)
        script = self.script(got.body) if callable(self.script) else self.script
        if script.status != 200:
            # NOTE: the message quotes the prompt, as some servers' validation errors do
            prompt = got.body.get("prompt") or str(got.body.get("messages"))
            return web.json_response({"error": {
                "message": f"scripted failure for prompt {prompt!r}",
                "type": "server_error", "code": script.status}}, status=script.status)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._stream(request, got, script)
        finally:
            self.in_flight -= 1

    async def _stream(self, request: web.Request, got: Received, script: Script
                      ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           **dict(script.headers)})
        await resp.prepare(request)
        chat = got.path.endswith("chat/completions")
        if chat and script.role_chunk:
            await resp.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
        num_tokens = int(got.body.get("max_tokens") or 16)
        sent = 0
        while sent < num_tokens:
            if script.cut_after_chunks is not None and len(got.chunk_s) >= script.cut_after_chunks:
                return resp  # handler returns: stream ends without usage or [DONE]
            await asyncio.sleep(script.ttft_s if sent == 0 else script.itl_s)
            n = min(script.tokens_per_chunk, num_tokens - sent)
            text = "tok " * n
            choice = {"index": 0, "delta": {"content": text}} if chat else \
                {"index": 0, "text": text}
            await resp.write(_sse({"choices": [choice]}))
            got.chunk_s.append(time.perf_counter())
            sent += n
        usage = script.usage_completion_tokens
        if usage != -1:
            await resp.write(_sse({"choices": [], "usage": {
                "prompt_tokens": 7, "completion_tokens": sent if usage is None else usage}}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"
