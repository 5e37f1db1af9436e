"""Write flow control on the lean path: a client that stops reading holds the stream back
(the proxy's buffers stay bounded, the worker connection stops being read), and the whole
stream still arrives, byte for byte, once it reads again.

The worker is a test fixture on loopback that streams 8 MB of SSE events at once: no
engine can produce that fast, and only a fast producer fills the buffers.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httptools
import orjson
import pytest
from aiohttp import web

from proxy.config import ProxyConfig
from proxy.server import ProxySite
from proxy.upstream import _MAX_BUFFERED
from tests.proxy.servers import ProxyThread, eventually

EVENT = b"data: " + orjson.dumps({"choices": [{"delta": {"content": "x" * 65000}}]}) + b"\n\n"
NUM_EVENTS = 256  # ~16 MB: more than the loopback socket buffers between them hold


class FastProducerWorker:
    """An OpenAI-style worker (fixture) whose stream is written as fast as the socket takes it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.runner: web.AppRunner | None = None
        self.port = 0
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(NUM_EVENTS):
            await resp.write(EVENT)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._stream)
        app.router.add_get("/health", _health)
        app.router.add_get("/metrics", _metrics)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def __enter__(self) -> FastProducerWorker:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.runner is not None
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(text="vllm:num_requests_running 0\n")


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[ProxyThread]:
    with FastProducerWorker() as worker:
        config = ProxyConfig.from_dict({
            "server": {"host": "127.0.0.1", "port": 0},
            "workers": [{"name": "fast", "url": f"http://127.0.0.1:{worker.port}",
                         "config": {"backend": "external", "model": "fast"}}],
            "traces": {"dir": str(tmp_path / "traces")},
            "health": {"interval_s": 0.2},
            "limits": {"max_loop_lag_s": 0}})
        with ProxyThread(config) as p:
            yield p


def _client_write_buffer(p: ProxyThread) -> int:
    """Bytes the proxy holds for its one client connection, read on the proxy's loop."""
    async def read() -> int:
        assert p.server is not None and p.server._runner is not None
        (site,) = [s for s in p.server._runner.sites if isinstance(s, ProxySite)]
        assert site._fast is not None
        (conn,) = site._fast.connections
        assert conn.transport is not None
        return int(conn.transport.get_write_buffer_size())
    return p.call(read())  # type: ignore[no-any-return]


class _Body:
    """llhttp callbacks: the de-chunked body of one response."""

    def __init__(self) -> None:
        self.body = bytearray()
        self.status = 0
        self.complete = False
        self.parser = httptools.HttpResponseParser(self)

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.complete = True


@pytest.mark.timeout(120)
def test_a_client_that_stops_reading_holds_the_stream_back(proxy: ProxyThread) -> None:
    host, port = proxy.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
    sock.settimeout(60)
    sock.connect((host, int(port)))
    body = orjson.dumps({"model": "fast", "stream": True,
                         "messages": [{"role": "user", "content": "hi"}]})
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    # the client reads nothing: what the proxy holds stops growing, far below the stream
    assert eventually(lambda: _client_write_buffer(proxy) > 0)
    sizes = []
    for _ in range(5):
        time.sleep(0.2)
        sizes.append(_client_write_buffer(proxy))
    assert max(sizes) < 4 * _MAX_BUFFERED, sizes
    assert sizes[-1] == sizes[-2], f"still growing: {sizes}"
    out = _Body()
    while not out.complete:
        data = sock.recv(1 << 16)
        assert data, "the proxy closed the stream"
        out.parser.feed_data(data)
    sock.close()
    assert out.status == 200
    assert bytes(out.body) == EVENT * NUM_EVENTS + b"data: [DONE]\n\n"
