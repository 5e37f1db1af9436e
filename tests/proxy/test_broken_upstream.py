"""Workers that answer badly: a 200 that is not JSON, a stream request answered with a JSON
body, usage counters that are not numbers, an unexpected error while a stream is relayed.

Each must give the client a clear error (or a retry on another worker while nothing reached
the client), leave the proxy serving with nothing in flight, and keep the traces whole
(one valid JSON line per request, no prompt text).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from proxy import keys
from proxy.config import ProxyConfig
from tests.proxy.servers import (
    EngineProcess,
    ProxyThread,
    answer_get,
    end_other_tasks,
    eventually,
    read_raw_request,
    read_traces,
)

MODEL = "tiny-target"
SECRET = "SECRET-PROMPT-TEXT"
MESSAGES = [{"role": "user", "content": SECRET}]


def _event(data: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


_OK_EVENTS = [_event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
              _event({"choices": [{"index": 0, "delta": {"content": "Hello"}}]})]
_BAD_USAGE = {"prompt_tokens": 1, "completion_tokens": 1,
              "spec_decode": {"num_draft_tokens": "lots", "num_accepted_tokens": [1]}}
_BAD_USAGE_BODY = orjson.dumps({"object": "chat.completion", "usage": _BAD_USAGE, "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]})
_BAD_USAGE_STREAM = [*_OK_EVENTS, _event({"choices": [], "usage": _BAD_USAGE}),
                     b"data: [DONE]\n\n"]


class FakeBrokenUpstream:
    """FAKE worker (test fixture): an OpenAI-style server that answers with what a broken
    worker sends, which no real engine here does on purpose.

    The answer is ``mode``, else the request body's ``fake_mode`` field (the proxy passes
    unknown fields through): ``not_json`` (a 200 whose body is cut JSON), ``empty`` (a 200
    with no body), ``json_for_stream`` (a JSON document where SSE events were asked for),
    ``bad_usage`` (usage counters that are not numbers), ``echo_400`` / ``echo_500`` (an
    error whose message quotes the request's messages, as a server's validation error can),
    ``no_done`` (a stream that ends cleanly without ``[DONE]``), ``error_event`` (one that
    ends with an error event instead), ``ok`` (a good SSE stream).
    """

    def __init__(self, mode: str | None = None) -> None:
        self.mode = mode
        self.url = ""
        self.num_posts = 0
        self.loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> FakeBrokenUpstream:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop).result(10)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc: object) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            await end_other_tasks()
        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head, body = await read_raw_request(reader)
                if (got := answer_get(head)) is not None:
                    writer.write(got)
                else:
                    self.num_posts += 1
                    request = orjson.loads(body)
                    mode = self.mode or request.get("fake_mode", "ok")
                    writer.write(_echo_error(int(mode[5:]), request) if mode.startswith("echo_")
                                 else self._answer(mode, request.get("stream") is True))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    @staticmethod
    def _answer(mode: str, stream: bool) -> bytes:
        if mode == "not_json":
            return _whole(b"application/json", b'{"id": "x", "choices": [{"ind')
        if mode == "empty":
            return _whole(b"application/json", b"")
        if mode == "json_for_stream":
            return _whole(b"application/json", _BAD_USAGE_BODY)
        if mode == "bad_usage":
            return _chunked(_BAD_USAGE_STREAM) if stream else _whole(b"application/json",
                                                                      _BAD_USAGE_BODY)
        if mode == "no_done":
            return _chunked(_OK_EVENTS)
        if mode == "error_event":
            return _chunked([*_OK_EVENTS, _event({"error": {
                "message": "refused", "type": "BadRequestError", "code": 400}})])
        assert mode == "ok", mode
        return _chunked([*_OK_EVENTS, b"data: [DONE]\n\n"])


def _echo_error(status: int, request: dict[str, object]) -> bytes:
    message = f"1 validation error: input_value={request.get('messages')!r}"
    body = orjson.dumps({"error": {"message": message, "type": "BadRequestError",
                                   "code": status}})
    return b"HTTP/1.1 %d Error\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        status, len(body), body)


def _whole(content_type: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (
        content_type, len(body), body)


def _chunked(events: list[bytes]) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n")


def _worker(name: str, url: str, backend: str = "external") -> dict[str, object]:
    return {"name": name, "url": url,
            "config": {"backend": backend, "served_model_name": MODEL}}


def _config(tmp: Path, workers: list[dict[str, object]], record_prompt_text: bool = False,
            **limits: object) -> ProxyConfig:
    return ProxyConfig.from_dict({
        "server": {"host": "127.0.0.1", "port": 0},
        "workers": workers,
        "routing": {"policy": "round_robin", "shape_estimator": "heuristic"},
        "traces": {"dir": str(tmp / "traces"), "flush_interval_s": 0.1,
                   "record_prompt_text": record_prompt_text},
        "health": {"interval_s": 0.2, "metrics_interval_s": 0, "breaker_failures": 1000},
        "limits": {"max_loop_lag_s": 0, **limits},
        "run_dir": str(tmp / "run"),
    })


@pytest.fixture
def broken(tmp_path: Path) -> Iterator[ProxyThread]:
    """A proxy whose only worker is a FakeBrokenUpstream (its answer chosen per request)."""
    with FakeBrokenUpstream() as fake, \
            ProxyThread(_config(tmp_path, [_worker("fake", fake.url)])) as p:
        yield p


def _chat(h: httpx.Client, mode: str, stream: bool, **kwargs: object) -> httpx.Response:
    return h.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "stream": stream, "fake_mode": mode}, **kwargs)


def _assert_traces_whole(p: ProxyThread, tmp: Path, num_requests: int) -> list[dict[str, object]]:
    stats = p.app[keys.STATS]
    assert eventually(lambda: stats.in_flight == 0)
    assert all(w.view.outstanding_requests == 0 for w in p.app[keys.POOL].workers.values())
    p.stop()  # flushes the traces
    records = read_traces(tmp / "traces")  # every line parses
    assert len(records) == num_requests
    for f in (tmp / "traces").glob("traces-*.jsonl"):
        raw = f.read_bytes()
        assert raw.endswith(b"\n") and SECRET.encode() not in raw
    return records


@pytest.mark.parametrize(("mode", "stream"), [
    ("not_json", False), ("empty", False), ("json_for_stream", True), ("not_json", True)])
def test_a_worker_answering_200_without_json_or_sse_is_a_502(broken: ProxyThread, tmp_path: Path,
                                                             mode: str, stream: bool) -> None:
    with httpx.Client(base_url=broken.url, timeout=30) as h:
        r = _chat(h, mode, stream)
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["type"] == "upstream_error" and "fake" in err["message"]
        assert r.headers["x-polyinfer-worker"] == "fake"
        assert _chat(h, "ok", True).status_code == 200  # still serving
    records = _assert_traces_whole(broken, tmp_path, 2)
    assert [r["status"] for r in records] == ["error", "ok"]
    assert str(records[0]["error"]).startswith("upstream_error")


def test_a_worker_answering_200_without_json_is_retried_on_another(
        engines: list[EngineProcess], tmp_path: Path) -> None:
    engine = engines[0]
    with FakeBrokenUpstream(mode="not_json") as fake, ProxyThread(_config(
            tmp_path, [_worker("fake", fake.url), _worker(engine.spec.name, engine.url)])) as p:
        c = openai.OpenAI(base_url=f"{p.url}/v1", api_key="x", max_retries=0, timeout=60)
        for _ in range(4):
            raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES,
                                                              max_tokens=2)
            assert raw.headers["x-polyinfer-worker"] == engine.spec.name
            assert raw.parse().choices[0].message.content is not None
        assert fake.num_posts >= 1 and p.app[keys.STATS].retries == fake.num_posts
        records = _assert_traces_whole(p, tmp_path, 4)
    assert {r["status"] for r in records} == {"ok"}


@pytest.mark.parametrize("stream", [False, True])
def test_usage_counters_that_are_not_numbers_are_ignored(broken: ProxyThread, tmp_path: Path,
                                                         stream: bool) -> None:
    with httpx.Client(base_url=broken.url, timeout=30) as h:
        r = _chat(h, "bad_usage", stream)
        assert r.status_code == 200, r.text
        if stream:
            assert r.text.endswith("data: [DONE]\n\n") and '"usage"' not in r.text
        else:
            assert r.json()["usage"]["completion_tokens"] == 1
    (record,) = _assert_traces_whole(broken, tmp_path, 1)
    assert record["status"] == "ok" and record["completion_tokens"] == 1
    assert record["spec_draft_tokens"] == 0 and record["spec_accepted_tokens"] == 0


def test_an_unexpected_error_mid_stream_ends_it_with_an_error_event(
        broken: ProxyThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault injected into the relay after the 200 head: on the lean path and on aiohttp's
    (a chunked upload is served by aiohttp), the stream ends cleanly with an error event
    instead of being cut or carrying a second HTTP response inside its body."""
    def fail(events: bytes) -> bool:
        raise RuntimeError("injected fault")

    monkeypatch.setattr("proxy.relay._carries_output", fail)
    body = orjson.dumps({"model": MODEL, "messages": MESSAGES, "stream": True})
    with httpx.Client(base_url=broken.url, timeout=30) as h:
        lean = h.post("/v1/chat/completions", content=body)
        on_aiohttp = h.post("/v1/chat/completions", content=iter([body[:10], body[10:]]))
        for r in (lean, on_aiohttp):
            assert r.status_code == 200
            last = r.text.strip().split("\n\n")[-1]
            assert orjson.loads(last.removeprefix("data: "))["error"]["type"] == "internal_error"
        c = openai.OpenAI(base_url=f"{broken.url}/v1", api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.APIError, match="internal proxy error"):
            for _ in c.chat.completions.create(model=MODEL, messages=MESSAGES,  # type: ignore[call-overload]
                                               stream=True):
                pass
        monkeypatch.undo()
        assert _chat(h, "ok", True).status_code == 200  # still serving
    records = _assert_traces_whole(broken, tmp_path, 4)
    assert [r["status"] for r in records] == ["error", "error", "error", "ok"]


