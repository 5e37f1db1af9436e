"""A lean HTTP/1.1 client for the request path: keep-alive pools per worker, llhttp parsing.

The proxy's per-request cost is dominated by its HTTP stacks; aiohttp's client
alone spends about a quarter of a millisecond of CPU per streamed request
here (bench/proxy_overhead.py). This client does only what the relay needs:
POST a JSON body, read the status, the content type and the body as it
arrives (chunked or not), reuse the connection when the response completed.
Health probes and scrapes keep using aiohttp.

    client = UpstreamClient(connect_timeout_s=5, read_timeout_s=600)
    resp = await client.post("http://127.0.0.1:9001", "/v1/completions", body, request_id)
    while chunk := await resp.read_chunk():
        ...
    resp.release()          # pooled if complete, closed otherwise (aborts the worker's request)

Errors are :class:`UpstreamConnectionError` (a ``ConnectionError``) and ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from typing import cast
from urllib.parse import urlsplit

import httptools

_MAX_BUFFERED = 1 << 18  # pause reading from the worker past this many unread bytes


class UpstreamConnectionError(ConnectionError):
    """The connection to the worker failed, closed early, or sent malformed HTTP."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one response at a time."""

    def __init__(self, pool: _HostPool) -> None:
        self.pool = pool
        # NOTE: kept, not looked up per wait: asyncio.get_running_loop() makes a getpid()
        # system call each time (its fork check), ~2 per request here (strace).
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self._timer: asyncio.TimerHandle | None = None  # the read-timeout watchdog, if armed
        self._timeout_s = 0.0
        self._last_progress = 0.0  # loop time of the last data or of the current wait's start
        # NOTE: one parser for the connection's life: llhttp starts the next message after
        # a complete one (only a complete, keep-alive, error-free response is pooled).
        self.parser = httptools.HttpResponseParser(self)
        self.chunks: deque[bytes] = deque()
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.content_type = b""
        self._header_name = b""
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None
        self.chunks.clear()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # NOTE: uvloop's transports are not asyncio.Transport subclasses; same interface.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.waiter is not None:
            self._last_progress = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamConnectionError(f"malformed HTTP from worker: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        if not self.complete:
            self._fail(UpstreamConnectionError(
                f"worker closed the connection{f': {exc}' if exc else ''}"))

    # -- httptools callbacks ------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.content_type = value

    # NOTE: the waiter woken inline (what _wake does), not through a call: these run for
    # every response (on_body for every HTTP chunk)

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(bytes(body))
        self.buffered += len(body)
        if self.buffered > _MAX_BUFFERED and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # only valid inside this callback
        self.complete = True
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- used by UpstreamResponse -------------------------------------------------------

    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, timeout_s: float) -> None:
        """Until the next response event; TimeoutError after ``timeout_s`` without data."""
        loop = self.loop
        self.waiter = loop.create_future()
        self._timeout_s = timeout_s
        self._last_progress = loop.time()
        # NOTE: one long-lived watchdog per connection instead of a timer per wait
        # (two per request): it re-arms itself only when it fires, about once per
        # read timeout, and checks the time of the last progress.
        if self._timer is None:
            self._timer = loop.call_at(self._last_progress + timeout_s, self._watchdog)
        try:
            await self.waiter
        finally:
            self.waiter = None

    def _watchdog(self) -> None:
        self._timer = None
        if self.waiter is None or self.waiter.done():
            return  # idle (or about to resume): the next wait arms it again
        deadline = self._last_progress + self._timeout_s
        loop = self.loop
        if loop.time() >= deadline:
            self._fail(TimeoutError(f"no data from the worker for {self._timeout_s:g} s"))
        else:
            self._timer = loop.call_at(deadline, self._watchdog)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        self.closed = True
        self._disarm()
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """The worker's answer: ``status``, ``content_type``, then the body chunk by chunk."""

    __slots__ = ("_conn", "_read_timeout_s", "status", "content_type", "_released")

    def __init__(self, conn: _Connection, read_timeout_s: float) -> None:
        self._conn = conn
        self._read_timeout_s = read_timeout_s
        self.status = conn.status
        self.content_type = conn.content_type.decode("latin-1")
        self._released = False

    async def read_chunk(self) -> bytes:
        """The next body bytes as they arrived; b"" at the end of the response."""
        conn = self._conn
        while True:
            if conn.chunks:
                chunk = conn.chunks.popleft()
                conn.buffered -= len(chunk)
                if conn.paused and conn.buffered < _MAX_BUFFERED // 2 and conn.transport:
                    conn.paused = False
                    conn.transport.resume_reading()
                return chunk
            if conn.complete:
                return b""
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._read_timeout_s)

    async def read_available(self) -> bytes:
        """Every body byte that has arrived and is unread, as one block (waiting for the
        first if none has); b"" at the end of the response.

        NOTE: never waits for more than the first bytes, so a stream is relayed as it
        arrives; what one socket read brought (several HTTP chunks, several SSE events)
        goes on in one client write instead of one write per upstream chunk.
        """
        conn = self._conn
        chunks = conn.chunks
        if len(chunks) < 2:
            if not chunks:
                return await self.read_chunk()
            data = chunks.popleft()  # read_chunk's work, without its coroutine
        else:
            data = b"".join(chunks)
            chunks.clear()
        conn.buffered = 0
        if conn.paused and conn.transport:
            conn.paused = False
            conn.transport.resume_reading()
        return data

    async def read_all(self) -> bytes:
        parts = []
        while chunk := await self.read_chunk():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Return the connection to its pool if the response is complete, else close it."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        if conn.complete and conn.keep_alive and not conn.closed and conn.error is None:
            conn.pool.put(conn)
        else:
            conn.close()


