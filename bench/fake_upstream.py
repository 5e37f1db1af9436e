"""FakeFastUpstream: a benchmark fixture standing in for an infinitely fast engine.

An OpenAI-compatible server (chat + completions, stream and not, /v1/models,
/health, /metrics) that answers at once: a stream is a fixed number of
content chunks written back to back, then the usage chunk when asked for,
then ``[DONE]``. It measures proxies, not models; it is never a product path.

    python bench/fake_upstream.py --port 9100 --chunks 16
    python bench/fake_upstream.py --port 9100 --chunks 16 --token-interval-ms 5

``--token-interval-ms`` paces a stream as an engine does (a write per token, that many
milliseconds apart) instead of writing it whole: a relay then reads and writes each token
on its own, as it does in front of a real engine.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
from aiohttp import web

MODEL = "fake-fast"


def _chunk(i: int, created: int) -> bytes:
    obj = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": created,
           "model": MODEL, "choices": [{"index": 0, "delta": {"content": f"tok{i} "},
                                        "finish_reason": None}]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class FakeFastUpstream:
    """The fixture's state: how many chunks to stream, and how many requests it served."""

    def __init__(self, num_chunks: int = 16, token_interval_s: float = 0.0) -> None:
        self.num_chunks = num_chunks
        self.token_interval_s = token_interval_s
        self.num_requests = 0
        created = int(time.time())
        self._chunks = [_chunk(i, created) for i in range(num_chunks)]
        self._body = b"".join(self._chunks)
        usage = {"prompt_tokens": 8, "completion_tokens": num_chunks,
                 "total_tokens": 8 + num_chunks}
        self._usage_event = b"data: " + orjson.dumps(
            {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": created,
             "model": MODEL, "choices": [], "usage": usage}) + b"\n\n"
        self._json = orjson.dumps({
            "id": "chatcmpl-fake", "object": "chat.completion", "created": created,
            "model": MODEL, "usage": usage,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant",
                                     "content": " ".join(f"tok{i}" for i in range(num_chunks))}}]})

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.num_requests += 1
        if not body.get("stream"):
            return web.Response(body=self._json, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.token_interval_s > 0:
            for chunk in self._chunks:
                await asyncio.sleep(self.token_interval_s)
                await resp.write(chunk)
        else:
            await resp.write(self._body)
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(self._usage_event)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "fixture"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.completion)
        app.router.add_post("/v1/completions", self.completion)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9100)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--token-interval-ms", type=float, default=0.0,
                   help="a write per chunk, this far apart (0: the stream written whole)")
    p.add_argument("--reuse-port", action="store_true",
                   help="SO_REUSEPORT: several processes serve one port")
    args = p.parse_args()
    if not 0 <= args.token_interval_ms <= 10_000:
        p.error(f"--token-interval-ms: expected 0-10000, got {args.token_interval_ms}")
    web.run_app(FakeFastUpstream(args.chunks, args.token_interval_ms / 1000).app(),
                host=args.host, port=args.port,
                access_log=None, print=None, loop=_new_loop(),
                reuse_port=args.reuse_port or None)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


if __name__ == "__main__":
    main()
