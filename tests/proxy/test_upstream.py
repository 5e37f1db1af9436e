"""The lean upstream client against a real aiohttp server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.upstream import UpstreamClient, UpstreamConnectionError


async def _json(request: web.Request) -> web.Response:
    return web.Response(body=b'{"echo":' + await request.read() + b"}",
                        content_type="application/json",
                        headers={"x-seen-id": request.headers["x-request-id"]})


async def _chunks(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(5):
        await resp.write(b"data: %d\n\n" % i)
        await asyncio.sleep(0.01)
    await resp.write_eof()
    return resp


async def _dies(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    await resp.prepare(request)
    await resp.write(b"partial")
    assert request.transport is not None
    request.transport.close()  # the worker dies mid-body
    return resp


async def _slow(request: web.Request) -> web.Response:
    await asyncio.sleep(5)
    return web.Response(text="late")


@pytest.fixture
async def server() -> AsyncIterator[TestServer]:
    app = web.Application()
    app.router.add_post("/json", _json)
    app.router.add_post("/chunks", _chunks)
    app.router.add_post("/dies", _dies)
    app.router.add_post("/slow", _slow)
    app.router.add_post("/prefix/json", _json)
    async with TestServer(app, host="127.0.0.1") as s:
        yield s


def base(server: TestServer) -> str:
    return f"http://127.0.0.1:{server.port}"


async def test_json_and_connection_reuse(server: TestServer) -> None:
    client = UpstreamClient(connect_timeout_s=2, read_timeout_s=2)
    for i in range(3):
        r = await client.post(base(server), "/json", b"[%d]" % i, f"id{i}")
        assert r.status == 200 and r.content_type.startswith("application/json")
        assert await r.read_all() == b'{"echo":[%d]}' % i
        r.release()
    (pool,) = client._pools.values()
    assert len(pool.idle) == 1, "one keep-alive connection served all three"
    client.close()


async def test_chunked_stream_arrives_in_pieces(server: TestServer) -> None:
    client = UpstreamClient(connect_timeout_s=2, read_timeout_s=2)
    r = await client.post(base(server), "/chunks", b"{}", "id")
    pieces = []
    while chunk := await r.read_chunk():
        pieces.append(chunk)
    r.release()
    assert b"".join(pieces) == b"".join(b"data: %d\n\n" % i for i in range(5))
    assert len(pieces) >= 2, "not buffered into one body"
    client.close()


async def test_early_release_closes_instead_of_pooling(server: TestServer) -> None:
    client = UpstreamClient(connect_timeout_s=2, read_timeout_s=2)
    r = await client.post(base(server), "/chunks", b"{}", "id")
    await r.read_chunk()
    r.release()  # e.g. the client went away: the worker must see the connection close
    assert not next(iter(client._pools.values())).idle
    client.close()


async def test_worker_dying_mid_body_raises(server: TestServer) -> None:
    client = UpstreamClient(connect_timeout_s=2, read_timeout_s=2)
    r = await client.post(base(server), "/dies", b"{}", "id")
    with pytest.raises(UpstreamConnectionError):
        await r.read_all()
    r.release()
    client.close()


async def test_read_timeout_and_refused_connection(server: TestServer) -> None:
    client = UpstreamClient(connect_timeout_s=2, read_timeout_s=0.2)
    with pytest.raises(TimeoutError):
        await client.post(base(server), "/slow", b"{}", "id")
    from proxy.supervisor import free_port
    with pytest.raises(UpstreamConnectionError, match="cannot connect"):
        await client.post(f"http://127.0.0.1:{free_port()}", "/json", b"{}", "id")
    client.close()


async def test_pooled_connection_closed_by_the_worker_is_not_reused(server: TestServer) -> None:
    client = UpstreamClient(connect_timeout_s=2, read_timeout_s=2)
    r = await client.post(base(server), "/json", b"1", "id")
    await r.read_all()
    r.release()
    (pool,) = client._pools.values()
    stale = pool.idle[0]
    for proto in list(server.runner.server.connections):  # type: ignore[union-attr]
        proto.force_close()
        if proto.transport is not None:
            proto.transport.close()
    await asyncio.sleep(0.05)
    assert stale.closed
    r = await client.post(base(server), "/json", b"2", "id")
    assert await r.read_all() == b'{"echo":2}'
    r.release()
    client.close()


async def test_request_on_a_connection_the_worker_just_closed_is_retried() -> None:
    """The keep-alive race: the worker closes an idle connection as the request goes out."""
    async with _one_request_a_connection() as (url, client):
        for _ in range(3):
            r = await client.post(url, "/x", b"{}", "id")
            assert await r.read_all() == b"ok"
            r.release()


async def test_a_retry_after_a_stale_connection_takes_a_fresh_one() -> None:
    """Every idle connection is stale (a worker restarted behind its address): the retry
    connects anew instead of taking the next stale one (an AssertionError, a 500, before)."""
    async with _one_request_a_connection() as (url, client):
        first = await asyncio.gather(*(client.post(url, "/x", b"{}", "id") for _ in range(3)))
        for r in first:  # three connections, each served once, now idle in the pool
            assert await r.read_all() == b"ok"
            r.release()
        (pool,) = client._pools.values()
        assert len(pool.idle) == 3
        r = await client.post(url, "/x", b"{}", "id")
        assert await r.read_all() == b"ok"
        r.release()


@contextlib.asynccontextmanager
async def _one_request_a_connection() -> AsyncIterator[tuple[str, UpstreamClient]]:
    """(the URL of a server that drops the second request on each connection, a client)."""
    server = await asyncio.start_server(_one_request_per_connection, "127.0.0.1", 0)
    client = UpstreamClient(connect_timeout_s=2, read_timeout_s=2)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", client
    finally:
        client.close()
        server.close()
        await server.wait_closed()


async def _one_request_per_connection(reader: asyncio.StreamReader,
                                      writer: asyncio.StreamWriter) -> None:
    """Answers one request, then drops the next one on the same connection unanswered."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    await reader.readexactly(length)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    await writer.drain()
    with contextlib.suppress(asyncio.IncompleteReadError):
        await reader.readuntil(b"\r\n\r\n")
    writer.close()