class _HostPool:
    def __init__(self, host: str, port: int, use_ssl: bool, connect_timeout_s: float) -> None:
        self.host = host
        self.port = port
        self.ssl = ssl.create_default_context() if use_ssl else None
        self.connect_timeout_s = connect_timeout_s
        self.idle: list[_Connection] = []  # LIFO: the warmest connection first
        self.host_header = f"{host}:{port}".encode()
        self.path_prefix = b""  # a worker URL's own path, e.g. http://gw/tenant-a

    def take_idle(self) -> _Connection | None:
        """The warmest idle connection still open, or None (then :meth:`get` connects)."""
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                conn.reused = True
                return conn
        return None

    async def get(self) -> _Connection:
        idle = self.take_idle()
        if idle is not None:
            return idle
        return await self.connect()

    async def connect(self) -> _Connection:
        """A new connection to the worker."""
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                lambda: _Connection(self), self.host, self.port, ssl=self.ssl),
                self.connect_timeout_s)
        except OSError as e:
            raise UpstreamConnectionError(f"cannot connect to {self.host}:{self.port}: {e}") \
                from e
        return conn

    def put(self, conn: _Connection) -> None:
        conn._reset()
        self.idle.append(conn)

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


class UpstreamClient:
    """Keep-alive connection pools, one per worker address, with no cap on their size."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._pools: dict[str, _HostPool] = {}

    def _pool(self, base_url: str) -> _HostPool:
        pool = self._pools.get(base_url)
        if pool is None:
            u = urlsplit(base_url)
            use_ssl = u.scheme == "https"
            pool = _HostPool(u.hostname or "127.0.0.1", u.port or (443 if use_ssl else 80),
                             use_ssl, self.connect_timeout_s)
            pool.path_prefix = u.path.rstrip("/").encode()
            self._pools[base_url] = pool
        return pool

    async def post(self, base_url: str, path: str, body: bytes,
                   request_id: str) -> UpstreamResponse:
        """Send a JSON POST and wait for the response headers."""
        pool = self._pools.get(base_url) or self._pool(base_url)
        # NOTE: the request head formatted once, for a retry too
        data = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n" \
               b"Content-Length: %d\r\nx-request-id: %s\r\n\r\n%s" % (
                   pool.path_prefix + path.encode(), pool.host_header, len(body),
                   request_id.encode(), body)
        # NOTE: an idle connection taken without a coroutine (most requests)
        conn = pool.take_idle() or await pool.get()
        try:
            return await self._exchange(conn, data)
        except UpstreamConnectionError:
            conn.close()
            # NOTE: a reused keep-alive connection the worker had already closed: the
            # request never reached it, so one more try is safe, on a new connection (the
            # other idle ones may be as stale: a worker restarted behind its address)
            if not conn.reused or conn.headers_done:
                raise
        except BaseException:
            conn.close()
            raise
        conn = await pool.connect()
        try:
            return await self._exchange(conn, data)
        except BaseException:
            conn.close()
            raise

    async def _exchange(self, conn: _Connection, data: bytes) -> UpstreamResponse:
        assert conn.transport is not None
        conn.transport.write(data)
        while not conn.headers_done:
            if conn.error is not None:
                raise conn.error
            await conn.wait(self.read_timeout_s)
        return UpstreamResponse(conn, self.read_timeout_s)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