@pytest.mark.parametrize("keep_text", [False, True])
def test_a_worker_error_quoting_the_prompt_stays_out_of_traces(tmp_path: Path,
                                                               keep_text: bool) -> None:
    """The trace keeps a worker's error body only where the operator records prompt text;
    else its type and code. The client gets the worker's 4xx as sent."""
    with FakeBrokenUpstream() as fake, ProxyThread(
            _config(tmp_path, [_worker("fake", fake.url)], keep_text)) as p:
        with httpx.Client(base_url=p.url, timeout=30) as h:
            r = _chat(h, "echo_400", False)
            assert r.status_code == 400 and SECRET in r.json()["error"]["message"]
            r = _chat(h, "echo_500", True)
            assert r.status_code == 502 and (SECRET in r.text) == keep_text
            assert "BadRequestError" in r.json()["error"]["message"]
        stats = p.app[keys.STATS]
        assert eventually(lambda: stats.in_flight == 0)
        p.stop()
    records = read_traces(tmp_path / "traces")
    assert [r["status"] for r in records] == ["error", "error"]
    raw = b"".join(f.read_bytes() for f in (tmp_path / "traces").glob("traces-*.jsonl"))
    assert (SECRET.encode() in raw) == keep_text
    if not keep_text:
        assert records[0]["error"] == "upstream_400: type='BadRequestError' code=400"


