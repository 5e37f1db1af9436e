"""The lean hot-path protocol (proxy/fastpath.py): what it serves, what it hands to aiohttp.

Raw sockets against a real proxy over the real engine workers, so that the
exact bytes on the wire (keep-alive, pipelining, chunked bodies, hand-over
mid-connection) are what is tested. ``Server: polyinfer`` marks a response
written by the lean protocol; aiohttp's responses carry its own Server header.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httptools
import orjson
import pytest

from proxy.fastpath import parse_head
from proxy.validate import CHAT, COMPLETIONS
from tests.proxy.servers import EngineProcess, ProxyThread, eventually, external_config

MODEL = "tiny-target"
MAX_BODY = 4096


@dataclass
class Response:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    @property
    def lean(self) -> bool:
        return self.headers.get("server") == "polyinfer"

    def json(self) -> dict:  # type: ignore[type-arg]
        return orjson.loads(self.body)


class RawClient:
    """One TCP connection; responses read with llhttp (de-chunked)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        self.done: list[Response] = []
        self._current = Response()
        self._name = ""
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._current.headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self._current.body += body

    def on_message_complete(self) -> None:
        self._current.status = self.parser.get_status_code()
        self.done.append(self._current)
        self._current = Response()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def responses(self, n: int) -> list[Response]:
        while len(self.done) < n:
            data = self.sock.recv(65536)
            assert data, f"connection closed after {len(self.done)} of {n} responses"
            self.parser.feed_data(data)
        out, self.done = self.done[:n], self.done[n:]
        return out

    def closed_by_server(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def post(path: str, body: bytes, *extra: bytes) -> bytes:
    head = [b"POST %s HTTP/1.1" % path.encode(), b"Host: proxy", b"Content-Type: application/json",
            b"Content-Length: %d" % len(body), *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def chat(stream: bool = True, **fields: object) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 2, "stream": stream, **fields})


def completion(**fields: object) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields})


def assert_stream_ok(r: Response) -> None:
    assert r.status == 200, r.body
    assert r.headers["content-type"] == "text/event-stream"
    assert r.headers["x-polyinfer-worker"] in ("latency", "throughput")
    assert r.headers["x-request-id"] and r.headers["x-polyinfer-domain"]
    assert "x-polyinfer-spec-depth" in r.headers
    assert r.body.endswith(b"data: [DONE]\n\n")
    assert b'"usage"' not in r.body  # asked for by the proxy, not by this client


@pytest.fixture(scope="module")
def proxy(engines: list[EngineProcess],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyThread]:
    tmp = tmp_path_factory.mktemp("fastpath")
    with ProxyThread(external_config(engines, tmp, limits={"max_body_bytes": MAX_BODY})) as p:
        yield p


@pytest.fixture
def client(proxy: ProxyThread) -> Iterator[RawClient]:
    c = RawClient(proxy.url)
    yield c
    c.close()


# -- parse_head: what the lean protocol takes -------------------------------------------------

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 12"


def test_parse_head_takes_plain_hot_route_posts() -> None:
    head = parse_head(HEAD + b"\r\nAuthorization:  Bearer k \r\nX-Request-Id: abc")
    assert head is not None
    assert (head.endpoint, head.path, head.content_length, head.keep_alive) == (
        CHAT, "/v1/chat/completions", 12, True)
    assert head.headers[b"authorization"] == b"Bearer k"
    assert head.headers[b"x-request-id"] == b"abc"
    completions = parse_head(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 0\r\n"
                             b"Connection: Close")
    assert completions is not None
    assert (completions.endpoint, completions.keep_alive) == (COMPLETIONS, False)


