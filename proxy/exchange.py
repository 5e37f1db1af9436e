"""One client request and its response, whichever HTTP server carries them.

The relay reads the request and writes the response through a
:class:`ClientExchange`, so the same request path runs on aiohttp (every
route) and on the lean server protocol of :mod:`proxy.fastpath` (plain
POSTs to the two OpenAI routes). A response is either one body
(:meth:`ClientExchange.send`) or a stream
(``start_stream -> write ... -> write_eof``).

    ex = AiohttpExchange(request)
    await relay.handle(ex, CHAT)    # raises ProxyError before anything was sent
    return ex.response
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from aiohttp import web

from proxy.errors import BodyTimeout, BodyTooLarge
from proxy.record import RequestRecord

# NOTE: web.RequestKey exists from aiohttp 3.13; older versions take a plain string key.
REC_KEY: Any = web.RequestKey("rec", RequestRecord) if hasattr(web, "RequestKey") else "rec"


class ClientExchange(Protocol):
    """The client side of one request, as the relay needs it.

    ``write``/``write_eof`` raise ``ConnectionError`` when the client has gone.
    """

    @property
    def path(self) -> str: ...

    @property
    def content_length(self) -> int | None: ...

    def header(self, name: str) -> str | None:
        """A request header's value (``name`` in lower case), or None."""

    def bind(self, rec: RequestRecord) -> None:
        """The request's record: its facts go into the headers of any response."""

    async def read_body(self, max_bytes: int, timeout_s: float) -> bytes:
        """The whole request body; :class:`BodyTooLarge` past ``max_bytes``,
        :class:`BodyTimeout` (and the connection closed once answered) when it has not
        arrived ``timeout_s`` after the head."""

    def send(self, status: int, headers: dict[str, str], body: bytes) -> None:
        """The whole response at once."""

    async def start_stream(self, headers: dict[str, str]) -> None:
        """A 200 response whose body follows in ``write`` calls (chunked)."""

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self, data: bytes = b"") -> None:
        """The last bytes of the stream; a no-op once the stream has ended."""


class AiohttpExchange:
    """A :class:`ClientExchange` over an aiohttp request; the handler returns ``response``."""

    __slots__ = ("request", "_response", "_close")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self._response: web.StreamResponse | None = None
        self._close = False  # the body never came whole: the connection ends with the answer

    @property
    def response(self) -> web.StreamResponse:
        assert self._response is not None, "the relay returned without a response"
        return self._response

    @property
    def path(self) -> str:
        return self.request.path

    @property
    def content_length(self) -> int | None:
        return self.request.content_length

    def header(self, name: str) -> str | None:
        return self.request.headers.get(name)

    def bind(self, rec: RequestRecord) -> None:
        self.request[REC_KEY] = rec

    async def read_body(self, max_bytes: int, timeout_s: float) -> bytes:
        # NOTE: aiohttp's server has no body timeout of its own (the fast path's connection
        # times its bodies itself): a client that trickles a body would hold its handler
        try:
            async with asyncio.timeout(timeout_s):
                return await self.request.read()
        except web.HTTPRequestEntityTooLarge as e:
            raise BodyTooLarge(f"request body over {max_bytes} bytes") from e
        except TimeoutError as e:
            self._close = True
            raise BodyTimeout(f"the request body did not arrive whole in {timeout_s:g} s "
                              "(limits.body_timeout_s)") from e

    def send(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self._response = web.Response(status=status, body=body, headers=headers)
        if self._close:
            self._response.force_close()

    async def start_stream(self, headers: dict[str, str]) -> None:
        self._response = web.StreamResponse(status=200, headers=headers)
        await self._response.prepare(self.request)

    async def write(self, data: bytes) -> None:
        await self.response.write(data)

    async def write_eof(self, data: bytes = b"") -> None:
        await self.response.write_eof(data)
