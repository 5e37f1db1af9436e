"""Client connections at the door: how many may be open, and how long a request head may take.

Every accepted socket gets its protocol from :func:`door`'s factory:

    num_open < limits.max_connections
      -> the serving protocol (proxy/fastpath.py's, or aiohttp's as :class:`HeaderTimedHandler`)
    else
      -> :class:`RefusedConnection`: 503 + Retry-After to its first bytes, then closed

A refusal is decided at accept time and costs no parsing, no task and no record, so a
flood of connections is answered at about the rate it arrives instead of waiting, unseen,
in the listen backlog (``server.backlog``) and in the clients' connect retries.

:class:`HeaderTimedHandler` is aiohttp's own server protocol with the header-read
timeout the fast path has (``limits.header_timeout_s``): a request head that has not
arrived whole that long after its first byte closes the connection. It serves every
connection when ``server.fast_path`` is off, and those the fast path hands over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from polyinfer.errors import error_body

LINGER_S = 2.0  # a refused connection is closed at the latest this long after it opened


class ConnectionGate:
    """The count of open client connections against ``limits.max_connections``."""

    def __init__(self, max_connections: int, retry_after_s: int) -> None:
        self.max_connections = max_connections
        self.num_open = 0
        self.num_refused = 0  # connections answered 503 at accept time
        body = orjson.dumps(error_body(
            f"too many connections (limits.max_connections = {max_connections}): retry "
            "after the Retry-After seconds", "service_unavailable", None, "overloaded"))
        self.refusal = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                        b"Retry-After: %d\r\nConnection: close\r\nServer: polyinfer\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (retry_after_s, len(body), body))

    def full(self) -> bool:
        return self.num_open >= self.max_connections

    def opened(self) -> None:
        self.num_open += 1

    def closed(self) -> None:
        self.num_open -= 1


class RefusedConnection(asyncio.Protocol):
    """A connection over the limit: its first bytes are answered 503, then it is closed.

    NOTE: answered only once the client has sent something, and closed only after our FIN
    and its (or LINGER_S): closed with its request unread, the kernel would reset the
    connection and the client could lose the 503 with it."""

    def __init__(self, gate: ConnectionGate) -> None:
        self.gate = gate
        self.transport: asyncio.Transport | None = None
        self._answered = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.gate.num_refused += 1
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if self._answered or self.transport is None:
            return
        self._answered = True
        self.transport.write(self.gate.refusal)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        else:
            self.transport.close()

    def eof_received(self) -> bool:
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.transport = None


class HeaderTimedHandler(RequestHandler):
    """aiohttp's server protocol, counted by the gate, with a header-read timeout."""

    def __init__(self, manager: web.Server, gate: ConnectionGate, header_timeout_s: float,
                 **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._gate = gate
        self._header_timeout_s = header_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._gate.opened()
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._gate.closed()
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        waiting = self._waiting_for_head()
        num_before = self._request_count
        super().data_received(data)
        if self._request_count != num_before:
            self._stop_head_timer()  # a head arrived whole (or a bad one, answered 400)
        elif data and waiting and self._head_timer is None:
            self._head_timer = self._loop.call_later(self._header_timeout_s, self._head_late)

    def _waiting_for_head(self) -> bool:
        """Between requests: no request running or queued, no body or upgrade being read.

        NOTE: aiohttp's private state, read defensively (3.9 and later)."""
        return (not getattr(self, "_request_in_progress", False)
                and getattr(self, "_current_request", None) is None
                and not self._messages and self._payload_parser is None
                and not getattr(self, "_upgraded", False))

    def _head_late(self) -> None:
        self._head_timer = None
        if self._waiting_for_head():
            self.force_close()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


def aiohttp_protocol(server: web.Server, gate: ConnectionGate,
                     header_timeout_s: float) -> Callable[[], HeaderTimedHandler]:
    """A factory of :class:`HeaderTimedHandler` made as ``server`` makes its own handlers.

    NOTE: ``server._kwargs`` are the handler arguments given to the runner (keep-alive
    timeout, logger, access log); aiohttp's ``Server.__call__`` passes them the same way."""
    kwargs = dict(getattr(server, "_kwargs", {}))
    loop = asyncio.get_running_loop()

    def make() -> HeaderTimedHandler:
        return HeaderTimedHandler(server, gate, header_timeout_s, loop=loop, **kwargs)
    return make


def door(gate: ConnectionGate,
         serve: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
    """The listening socket's protocol factory: ``serve``'s protocol, or a refusal."""
    def new() -> asyncio.Protocol:
        return RefusedConnection(gate) if gate.full() else serve()
    return new