@pytest.mark.parametrize("head", [
    b"GET /v1/chat/completions HTTP/1.1\r\nContent-Length: 12",  # another method
    b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nContent-Length: 12",  # a query string
    b"POST /v1/models HTTP/1.1\r\nContent-Length: 12",  # another route
    b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: 12",  # HTTP/1.0
    b"POST  /v1/chat/completions HTTP/1.1\r\nContent-Length: 12",  # odd request line
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x",  # no Content-Length
    HEAD + b"\r\nTransfer-Encoding: chunked",  # chunked body
    HEAD + b"\r\nExpect: 100-continue",
    HEAD + b"\r\nUpgrade: h2c\r\nConnection: Upgrade",
    HEAD + b"\r\nConnection: keep-alive, Upgrade",
    HEAD + b"\r\nContent-Length: 12",  # a repeated field
    b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: +12",
    b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 1 2",
    HEAD + b"\r\nBad Name: x",  # not a token
    HEAD + b"\r\nX-Folded: a\r\n continued",  # obs-fold
    HEAD + b"\r\nX-Ctl: a\x00b",  # control character
    HEAD + b"\r\nX-Bare: a\nX-Other: b",  # bare LF
])
def test_parse_head_leaves_everything_else_to_aiohttp(head: bytes) -> None:
    assert parse_head(head) is None


# -- served by the lean protocol -------------------------------------------------------------

def test_keep_alive_stream_json_and_completions_on_one_connection(client: RawClient) -> None:
    client.send(post("/v1/chat/completions", chat(x_ignored=1),
                     b"x-request-id: my-id-1"))
    (r,) = client.responses(1)
    assert r.lean
    assert_stream_ok(r)
    assert r.headers["x-request-id"] == "my-id-1"
    assert r.headers["transfer-encoding"] == "chunked"
    client.send(post("/v1/chat/completions", chat(stream=False)))
    (r,) = client.responses(1)
    assert r.lean and r.status == 200
    assert int(r.headers["content-length"]) == len(r.body)
    assert r.json()["choices"][0]["message"]["content"] is not None
    client.send(post("/v1/completions", completion(
        stream=True, stream_options={"include_usage": True})))
    (r,) = client.responses(1)
    assert r.lean and r.status == 200
    assert b'"usage"' in r.body  # the client asked for it: relayed
    assert r.body.endswith(b"data: [DONE]\n\n")


def test_body_arriving_in_pieces(client: RawClient) -> None:
    raw = post("/v1/chat/completions", chat())
    for i in range(0, len(raw), 7):
        client.send(raw[i:i + 7])
        time.sleep(0.001)
    (r,) = client.responses(1)
    assert r.lean
    assert_stream_ok(r)


def test_pipelined_requests_answered_in_order(client: RawClient) -> None:
    client.send(post("/v1/chat/completions", chat(), b"x-request-id: p1")
                + post("/v1/completions", completion(), b"x-request-id: p2")
                + post("/v1/chat/completions", chat(), b"x-request-id: p3"))
    rs = client.responses(3)
    assert [r.headers["x-request-id"] for r in rs] == ["p1", "p2", "p3"]
    assert all(r.lean and r.status == 200 for r in rs)


def test_many_pipelined_errors_answered_without_recursion(client: RawClient) -> None:
    # each is answered at once (no await), so they must not nest in one call stack
    client.send(post("/v1/chat/completions", b"{not json") * 300)
    rs = client.responses(300)
    assert all(r.lean and r.status == 400 for r in rs)
    assert rs[0].json()["error"]["type"] == "invalid_request_error"
    client.send(post("/v1/chat/completions", chat()))
    assert_stream_ok(client.responses(1)[0])


def test_bad_body_is_a_400_and_the_connection_keeps_serving(client: RawClient) -> None:
    client.send(post("/v1/chat/completions", orjson.dumps({"model": MODEL})))
    (r,) = client.responses(1)
    assert r.lean and r.status == 400
    assert r.json()["error"]["param"] == "messages"
    assert r.headers["x-request-id"]
    client.send(post("/v1/chat/completions", chat(model="no-such-model")))
    (r,) = client.responses(1)
    assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"
    client.send(post("/v1/chat/completions", chat()))
    assert_stream_ok(client.responses(1)[0])


