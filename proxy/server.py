"""Running a proxy app: listen, drain on SIGTERM, shut down cleanly.

:class:`ProxyServer` is what ``polyinfer serve`` runs and what tests start in
a thread. Shutdown order: stop admitting (new requests get 503 +
Retry-After), wait for in-flight requests up to ``limits.drain_timeout_s``,
then clean the app up (pool stopped, session closed, traces flushed).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import cast

from aiohttp import web

from polyinfer.heap import settle_heap
from polyinfer.http_log import server_logger
from proxy import keys
from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.connections import aiohttp_protocol, door
from proxy.fastpath import FastServer

logger = logging.getLogger(__name__)
# NOTE: aiohttp's default (3,630 s) would let an idle or trickling client hold a
# connection it was handed for an hour
KEEPALIVE_TIMEOUT_S = 75.0
# NOTE: after an answer given before the body was read whole (a 408 at limits.body_timeout_s,
# a 413), aiohttp reads and drops what the client still sends for this long before closing,
# so the client sees the answer; its default of 10 s let a trickling client hold on
LINGERING_S = 2.0


class ProxyServer:
    def __init__(self, config: ProxyConfig, app: web.Application | None = None) -> None:
        self.config = config
        self.app = app if app is not None else create_app(config)
        self._runner: web.AppRunner | None = None
        self.port = config.server.port

    @property
    def url(self) -> str:
        return f"http://{self.config.server.host}:{self.port}"

    async def start(self) -> None:
        # NOTE: handler_cancellation: a client that disconnects cancels its
        # handler, which closes the upstream connection and aborts the request
        # on the worker instead of letting it run to completion for nobody.
        # The port first: the runner's set-up starts the supervised workers (seconds to
        # minutes), and a taken port would only be found after them.
        check_port_free(self.config.server.host, self.config.server.port)
        # logger: a client's malformed request is logged without its bytes (polyinfer.http_log)
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=self.config.limits.drain_timeout_s,
                                     keepalive_timeout=KEEPALIVE_TIMEOUT_S,
                                     lingering_time=LINGERING_S, logger=server_logger())
        await self._runner.setup()
        site = ProxySite(self._runner, self.config.server.host, self.config.server.port,
                         backlog=self.config.server.backlog, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await self._runner.cleanup()  # stop the workers it started, close sessions
            self._runner = None
            raise
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            self.port = server.sockets[0].getsockname()[1]
        logger.info("polyinfer listening on %s", self.url)

    async def drain(self) -> None:
        relay = self.app[keys.RELAY]
        relay.draining = True
        deadline = time.monotonic() + self.config.limits.drain_timeout_s
        while self.app[keys.STATS].in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.app[keys.STATS].in_flight:
            # NOTE: cut here, while the connections are open: closed first, a stream would
            # end with no word of why and its trace say "client_disconnected"
            num_cut = relay.cut_all()
            logger.warning("drain timed out: %d requests cut", num_cut)
            deadline = time.monotonic() + 2.0
            while self.app[keys.STATS].in_flight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        await self.drain()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`OSError` naming ``host:port`` when nothing could listen there now."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {host}:{port}: {e}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the site binds
        try:
            s.bind(address)
        except OSError as e:
            raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror} (another "
                                   "server there? pick a free port with --port)") from None


class ProxySite(web.TCPSite):
    """The proxy's TCP site: connections past ``limits.max_connections`` refused at accept
    time, the rest on the lean hot-path protocol (proxy/fastpath.py) when
    ``server.fast_path`` is on, else on aiohttp's own (proxy/connections.py).

    Requests the lean protocol does not serve go, with their connection, to the
    runner's aiohttp server, so every route and rule of the app still applies.
    """

    _fast: FastServer | None = None

    async def start(self) -> None:
        self._runner._reg_site(self)
        aiohttp_server = self._runner.server
        assert aiohttp_server is not None
        app = cast(web.AppRunner, self._runner).app
        config = app[keys.CONFIG]
        limits, gate = config.limits, app[keys.GATE]
        serve: Callable[[], asyncio.Protocol] = aiohttp_protocol(
            aiohttp_server, gate, limits.header_timeout_s)
        if config.server.fast_path:
            self._fast = FastServer(app[keys.RELAY], serve, limits.max_body_bytes,
                                    KEEPALIVE_TIMEOUT_S, limits.header_timeout_s,
                                    limits.body_timeout_s, gate)
            serve = self._fast
        self._server = await asyncio.get_running_loop().create_server(
            door(gate, serve), self._host, self._port, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port

    async def stop(self) -> None:
        # NOTE: after ProxyServer.drain: idle keep-alive connections are closed here,
        # the ones handed to aiohttp by the runner's shutdown.
        if self._fast is not None:
            self._fast.close()
        await super().stop()


async def serve_until_signal(config: ProxyConfig) -> None:
    server = ProxyServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    settle_heap()  # start-up objects frozen, larger young generation (polyinfer.heap)
    try:
        await stop.wait()
        logger.info("signal received: draining %d in-flight requests",
                    server.app[keys.STATS].in_flight)
    finally:
        await server.stop()


def run(main: Callable[[], Awaitable[None]]) -> None:
    """Run ``main`` on uvloop when available (asyncio otherwise)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())  # type: ignore[arg-type]
        return
    if sys.version_info >= (3, 12):
        asyncio.run(main(), loop_factory=uvloop.new_event_loop)  # type: ignore[arg-type]
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main())  # type: ignore[arg-type]
