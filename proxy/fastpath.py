"""A lean server protocol for the hot path: plain POSTs to the two OpenAI routes.

aiohttp's server side (request objects, header multidicts, URL objects,
response objects, the per-connection handler loop) cost about as much CPU
per streamed request as the whole relay (bench/proxy_overhead.py, py-spy).
This protocol serves the common case itself and hands everything else to
aiohttp, on the same port:

    a new request on a connection
      -> "POST /v1/chat/completions" or "POST /v1/completions", HTTP/1.1,
         a Content-Length body within limits.max_body_bytes, only well-formed
         header lines, none of Transfer-Encoding / Expect / Upgrade:
         served here by the relay (keep-alive, pipelining, chunked SSE out)
      -> anything else (other routes and methods, chunked request bodies,
         HTTP/1.0, odd or oversized heads, bodies over the limit):
         the connection and every byte not yet consumed go to aiohttp's own
         protocol for the rest of the connection's life (transport.set_protocol)

Only a request that starts exactly at a byte offset this protocol knows is
ever looked at, so the hand-over is byte-exact: aiohttp sees the same bytes
it would have read itself, and decides (404, 405, 413, 400 bad HTTP...).

A client that disconnects cancels its request's task: the relay closes the
upstream connection, which aborts the request on the worker. A request head that
has not arrived whole ``header_timeout_s`` after its first byte (a body
``body_timeout_s`` after its head) closes the connection, here or before a hand-over,
so that a client trickling bytes cannot hold it open.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import socket
import sys
import time
from collections.abc import Callable, Coroutine
from email.utils import formatdate
from typing import Any, cast

import orjson

from polyinfer.errors import error_body
from proxy.connections import ConnectionGate
from proxy.errors import ProxyError
from proxy.record import RequestRecord
from proxy.relay import Relay, proxy_headers
from proxy.validate import CHAT, COMPLETIONS

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8190  # aiohttp's own line / field limit; a longer head goes to aiohttp
_ROUTES = {b"/v1/chat/completions": (CHAT, "/v1/chat/completions"),
           b"/v1/completions": (COMPLETIONS, "/v1/completions")}
_PREFIX = b"POST /v1/"
# A whole line: field-name ":" OWS field-value CRLF, with an RFC 9110 token for the name and
# visible / obs-text characters (and spaces, tabs) in the value.
_HEADER = re.compile(rb"^([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[\t ]*([\t \x21-\x7e\x80-\xff]*)\r\n",
                     re.MULTILINE)
_OWS = b" \t"
_REPEAT_OWS = itertools.repeat(_OWS)  # endless: map stops at the values' end
_HANDED_OVER = frozenset((b"transfer-encoding", b"expect", b"upgrade"))
_STATUS_TEXT = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden",
                404: b"Not Found", 409: b"Conflict", 413: b"Payload Too Large",
                422: b"Unprocessable Entity", 429: b"Too Many Requests",
                500: b"Internal Server Error", 502: b"Bad Gateway",
                503: b"Service Unavailable", 504: b"Gateway Timeout"}
_EAGER = {"eager_start": True} if sys.version_info >= (3, 12) else {}
_SHED_BODY = orjson.dumps(error_body("proxy saturated: retry after the Retry-After seconds",
                                     "rate_limit_exceeded", None, "overloaded"))
_SHED_HEADERS = {"x-polyinfer-worker": "none", "x-polyinfer-domain": "none",
                 "x-polyinfer-spec-depth": "none"}


class RequestHead:
    """The parts of a hot-route request head the relay reads."""

    __slots__ = ("endpoint", "path", "headers", "content_length", "keep_alive")

    def __init__(self, endpoint: str, path: str, headers: dict[bytes, bytes],
                 content_length: int, keep_alive: bool) -> None:
        self.endpoint = endpoint
        self.path = path
        self.headers = headers  # lower-case names, values without surrounding spaces / tabs
        self.content_length = content_length
        self.keep_alive = keep_alive


def parse_head(head: bytes) -> RequestHead | None:
    """``head`` (up to, without, the blank line) if this protocol serves it, else None."""
    line_end = head.find(b"\r\n")
    request_line = head if line_end == -1 else head[:line_end]
    parts = request_line.split(b" ")
    if len(parts) != 3 or parts[0] != b"POST" or parts[2] != b"HTTP/1.1":
        return None
    route = _ROUTES.get(parts[1])
    if route is None:
        return None
    block = b"" if line_end == -1 else head[line_end + 2:] + b"\r\n"
    pairs = _HEADER.findall(block)
    # NOTE: each match is a whole line (from a line start to its CRLF, no LF inside), so one
    # match per LF means every line matched: no bare LF or CR, obs-fold, or bad name.
    if len(pairs) != block.count(b"\n"):
        return None
    # NOTE: names lowered and values stripped by map (C), not a comprehension: every request
    names, values = zip(*pairs, strict=True) if pairs else ((), ())
    headers = dict(zip(map(bytes.lower, names), map(bytes.rstrip, values, _REPEAT_OWS),
                       strict=True))
    if len(headers) != len(pairs) or not headers.keys().isdisjoint(_HANDED_OVER):
        return None  # repeated fields and body/protocol negotiation: aiohttp's rules
    length = headers.get(b"content-length", b"")
    if not length.isdigit() or len(length) > 15:
        return None
    connection = headers.get(b"connection", b"keep-alive").lower()
    if connection not in (b"keep-alive", b"close"):
        return None
    return RequestHead(route[0], route[1], headers, int(length), connection != b"close")


_FIELD_LINE = "%s: %s\r\n"


def response_head(status: int, headers: dict[str, str], content_length: int | None,
                  date: bytes) -> bytes:
    """An HTTP/1.1 response head; ``content_length`` None = a chunked body."""
    fields = "".join(map(_FIELD_LINE.__mod__, headers.items()))  # NOTE: no comprehension
    if fields.count("\n") != len(headers) or fields.count("\r") != len(headers):
        raise ValueError(f"a newline in a response header: {headers!r}")
    length = (b"Transfer-Encoding: chunked\r\n\r\n" if content_length is None
              else b"Content-Length: %d\r\n\r\n" % content_length)
    return b"HTTP/1.1 %d %s\r\n%sDate: %s\r\nServer: polyinfer\r\n%s" % (
        status, _STATUS_TEXT.get(status, b"Unknown"), fields.encode("utf-8"), date, length)


_DOOR_LINES = (b"POST /v1/chat/completions HTTP/1.1\r\n", b"POST /v1/completions HTTP/1.1\r\n")
_LENGTH_FIELD = b"\r\ncontent-length:"


def door_framing(head: bytes, max_body_bytes: int) -> tuple[int, bool] | None:
    """(body length, keep-alive) of a hot-route head to refuse at the door, found without
    parsing its fields; None when only :func:`parse_head` can say (then it does).

    NOTE: a refusal must cost a small fraction of a request (see ``_shed``); the full
    parse is most of a door 429's Python time. The framing is the same as the full
    parse's for every head this accepts: one Content-Length, no Transfer-Encoding."""
    if not head.startswith(_DOOR_LINES):
        return None
    low = head.lower()
    at = low.find(_LENGTH_FIELD)
    if at == -1 or low.find(_LENGTH_FIELD, at + 1) != -1 or b"transfer-encoding" in low:
        return None
    start = at + len(_LENGTH_FIELD)
    end = low.find(b"\r\n", start)
    value = low[start:] if end == -1 else low[start:end]
    value = value.strip(_OWS)
    if not value.isdigit() or len(value) > 15 or int(value) > max_body_bytes:
        return None
    return int(value), b"\r\nconnection: close" not in low