def test_connection_close_is_honoured(client: RawClient) -> None:
    client.send(post("/v1/chat/completions", chat(), b"Connection: close"))
    (r,) = client.responses(1)
    assert r.lean and r.status == 200
    assert client.closed_by_server()


# -- handed over to aiohttp ------------------------------------------------------------------

def test_other_routes_on_a_lean_connection_are_handed_over(client: RawClient) -> None:
    client.send(post("/v1/chat/completions", chat()))
    (r,) = client.responses(1)
    assert r.lean
    # a pipelined GET right behind a lean request: the hand-over starts at its first byte
    client.send(post("/v1/completions", completion())
                + b"GET /v1/models HTTP/1.1\r\nHost: proxy\r\n\r\n")
    first, models = client.responses(2)
    assert first.lean and first.status == 200
    assert not models.lean and models.status == 200
    assert models.json()["data"][0]["id"] == MODEL
    assert models.headers["x-request-id"]
    # the rest of the connection is aiohttp's, hot routes included
    client.send(post("/v1/chat/completions", chat()))
    (r,) = client.responses(1)
    assert not r.lean
    assert_stream_ok(r)


def test_chunked_request_body_is_served_by_aiohttp(client: RawClient) -> None:
    body = chat()
    chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (10, body[:10], len(body) - 10, body[10:])
    client.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: "
                b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked)
    (r,) = client.responses(1)
    assert not r.lean
    assert_stream_ok(r)


def test_body_over_the_limit_is_a_413_openai_error(client: RawClient) -> None:
    big = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * MAX_BODY}]})
    client.send(post("/v1/chat/completions", big))
    (r,) = client.responses(1)
    assert r.status == 413
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert r.headers["x-request-id"]


def test_garbage_gets_aiohttps_400(client: RawClient) -> None:
    client.send(b"\x16\x03\x01 definitely not http\r\n\r\n")
    (r,) = client.responses(1)
    assert r.status == 400 and not r.lean


# -- lifetimes (client disconnects: tests/proxy/test_resilience.py, on this protocol) ---------

def test_auth_is_checked_on_the_lean_path(engines: list[EngineProcess], tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = external_config(engines, tmp_path, auth={"api_keys": ["sk-good"]})
    with ProxyThread(config) as p:
        c = RawClient(p.url)
        try:
            c.send(post("/v1/chat/completions", chat()))
            (r,) = c.responses(1)
            assert r.lean and r.status == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
            c.send(post("/v1/chat/completions", chat(), b"Authorization: Bearer sk-good"))
            (r,) = c.responses(1)
            assert r.lean
            assert_stream_ok(r)
        finally:
            c.close()


def test_fast_path_off_serves_everything_with_aiohttp(engines: list[EngineProcess],
                                                      tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = external_config(engines, tmp_path, server={"fast_path": False})
    with ProxyThread(config) as p:
        c = RawClient(p.url)
        try:
            c.send(post("/v1/chat/completions", chat()))
            (r,) = c.responses(1)
            assert not r.lean
            assert_stream_ok(r)
        finally:
            c.close()


def test_idle_keep_alive_connections_are_closed(proxy: ProxyThread) -> None:
    (site,) = proxy.server._runner.sites  # type: ignore[union-attr]
    fast = site._fast
    c = RawClient(proxy.url)
    try:
        c.send(post("/v1/chat/completions", chat()))
        c.responses(1)
        conn = next(iter(x for x in fast.connections if x.transport is not None
                         and x.transport.get_extra_info("peername") == c.sock.getsockname()))
        assert eventually(lambda: conn._task is None)  # reading the worker's last bytes
        conn.close_if_idle(fast.loop.time() - 3600)  # idle for less than an hour: kept
        assert conn in fast.connections
        # idle past the keep-alive timeout: closed
        proxy.loop.call_soon_threadsafe(conn.close_if_idle,
                                        fast.loop.time() + fast.keepalive_timeout_s + 1)
        assert c.closed_by_server()
    finally:
        c.close()
