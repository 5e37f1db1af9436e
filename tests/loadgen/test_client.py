"""The streaming client's measurements against a server whose timing the test scripts."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import orjson
import pytest

from loadgen.client import StreamingClient, StreamParser, make_session
from loadgen.config import ClientConfig
from loadgen.request import PreparedRequest, RequestResult
from tests.loadgen.upstream import Script, ScriptedUpstream


def _request(path: str = "/v1/completions", max_tokens: int = 8, **extra: Any) -> PreparedRequest:
    body: dict[str, Any] = {"model": "m", "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, **extra}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return PreparedRequest(index=0, line=1, arrival_s=0.0, path=path, body=orjson.dumps(body),
                           prompt_tokens=1, max_tokens=max_tokens, domain=None)


async def _send(url: str, req: PreparedRequest, stream: bool = True,
                timeout_s: float = 600.0, record_error_bodies: bool = False) -> RequestResult:
    cfg = ClientConfig(url, stream=stream, timeout_s=timeout_s,
                       record_error_bodies=record_error_bodies)
    result = RequestResult(index=0, line=1, scheduled_s=0.0)
    async with make_session(cfg) as session:
        await StreamingClient(cfg, session).send(req, result)
    return result


async def test_ttft_itl_tpot_follow_vllm_definitions(upstream: ScriptedUpstream) -> None:
    upstream.script = Script(ttft_s=0.05, itl_s=0.01, tokens_per_chunk=2)
    r = await _send(upstream.url, _request(max_tokens=8))
    served = upstream.received[0]
    assert r.ok and r.error is None and r.http_status == 200
    assert len(served.chunk_s) == 4 and len(r.itl_s) == 3  # one gap per chunk, not per token
    # the client starts its clock before the server sees the request and stops it after
    # the server wrote the chunk, so its TTFT can only be longer than the server's
    assert r.ttft_s is not None and r.e2e_s is not None and r.tpot_s is not None
    assert r.ttft_s >= served.chunk_s[0] - served.recv_s >= 0.05
    assert r.e2e_s >= served.chunk_s[-1] - served.recv_s
    assert r.ttft_s + sum(r.itl_s) == pytest.approx(r.e2e_s, abs=1e-9)
    assert r.completion_tokens == 8 and r.prompt_tokens == 7
    assert r.tpot_s == (r.e2e_s - r.ttft_s) / (8 - 1)


async def test_usage_counts_tokens_not_chunks(upstream: ScriptedUpstream) -> None:
    upstream.script = Script(usage_completion_tokens=9)
    r = await _send(upstream.url, _request(max_tokens=5))
    assert r.completion_tokens == 9
    assert r.tpot_s == (r.e2e_s - r.ttft_s) / 8  # type: ignore[operator]


async def test_without_usage_counts_text_chunks(upstream: ScriptedUpstream) -> None:
    upstream.script = Script(usage_completion_tokens=-1)
    r = await _send(upstream.url, _request(max_tokens=5))
    assert r.ok and r.completion_tokens == 5


async def test_one_token_has_no_tpot(upstream: ScriptedUpstream) -> None:
    r = await _send(upstream.url, _request(max_tokens=1))
    assert r.ok and r.completion_tokens == 1 and r.tpot_s is None and r.itl_s == []
    assert r.e2e_s == r.ttft_s


async def test_chat_role_chunk_is_not_the_first_token(upstream: ScriptedUpstream) -> None:
    upstream.script = Script(ttft_s=0.1, role_chunk=True)
    r = await _send(upstream.url, _request("/v1/chat/completions", max_tokens=3))
    served = upstream.received[0]
    assert r.ok and r.completion_tokens == 3
    assert r.ttft_s is not None and r.ttft_s >= served.chunk_s[0] - served.recv_s >= 0.1


async def test_http_error_is_recorded(upstream: ScriptedUpstream) -> None:
    upstream.script = Script(status=503)
    r = await _send(upstream.url, _request())
    assert not r.ok and r.http_status == 503
    # the server's message quotes the prompt: only its type and code are kept
    assert r.error == "HTTP 503: type=server_error code=503"
    assert r.ttft_s is None and r.e2e_s is not None
    r = await _send(upstream.url, _request(), record_error_bodies=True)
    assert r.error is not None and r.error.startswith("HTTP 503:")
    assert "scripted failure for prompt 'hi'" in r.error


def test_error_text_is_kept_only_when_asked_for() -> None:
    from loadgen.client import describe_error
    raw = b'{"error": {"message": "bad prompt: my secret", "type": "invalid_request_error"}}'
    error = orjson.loads(raw)["error"]
    assert describe_error(error, raw, False) == "type=invalid_request_error"
    assert "my secret" in describe_error(error, raw, True)
    # no type or code, or not an OpenAI error at all: its length
    assert describe_error({"message": "my secret"}, b"x" * 30, False) == "(30 bytes, not kept)"
    assert describe_error(None, b"<html>my secret</html>", False) == "(22 bytes, not kept)"
    # a bool is not a code; long fields are cut
    assert describe_error({"code": True, "type": "t" * 500}, raw, False) == "type=" + "t" * 60


async def test_cut_stream_is_an_error(upstream: ScriptedUpstream) -> None:
    upstream.script = Script(cut_after_chunks=2)
    r = await _send(upstream.url, _request(max_tokens=8))
    assert not r.ok and r.error == "stream ended before [DONE]"
    upstream.script = Script(cut_after_chunks=0)
    r = await _send(upstream.url, _request(max_tokens=8))
    assert not r.ok and r.error == "stream carried no tokens"


async def test_timeout_is_an_error(upstream: ScriptedUpstream) -> None:
    upstream.script = Script(ttft_s=2.0)
    r = await _send(upstream.url, _request(), timeout_s=0.2)
    assert not r.ok and r.error is not None and r.error.startswith("TimeoutError")
    assert r.e2e_s is not None and r.e2e_s >= 0.2 and r.ttft_s is None


async def test_unreachable_target_is_an_error() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = await _send(f"http://127.0.0.1:{port}", _request())
    assert not r.ok and r.error is not None and "Connect" in r.error


async def test_proxy_headers_are_recorded(upstream: ScriptedUpstream) -> None:
    upstream.script = Script(headers=(("x-polyinfer-worker", "w1"),
                                      ("x-polyinfer-domain", "code"), ("x-request-id", "r-1"),
                                      ("x-polyinfer-spec-depth", "3")))
    r = await _send(upstream.url, _request())
    assert (r.worker, r.domain, r.request_id, r.spec_depth) == ("w1", "code", "r-1", "3")


async def test_non_streaming_measures_e2e_only(upstream: ScriptedUpstream) -> None:
    from aiohttp import web

    async def whole(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "a b"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 2}})

    server = web.Application()
    server.router.add_post("/v1/completions", whole)
    runner = web.AppRunner(server)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        r = await _send(f"http://127.0.0.1:{port}", _request(stream=False), stream=False)
    finally:
        await runner.cleanup()
    assert r.ok and r.completion_tokens == 2 and r.e2e_s is not None
    assert r.ttft_s is None and r.tpot_s is None


async def test_client_sockets_set_tcp_nodelay(upstream: ScriptedUpstream) -> None:
    upstream.script = Script(ttft_s=0.05)  # the stream is still open when we look
    async with make_session(ClientConfig(upstream.url)) as session, \
            session.post("/v1/completions", data=_request().body) as resp:
        sock = resp.connection.transport.get_extra_info("socket")  # type: ignore[union-attr]
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        await resp.read()


def test_parser_splits_events_across_reads_and_stamps_per_read() -> None:
    p = StreamParser()
    p.feed(b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choi', 1.0)
    p.feed(b'ces":[{"text":"b"}]}\n\ndata: {"choices":[{"text":"c"}]}\n\n', 1.5)
    p.feed(b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\ndata: [DONE]\n\n', 2.0)
    assert (p.first_s, p.last_s, p.itl_s, p.num_chunks) == (1.0, 1.5, [0.5, 0.0], 3)
    assert p.usage == {"completion_tokens": 3} and p.done and p.error is None


def test_parser_reports_error_events_and_garbage() -> None:
    event = b'data: {"error": {"message": "boom", "type": "server_error", "code": 500}}\n\n'
    p = StreamParser()
    p.feed(event, 1.0)
    assert p.error == "stream error: type=server_error code=500"
    p = StreamParser(record_error_bodies=True)
    p.feed(event, 1.0)
    assert p.error is not None and "boom" in p.error
    q = StreamParser()
    q.feed(b"data: {not json\n\n", 1.0)
    assert q.error == "unparseable stream event: 9 bytes"
    q = StreamParser(record_error_bodies=True)
    q.feed(b"data: {not json\n\n", 1.0)
    assert q.error == "unparseable stream event: b'{not json'"


class FakeBrokenTarget:
    """FAKE: a server that answers 200 with well-formed SSE of the wrong shapes.

    No real server here sends these; a buggy or foreign one might. Each request
    gets the body named by its prompt.
    """

    BODIES = {
        "usage-list": b'data: {"choices":[{"text":"a"}]}\n\ndata: {"usage":[1,2]}\n\n'
                      b"data: [DONE]\n\n",
        "usage-str": b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":"b"}]}\n\n'
                     b'data: {"choices":[],"usage":{"completion_tokens":"2"}}\n\ndata: [DONE]\n\n',
        "choices-dict": b'data: {"choices":{"text":"a"}}\n\ndata: [DONE]\n\n',
        "delta-str": b'data: {"choices":[{"delta":"abc"}]}\n\ndata: [DONE]\n\n',
        "choice-null": b'data: {"choices":[null]}\n\ndata: [DONE]\n\n',
        "text-int": b'data: {"choices":[{"text":5}]}\n\ndata: [DONE]\n\n',
    }

    async def start(self) -> str:
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def close(self) -> None:
        await self._runner.cleanup()

    async def _generate(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(self.BODIES[body["prompt"]])
        await resp.write_eof()
        return resp


async def test_wrong_shaped_events_fail_their_request_not_the_run(tmp_path: Path) -> None:
    from loadgen import ArrivalConfig, OutputConfig, ReplayConfig, TraceConfig, replay
    from loadgen.request import TraceRequest
    from polyinfer.config import TINY_TARGET

    target = FakeBrokenTarget()
    url = await target.start()
    names = list(FakeBrokenTarget.BODIES)
    records = [TraceRequest(line=i + 1, prompt=name, output_tokens=2)
               for i, name in enumerate(names)]
    cfg = ReplayConfig(trace=TraceConfig("records"), client=ClientConfig(url, model="m"),
                       arrivals=ArrivalConfig(mode="concurrency", concurrency=2),
                       output=OutputConfig(str(tmp_path), plots=False, quiet=True),
                       tokenizer=str(TINY_TARGET))
    try:
        result = await replay(cfg, records)  # was: AttributeError/KeyError ended the run
    finally:
        await target.close()
    by_name = {names[r.line - 1]: r for r in result.results}
    assert len(by_name) == len(names) == result.summary["num_requests"]
    # a usage of the wrong shape is ignored: tokens are counted from the chunks
    assert by_name["usage-list"].ok and by_name["usage-list"].completion_tokens == 1
    assert by_name["usage-str"].ok and by_name["usage-str"].completion_tokens == 2
    for name in ("choices-dict", "delta-str", "choice-null", "text-int"):
        assert not by_name[name].ok and by_name[name].error == "stream carried no tokens"
    lines = (tmp_path / "requests.jsonl").read_bytes().splitlines()
    assert len(lines) == len(names) and all(orjson.loads(x)["index"] >= 0 for x in lines)