@pytest.mark.parametrize("backend", ["vllm", "external"])
def test_a_stream_that_ends_without_done(tmp_path: Path, backend: str) -> None:
    """A stream that ends on the worker's own error event is an error in the trace (the event
    relayed as its last word). A vLLM (or built-in engine) stream always ends with [DONE] when
    whole: one that ends without it was cut short, and the client gets an error event. Other
    OpenAI-compatible servers need not send [DONE]: their stream's end is its end."""
    with FakeBrokenUpstream() as fake, ProxyThread(
            _config(tmp_path, [_worker("fake", fake.url, backend)])) as p:
        with httpx.Client(base_url=p.url, timeout=30) as h:
            cut, refused = _chat(h, "no_done", True), _chat(h, "error_event", True)
            assert _chat(h, "ok", True).status_code == 200  # still serving
        stats = p.app[keys.STATS]
        assert eventually(lambda: stats.in_flight == 0)
        p.stop()
    assert cut.status_code == refused.status_code == 200
    last = [orjson.loads(r.text.strip().split("\n\n")[-1].removeprefix("data: "))
            for r in (cut, refused)]
    assert last[1]["error"]["message"] == "refused"  # relayed, nothing added after it
    records = read_traces(tmp_path / "traces")
    assert records[1]["error"] == "upstream_error_event: fake: type='BadRequestError' code=400"
    if backend == "external":
        assert "error" not in last[0]
        assert [r["status"] for r in records] == ["ok", "error", "ok"]
        return
    assert "ended the stream early" in last[0]["error"]["message"]
    assert [r["status"] for r in records] == ["error", "error", "ok"]
    assert str(records[0]["error"]).startswith("upstream_unfinished: fake")