class _DateHeader:
    """The ``Date`` header value, formatted at most once per second."""

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def value(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = formatdate(now, usegmt=True).encode()
        return self._value


class FastExchange:
    """A :class:`proxy.exchange.ClientExchange` on a :class:`FastConnection`."""

    __slots__ = ("_conn", "_head", "_body", "rec", "_pending", "started", "finished")

    def __init__(self, conn: FastConnection, head: RequestHead, body: bytes) -> None:
        self._conn = conn
        self._head = head
        self._body = body
        self.rec: RequestRecord | None = None
        self._pending = b""  # the stream's response head, sent with its first bytes
        self.started = False  # response bytes were (or are about to be) sent
        self.finished = False  # the whole response was handed to the transport

    @property
    def path(self) -> str:
        return self._head.path

    @property
    def content_length(self) -> int | None:
        return self._head.content_length

    def header(self, name: str) -> str | None:
        value = self._head.headers.get(name.encode("latin-1"))
        return None if value is None else value.decode("utf-8", "surrogateescape")

    def bind(self, rec: RequestRecord) -> None:
        self.rec = rec

    async def read_body(self, max_bytes: int, timeout_s: float) -> bytes:
        # read whole before the request started (length checked then, timed by close_if_idle)
        return self._body

    def send(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.started = self.finished = True
        self._conn.write(self._conn.response_head(status, headers, len(body)) + body)

    async def start_stream(self, headers: dict[str, str]) -> None:
        self.started = True
        self._pending = self._conn.response_head(200, headers, None)

    # NOTE: the pending head and the chunk framed in one bytes formatting, and the drain
    # awaited only while the transport is paused: these run for every write of every stream.

    async def write(self, data: bytes) -> None:
        if not data:
            return  # an empty chunk would end the chunked body
        conn = self._conn
        head, self._pending = self._pending, b""
        conn.write(b"%s%x\r\n%s\r\n" % (head, len(data), data))
        if conn.write_paused:
            await conn.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        if self.finished:
            return
        self.finished = True
        conn = self._conn
        head, self._pending = self._pending, b""
        conn.write(b"%s%x\r\n%s\r\n0\r\n\r\n" % (head, len(data), data) if data
                   else head + b"0\r\n\r\n")
        if conn.write_paused:
            await conn.drain()


class FastConnection(asyncio.Protocol):
    """One client connection: reads request heads, runs one request at a time."""

    def __init__(self, server: FastServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0  # loop time of the last request end; for the sweep
        self.reading_since = 0.0  # loop time of the first byte of the request being read
        self._buf = bytearray()
        self._head: RequestHead | None = None  # parsed head of a request still receiving its body
        self._need = 0  # bytes of buffer the request above spans
        self._task: asyncio.Task[None] | None = None
        self._starting = False  # its task created, not yet run (FastServer.num_starting)
        self._reading_paused = False
        self.write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # NOTE: uvloop's transports are not asyncio.Transport subclasses; same interface.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.idle_since = self.server.loop.time()
        self.server.connections.add(self)
        self.server.gate.opened()

    def data_received(self, data: bytes) -> None:
        door_open = False  # checked just now: the door cannot close before _next_request
        if not self._buf and self._head is None:
            if self._task is None:
                if not self.server.door_closed(self.server.relay):
                    door_open = True
                elif self._refuse_whole(data):
                    return
            self.reading_since = self.server.loop.time()
        self._buf += data
        if self._task is not None:
            # pipelined: kept until the current response ends; bounded like a body
            if len(self._buf) > self.server.max_body_bytes + MAX_HEAD_BYTES:
                self._pause_reading()
            return
        self._next_request(door_open)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:  # not handed over
            self.server.gate.closed()
        self.server.connections.discard(self)
        self._started()  # a task cancelled before its first step never runs _serve
        if self._task is not None:
            self._task.cancel()  # the relay closes the upstream request
        self._wake_drain(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drain(None)

    # -- writing ------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        transport.write(data)

    async def drain(self) -> None:
        if not self.write_paused:
            return
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self._drain_waiter = self.server.loop.create_future()
        try:
            await self._drain_waiter
        finally:
            self._drain_waiter = None

    def _wake_drain(self, exc: Exception | None) -> None:
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)

    def response_head(self, status: int, headers: dict[str, str],
                      content_length: int | None) -> bytes:
        return response_head(status, headers, content_length, self.server.date.value())

    # -- requests -----------------------------------------------------------------------

    def _next_request(self, door_open: bool = False) -> None:
        """Start the request at the front of the buffer, wait for more bytes, or hand over.

        ``door_open``: the caller found the door open (:meth:`FastServer.door_closed`) in this
        same callback, so it is not asked again (a request that arrives whole: most)."""
        buf = self._buf
        head = self._head
        if self._task is not None or self.transport is None:
            return
        if head is None:
            if not buf:
                return
            if not _PREFIX.startswith(buf[:len(_PREFIX)]):
                # NOTE: handed over once its head is whole, so the header timeout holds
                # for every route (aiohttp's parser has none)
                if len(buf) > MAX_HEAD_BYTES or b"\n\n" in buf or b"\n\r\n" in buf:
                    self._hand_over()
                return
            end = buf.find(b"\r\n\r\n")
            if end == -1:
                # NOTE: bare-LF line ends are for aiohttp's parser (which refuses them),
                # never seen here; handed over once that head is whole too
                if len(buf) > MAX_HEAD_BYTES or b"\n\n" in buf or b"\n\r\n" in buf:
                    self._hand_over()
                return
            if not door_open and self.server.door_closed(self.server.relay):
                framing = door_framing(bytes(buf[:end]), self.server.max_body_bytes)
                if framing is not None and len(buf) >= end + 4 + framing[0]:
                    del buf[:end + 4 + framing[0]]
                    self._shed(framing[1])
                    return
            head = parse_head(bytes(buf[:end]))
            if head is None or head.content_length > self.server.max_body_bytes:
                self._hand_over()
                return
            self._head, self._need = head, end + 4 + head.content_length
            self.reading_since = self.server.loop.time()  # the body's clock
        if len(buf) < self._need:
            return  # the body is still arriving
        body = bytes(buf[self._need - head.content_length:self._need])
        del buf[:self._need]
        self._head = None
        server = self.server
        if not door_open and server.door_closed(server.relay):
            self._shed(head.keep_alive)
            return
        self._starting = True  # counted at the door until relay.handle counts it
        server.num_starting += 1
        task = _start_task(server.loop, self._serve(FastExchange(self, head, body), head))
        if not task.done():  # an eager task may have finished (an error answered at once)
            self._task = task

    async def _serve(self, ex: FastExchange, head: RequestHead) -> None:
        self._started()
        try:
            await self.server.relay.handle(ex, head.endpoint)
        except ProxyError as e:
            self._send_error(ex, e.status, e.body(), e.headers())
        except asyncio.CancelledError:
            return  # the client went away (connection_lost)
        except Exception:
            logger.exception("unhandled error on POST %s", head.path)
            self._send_error(ex, 500, error_body("internal proxy error", "internal_error"), {})
        finally:
            self._task = None
        self._request_done(ex, head.keep_alive)

    def _started(self) -> None:
        """The request's task runs (or never will): relay.handle counts it from here."""
        if self._starting:
            self._starting = False
            self.server.num_starting -= 1

    def _refuse_whole(self, data: bytes) -> bool:
        """Refuse ``data`` at the door if it is one whole hot-route request (how a client
        that waits for each answer sends), never buffered; False: the general path decides.

        NOTE: past capacity every request that arrives costs the loop its read, its answer
        and this, and the refusals' share of the core is what serving loses (``_shed``):
        here it is the framing and one write, ~1-2 us of Python over the system calls."""
        end = data.find(b"\r\n\r\n")
        if end == -1:
            return False
        framing = door_framing(data[:end], self.server.max_body_bytes)
        if framing is None or len(data) != end + 4 + framing[0]:
            return False
        self._shed(framing[1])
        return True

    def _shed(self, keep_alive: bool) -> None:
        """Answer 429 + Retry-After at once, before the body is parsed or a record made.

        NOTE: past capacity, what a refusal costs decides the goodput: the proxy's core
        serves S requests and refuses the rest, S x cost + refused x cost_refused <= 1 s,
        so a refusal must cost a small fraction of a request (no JSON, no task, no trace;
        counted in /stats as shed_at_door)."""
        server = self.server
        relay = server.relay
        relay.num_shed_at_door += 1
        relay.stats.refused_at_door(429)  # /metrics, the dashboard
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(server.shed_response())
        if not keep_alive or server.closing:
            transport.close()
        elif self._buf:
            server.loop.call_soon(self._next_request)

    def _send_error(self, ex: FastExchange, status: int, body: dict[str, object],
                    headers: dict[str, str]) -> None:
        if ex.started:
            return  # part of a response went out: the connection is closed after it
        headers = {"Content-Type": "application/json", **headers}
        if ex.rec is not None:
            headers.update(proxy_headers(ex.rec))
        try:
            ex.send(status, headers, orjson.dumps(body))
        except ConnectionError:
            pass

    def _request_done(self, ex: FastExchange, keep_alive: bool) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not keep_alive or not ex.finished or self.server.closing:
            transport.close()
            return
        self.idle_since = self.server.loop.time()
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        if self._buf:
            self.reading_since = self.idle_since
            # NOTE: not called directly: pipelined requests answered eagerly would recurse.
            self.server.loop.call_soon(self._next_request)

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _hand_over(self) -> None:
        """Give the connection and its unread bytes to aiohttp's protocol, for good."""
        transport = self.transport
        assert transport is not None and self._task is None
        self.server.connections.discard(self)
        self.server.gate.closed()  # the handler counts it from here
        self.transport = None
        data, self._buf = bytes(self._buf), bytearray()
        if self._reading_paused:
            transport.resume_reading()
        handler = self.server.aiohttp_factory()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if data:
            handler.data_received(data)

    def close_if_idle(self, now: float) -> None:
        """Close the connection if it is kept alive past the keep-alive timeout with no
        request, or a request's head (body) is still arriving past its timeout."""
        if self._task is not None or self.transport is None:
            return
        server = self.server
        if self._head is not None:
            late = now - self.reading_since > server.body_timeout_s
        elif self._buf:
            late = now - self.reading_since > server.header_timeout_s
        else:
            late = now - self.idle_since > server.keepalive_timeout_s
        if late:
            self.transport.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _start_task(loop: asyncio.AbstractEventLoop,
                coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    # NOTE: eager start (3.12+) runs the request up to its first wait inside data_received,
    # a loop iteration earlier; aiohttp's server does the same for its handler tasks. The
    # loop is passed: looking it up costs a getpid() system call.
    return asyncio.Task(coro, loop=loop, **_EAGER)  # type: ignore[arg-type]


class FastServer:
    """Makes a :class:`FastConnection` per accepted socket; owns their shared state."""

    def __init__(self, relay: Relay, aiohttp_factory: Callable[[], asyncio.Protocol],
                 max_body_bytes: int, keepalive_timeout_s: float = 75.0,
                 header_timeout_s: float = 10.0, body_timeout_s: float = 60.0,
                 gate: ConnectionGate | None = None) -> None:
        self.relay = relay
        self.aiohttp_factory = aiohttp_factory  # a protocol that counts itself in the gate
        self.gate = gate or ConnectionGate(1 << 30, relay.limits.retry_after_s)
        self.max_body_bytes = max_body_bytes
        self.keepalive_timeout_s = keepalive_timeout_s
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.loop = asyncio.get_running_loop()
        self.connections: set[FastConnection] = set()
        self.date = _DateHeader()
        self._shed_answer = (b"", b"")  # (its Date, the response) for shed_response()
        self.closing = False
        self.num_starting = 0  # requests past the door whose task has not yet run
        # NOTE: one sweep for every idle keep-alive connection instead of a timer per request.
        self._sweeper = self.loop.create_task(self._sweep(), name="fastpath-keepalive")

    def __call__(self) -> FastConnection:
        return FastConnection(self)

    def door_closed(self, relay: Relay) -> bool:
        """Refuse a new request at the door: the loop is shedding, or what is in flight
        (counted from here, the door) has reached the in-flight limit.

        NOTE: without eager tasks (before 3.12) a request's task first runs in the next
        loop iteration, so the relay's count missed every request started in this one: a
        step of 1,024 on open connections all passed the door (768 then refused by the
        relay with a record each, not here)."""
        return relay.shedding or \
            relay.stats.in_flight + self.num_starting >= relay.in_flight_limit.value

    def shed_response(self) -> bytes:
        """A door 429, whole (remade once a second, for its Date).

        NOTE: no ``x-request-id``: the id names a request's record, and a request refused
        at the door has none (it is counted only)."""
        date = self.date.value()
        if self._shed_answer[0] != date:
            headers = {"Content-Type": "application/json",
                       "Retry-After": str(self.relay.limits.retry_after_s), **_SHED_HEADERS}
            self._shed_answer = date, response_head(429, headers, len(_SHED_BODY), date) + _SHED_BODY
        return self._shed_answer[1]

    async def _sweep(self) -> None:
        period_s = max(0.5, min(10.0, self.keepalive_timeout_s / 4,
                                self.header_timeout_s / 4))
        while True:
            await asyncio.sleep(period_s)
            now = self.loop.time()
            for conn in list(self.connections):
                conn.close_if_idle(now)

    def close(self) -> None:
        """Stop the sweep and close every connection (requests still running are cancelled)."""
        self.closing = True
        self._sweeper.cancel()
        for conn in list(self.connections):
            conn.close()