async def test_worker_url_path_prefix_is_kept(server: TestServer) -> None:
    client = UpstreamClient(connect_timeout_s=2, read_timeout_s=2)
    r = await client.post(base(server) + "/prefix/", "/json", b"7", "id")
    assert r.status == 200 and await r.read_all() == b'{"echo":7}'
    r.release()
    client.close()


async def test_read_timeout_counts_from_the_last_data() -> None:
    """The watchdog fails a wait only after read_timeout_s without data, however long the
    response takes as a whole; an idle pooled connection is never failed by it."""

    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (await reader.readline()).strip():
            pass
        await reader.readexactly(2)  # the body: {}
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(6):  # 6 x 0.1 s of data: longer than the 0.3 s timeout in total
            await asyncio.sleep(0.1)
            writer.write(b"5\r\nhello\r\n")
            await writer.drain()
        await asyncio.sleep(1.0)  # then silence: the timeout fires
        writer.close()

    server = await asyncio.start_server(drip, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = UpstreamClient(connect_timeout_s=2, read_timeout_s=0.3)
    try:
        resp = await client.post(f"http://127.0.0.1:{port}", "/v1/x", b"{}", "r1")
        received = b""
        with pytest.raises(TimeoutError):
            while chunk := await resp.read_chunk():
                received += chunk
        assert received == b"hello" * 6
        resp.release()
    finally:
        client.close()
        server.close()
        await server.wait_closed()


async def test_read_available_joins_what_arrived_and_the_parser_serves_the_next_response(
) -> None:
    """Several HTTP chunks already received come back as one block (one client write in
    the relay); blocks still arriving come back as they arrive; the connection's parser
    then reads the next response (chunked, then Content-Length) on the same connection."""
    release_tail = asyncio.Event()

    async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n"
                         b"3\r\nab\n\r\n3\r\ncd\n\r\n3\r\nef\n\r\n")
            await release_tail.wait()
            writer.write(b"3\r\ngh\n\r\n0\r\n\r\n")
            await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    server = await asyncio.start_server(worker, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = UpstreamClient(connect_timeout_s=2, read_timeout_s=2)
    try:
        for _ in range(2):
            release_tail.clear()
            r = await client.post(url, "/x", b"{}", "id")
            while len(r._conn.chunks) < 3:  # all three chunks of the first write are in
                await asyncio.sleep(0.005)
            assert await r.read_available() == b"ab\ncd\nef\n"
            release_tail.set()
            assert await r.read_available() == b"gh\n"  # waits for it, returns it alone
            assert await r.read_available() == b""
            r.release()
        r = await client.post(url, "/x", b"{}", "id")
        assert r.status == 200 and await r.read_all() == b"ok"
        r.release()
        (pool,) = client._pools.values()
        assert len(pool.idle) == 1, "one connection, one parser, three responses"
    finally:
        client.close()
        server.close()
        await server.wait_closed()


async def test_read_available_drains_a_paused_connection_and_resumes_it() -> None:
    """Past _MAX_BUFFERED unread bytes the connection stops reading from the worker;
    taking everything buffered at once starts it again, and nothing is lost."""
    from proxy.upstream import _MAX_BUFFERED

    piece = b"x" * 4096 + b"\n"
    total = (2 * _MAX_BUFFERED) // len(piece) + 1

    async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(total):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    server = await asyncio.start_server(worker, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = UpstreamClient(connect_timeout_s=2, read_timeout_s=5)
    try:
        r = await client.post(url, "/x", b"{}", "id")
        conn = r._conn
        for _ in range(500):  # let the worker fill the client's buffer until it pauses
            if conn.paused:
                break
            await asyncio.sleep(0.01)
        assert conn.paused and conn.buffered > _MAX_BUFFERED
        received = await r.read_available()
        assert len(received) > _MAX_BUFFERED and not conn.paused and conn.buffered == 0
        while block := await r.read_available():
            received += block
        assert received == piece * total
        r.release()
    finally:
        client.close()
        server.close()
        await server.wait_closed()
