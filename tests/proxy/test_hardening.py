"""Hardening against a client's mistakes and an attacker's probes, through a real proxy on
loopback: bounded JSON nesting, logs without credentials or prompt text, the admin surface,
slow clients, trace-write failures, read endpoints behind the API keys (issue 30).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.proxy.servers import EngineProcess, ProxyThread, external_config, read_traces

MODEL = "tiny-target"
SECRET_KEY = "sk-SECRET-KEY-0123456789"
SECRET_PROMPT = "SECRET-PROMPT-TEXT-4242"


@pytest.fixture
def proxy(engines: list[EngineProcess], tmp_path: Path) -> Iterator[ProxyThread]:
    with ProxyThread(external_config(engines, tmp_path,
                                     auth={"admin_key": "admin-test"})) as p:
        yield p


def _nested(depth: int) -> object:
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("fast_path", [True, False])
def test_deep_nesting_is_a_400_without_traceback(engines: list[EngineProcess], tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture,
                                                  fast_path: bool) -> None:
    config = external_config(engines, tmp_path, server={"fast_path": fast_path})
    with ProxyThread(config) as p, httpx.Client(base_url=p.url, timeout=30) as http, \
            caplog.at_level(logging.DEBUG):
        for depth in (255, 600, 1020):
            # nested in a pass-through field (the worker would judge it) and in a checked one
            for body in ({"model": MODEL, "max_tokens": 2, "tools": _nested(depth),
                          "messages": [{"role": "user", "content": "hi"}]},
                         {"model": MODEL, "max_tokens": _nested(depth),
                          "messages": [{"role": "user", "content": "hi"}]}):
                r = http.post("/v1/chat/completions", content=orjson.dumps(
                    body, option=orjson.OPT_PASSTHROUGH_DATACLASS) if depth < 255 else
                    _dump_deep(body))
                assert r.status_code == 400, r.text
                assert r.json()["error"]["type"] == "invalid_request_error"
        r = http.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text
    assert "Traceback" not in caplog.text


def _dump_deep(body: dict[str, object]) -> bytes:
    """JSON deeper than orjson writes (it reads up to 1,024 levels)."""
    import json
    import sys
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)
    try:
        return json.dumps(body).encode()
    finally:
        sys.setrecursionlimit(limit)


def test_a_bad_field_value_is_not_quoted(proxy: ProxyThread) -> None:
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": SECRET_PROMPT,
            "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert SECRET_PROMPT not in r.text
    assert "max_tokens" in r.json()["error"]["message"]


def _raw_exchange(url: str, request: bytes, timeout_s: float = 10.0) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        s.sendall(request)
        out = b""
        while True:
            try:
                data = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not data:
                break
            out += data
    return out


def test_malformed_requests_leave_no_secret_in_the_log(proxy: ProxyThread, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    body = orjson.dumps({"model": MODEL, "max_tokens": 2,
                         "messages": [{"role": "user", "content": SECRET_PROMPT}]})
    heads = [
        # bare-LF line ends
        b"POST /v1/chat/completions HTTP/1.1\nHost: x\nAuthorization: Bearer %s\n"
        b"Content-Type: application/json\nContent-Length: %d\n\n",
        # a control byte in a header value
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\x01\r\n"
        b"Content-Length: %d\r\n\r\n",
        # a header line without a colon, then the key
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nnot a header\r\n"
        b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n",
    ]
    with caplog.at_level(logging.DEBUG):
        for head in heads:
            answer = _raw_exchange(proxy.url, head % (SECRET_KEY.encode(), len(body)) + body)
            assert answer[:9] in (b"HTTP/1.0 ", b"HTTP/1.1 ") and answer[9:10] == b"4", answer[:200]
        with httpx.Client(base_url=proxy.url, timeout=30) as http:
            assert http.get("/health").status_code == 200
    assert SECRET_KEY not in caplog.text
    assert SECRET_PROMPT not in caplog.text
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text


ADMIN = {"x-admin-key": "admin-test"}


def test_admin_policy_by_registered_name_only(proxy: ProxyThread) -> None:
    with httpx.Client(base_url=proxy.url, timeout=30, headers=ADMIN) as http:
        for name in ("os:abort", "os:_exit", "builtins:int", "router.baselines:RoundRobinPolicy",
                     "", 7, None, ["round_robin"]):
            r = http.put("/admin/policy", json={"policy": name})
            assert r.status_code == 400, (name, r.text)
            assert r.json()["error"]["param"] == "policy"
        assert http.put("/admin/policy", json={"policy": "round_robin", "seed": True}
                        ).status_code == 400
        r = http.put("/admin/policy", json={"policy": "least_outstanding"})
        assert r.status_code == 200 and r.json()["policy"] == "least_outstanding"
        assert http.get("/health").status_code == 200  # still alive


def test_admin_worker_reach_is_what_the_config_declares(engines: list[EngineProcess],
                                                        tmp_path: Path) -> None:
    marker = tmp_path / "injected"
    evil_path = tmp_path / "evil"
    evil_path.mkdir()
    (evil_path / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = external_config(engines, tmp_path, auth={"admin_key": "admin-test"},
                             admin={"launch_env": ["OMP_NUM_THREADS"]})
    latency = engines[0]
    with ProxyThread(config) as p, httpx.Client(base_url=p.url, timeout=60,
                                                headers=ADMIN) as http:
        launch_spec = {"name": "evil", "config": {"backend": "engine"},
                       "launch": {"env": {"PYTHONPATH": str(evil_path)}}}
        r = http.post("/admin/workers", json=launch_spec)
        assert r.status_code == 403 and "PYTHONPATH" in r.json()["error"]["message"], r.text
        r = http.post("/admin/workers", json={**launch_spec, "launch": {"args": ["--x"]}})
        assert r.status_code == 403, r.text
        r = http.post("/admin/workers", json={
            "name": "vargs", "config": {"backend": "vllm", "vllm": {"args": ["--x"]}},
            "launch": {}})
        assert r.status_code == 403, r.text
        # another host: refused for a new worker and for a replacement by URL
        r = http.post("/admin/workers", json={"name": "far", "url": "http://10.255.0.1:9",
                                              "config": {"backend": "engine"}})
        assert r.status_code == 403 and r.json()["error"]["param"] == "url", r.text
        r = http.post("/admin/workers/latency/replace", json={"url": "http://evil.example:80"})
        assert r.status_code == 403, r.text
        # odd bodies: every one a clean 4xx
        for body in (b"[]", b"{}", b'{"name": 5}', b'{"name": "a", "url": 5}',
                     b'{"name": "a", "launch": [], "config": {}}', b'{"name": "a", "url": '
                     b'"http://127.0.0.1:1", "config": {"backend": "nope"}}',
                     b'{"name": "a", "url": "http://127.0.0.1:1", "max_outstanding": "x"}',
                     b"[" * 300 + b"]" * 300, b"\xff\xfe"):
            r = http.post("/admin/workers", content=body)
            assert 400 <= r.status_code < 500, (body[:40], r.status_code, r.text)
        for body in (b'{"config": 5}', b'{"launch": {"env": {"A": 1}}}', b'{"url": 5}'):
            r = http.post("/admin/workers/latency/replace", content=body)
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        # the declared ones work: a configured worker's host
        r = http.post("/admin/workers", json={"name": "again", "url": latency.url,
                                              "config": latency.spec.config.to_dict()})
        assert r.status_code == 201, r.text
    assert not marker.exists()


def test_an_unwritable_trace_directory_is_a_start_up_error(engines: list[EngineProcess],
                                                           tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    config = external_config(engines, tmp_path, traces={"dir": str(blocker / "traces")})
    p = ProxyThread(config)
    try:
        with pytest.raises(OSError, match="traces.dir"):
            p.__enter__()
    finally:
        p.server = None  # never started
        p.stop()


def test_trace_write_failures_are_counted(engines: list[EngineProcess], tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    config = external_config(engines, tmp_path, traces={"dir": str(traces), "max_bytes": 4096})
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    with ProxyThread(config) as p, httpx.Client(base_url=p.url, timeout=30) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        assert _eventually(lambda: http.get("/stats").json()["traces"]["written"] >= 1)
        for f in traces.iterdir():
            f.unlink()
        traces.rmdir()
        traces.write_text("")  # the next file cannot be opened: every record is lost
        for _ in range(40):
            assert http.post("/v1/chat/completions", json=body).status_code == 200
        assert _eventually(lambda: http.get("/stats").json()["traces"]["failed"] >= 20)
        metrics = http.get("/metrics").text
        failed = [line for line in metrics.splitlines()
                  if line.startswith('polyinfer_trace_records_total{outcome="failed"}')]
        assert failed and float(failed[0].split()[-1]) >= 20, metrics[-2000:]


def _eventually(predicate: object, timeout_s: float = 10.0) -> bool:
    from tests.proxy.servers import eventually
    return eventually(predicate, timeout_s)


@pytest.mark.parametrize("start", [b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",
                                   b"GET /stats HTTP/1.1\r\nHost: x\r\n",
                                   b"POST /v1/completions HTTP/1.1\r\nContent-Length: 9\r\n\r\n{"])
def test_a_trickling_client_is_cut_off(engines: list[EngineProcess], tmp_path: Path,
                                       start: bytes) -> None:
    """A head (or body) trickled a byte at a time is closed at the header (body) timeout."""
    config = external_config(engines, tmp_path, limits={"header_timeout_s": 1.0,
                                                        "body_timeout_s": 1.0})
    with ProxyThread(config) as p:
        host, port = p.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(start)
            t0 = time.monotonic()
            closed_after = None
            while time.monotonic() - t0 < 8:
                try:
                    s.sendall(b"x")
                except OSError:
                    closed_after = time.monotonic() - t0
                    break
                s.settimeout(0.3)
                try:
                    if s.recv(4096) == b"":
                        closed_after = time.monotonic() - t0
                        break
                except TimeoutError:
                    pass
            assert closed_after is not None and closed_after < 5, closed_after
        with httpx.Client(base_url=p.url, timeout=30) as http:
            assert http.get("/health").status_code == 200


def test_a_trickled_body_on_aiohttps_path_gets_a_408_and_the_connection_ends(
        engines: list[EngineProcess], tmp_path: Path) -> None:
    """``server.fast_path: false``: aiohttp times no body itself; the relay answers 408
    ``request_timeout`` at ``limits.body_timeout_s`` and closes the connection, the head
    having arrived at once; a whole body on the next connection is served."""
    config = external_config(engines, tmp_path, server={"fast_path": False},
                             limits={"body_timeout_s": 1.0})
    with ProxyThread(config) as p:
        host, port = p.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 90\r\n\r\n{")
            t0, got = time.monotonic(), b""
            s.settimeout(0.3)
            while time.monotonic() - t0 < 8:
                try:
                    s.sendall(b" ")
                except OSError:
                    break
                try:
                    data = s.recv(4096)
                except TimeoutError:
                    continue
                if data == b"":
                    break
                got += data
            seconds = time.monotonic() - t0
        assert got.startswith(b"HTTP/1.1 408"), got[:200]
        assert b"request_timeout" in got and 0.8 < seconds < 5, (seconds, got[:300])
        with httpx.Client(base_url=p.url, timeout=30) as http:
            r = http.post("/v1/completions", json={"model": MODEL,
                                                 "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text


def test_infinite_timeouts_are_refused() -> None:
    from polyinfer.config import ConfigError
    from proxy.config import ProxyConfig
    for section, key in (("limits", "read_timeout_s"), ("limits", "header_timeout_s"),
                         ("limits", "connect_timeout_s"), ("health", "interval_s"),
                         ("health", "breaker_cooldown_s"), ("traces", "flush_interval_s")):
        for value in (float("inf"), float("nan")):
            with pytest.raises(ConfigError, match=f"{section}.{key}"):
                ProxyConfig.from_dict({section: {key: value}})


@pytest.mark.parametrize("text,suffix", [
    ("auth:\n  admin_key: first\n  admin_key: second\n", ".yaml"),
    ("limits: {max_in_flight: 8}\nlimits: {max_in_flight: 9}\n", ".yaml"),
    ('{"auth": {"admin_key": "a", "admin_key": "b"}}', ".json"),
])
def test_a_config_key_given_twice_is_refused(tmp_path: Path, text: str, suffix: str) -> None:
    from polyinfer.config import ConfigError
    from proxy.config import ProxyConfig
    path = tmp_path / f"polyinfer{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError, match="duplicate key"):
        ProxyConfig.load(path)
    good = tmp_path / "good.yaml"
    good.write_text("auth:\n  admin_key: only\n")
    assert ProxyConfig.load(good).auth.admin_key == "only"


def test_read_endpoints_behind_the_api_keys_when_asked(engines: list[EngineProcess],
                                                       tmp_path: Path) -> None:
    config = external_config(engines, tmp_path, auth={"api_keys": ["sk-a"], "admin_key": "adm",
                                                      "protect_reads": True})
    with ProxyThread(config) as p, httpx.Client(base_url=p.url, timeout=30) as http:
        for path in ("/stats", "/metrics", "/v1/models", f"/v1/models/{MODEL}"):
            assert http.get(path).status_code == 401, path
            assert http.get(path, headers={"Authorization": "Bearer nope"}).status_code == 401
            for key in ("sk-a", "adm"):
                r = http.get(path, headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, (path, r.text)
        assert http.get("/health").status_code == 200
    from polyinfer.config import ConfigError
    with pytest.raises(ConfigError, match="auth.protect_reads"):
        external_config(engines, tmp_path, auth={"protect_reads": True})


def test_traces_hold_ids_and_attempts_not_client_bytes(engines: list[EngineProcess],
                                                       tmp_path: Path) -> None:
    config = external_config(engines, tmp_path)
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    hostile = ["x" * 200, "id with spaces", "<script>", SECRET_PROMPT + "\u00e9"]
    with ProxyThread(config) as p, httpx.Client(base_url=p.url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json=body, headers={"x-request-id": "req-1.a:b"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "req-1.a:b"
        for rid in hostile:
            r = http.post("/v1/chat/completions", json=body,
                          headers=[(b"x-request-id", rid.encode())])
            assert r.status_code == 200 and r.headers["x-request-id"].startswith("pi-")
        r = http.post("/v1/chat/completions", json={**body, "model": "m" * 300})
        assert r.status_code == 400 and "m" * 300 not in r.text
    records = read_traces(tmp_path / "traces")
    assert len(records) == 2 + len(hostile)
    text = orjson.dumps(records).decode()
    assert SECRET_PROMPT not in text and "x" * 100 not in text and "m" * 100 not in text
    served = [r for r in records if r["status"] == "ok"]
    assert served and all(r["num_attempts"] == 1 for r in served)
    assert [r["num_attempts"] for r in records if r["status"] != "ok"] == [0]


def test_drain_cuts_streams_with_an_error_event(engines: list[EngineProcess],
                                                tmp_path: Path) -> None:
    import threading
    config = external_config(engines, tmp_path, limits={"drain_timeout_s": 1.0})
    long = {"model": MODEL, "max_tokens": 1500, "ignore_eos": True,
            "messages": [{"role": "user", "content": "count"}]}
    p = ProxyThread(config).__enter__()
    started = threading.Barrier(3)
    results: dict[str, object] = {}

    def stream() -> None:
        with httpx.Client(base_url=p.url, timeout=60) as http, \
                http.stream("POST", "/v1/chat/completions", json={**long, "stream": True}) as r:
            lines = r.iter_lines()
            results["first"] = next(lines)
            started.wait()
            results["events"] = [line for line in lines if line.startswith("data:")]

    def whole() -> None:
        with httpx.Client(base_url=p.url, timeout=60) as http:
            started.wait()
            r = http.post("/v1/completions", json={
                "model": MODEL, "max_tokens": 1500, "ignore_eos": True, "prompt": "count"})
            results["whole"] = (r.status_code, r.json())

    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    try:
        for t in threads:
            t.start()
        started.wait(60)
        time.sleep(0.3)  # the whole request is in flight
    finally:
        p.stop()
    for t in threads:
        t.join(60)
    events = results["events"]
    assert isinstance(events, list) and events, results
    last = orjson.loads(events[-1].removeprefix("data:").strip())
    assert "shutting down" in last["error"]["message"], events[-3:]
    status, body = results["whole"]  # type: ignore[misc]
    assert status == 503 and body["error"]["code"] == "shutting_down", body
    records = read_traces(tmp_path / "traces")
    cut = [r for r in records if (r["error"] or "").startswith("shutting_down: cut")]
    assert len(cut) == 2, [r["error"] for r in records]


def test_a_prompt_too_long_for_every_worker_is_refused_before_forwarding(
        proxy: ProxyThread) -> None:
    """The engines hold 2,048 tokens: 1 MB of text cannot fit (refused by its length,
    before the shape is estimated), nor ~30,000 estimated tokens; neither reaches them."""
    with httpx.Client(base_url=proxy.url, timeout=60) as http:
        for body, path in (
                ({"prompt": "hello world " * 90_000}, "/v1/completions"),
                ({"messages": [{"role": "user", "content": "word " * 30_000}]},
                 "/v1/chat/completions"),
                ({"messages": [{"role": "user", "content": [
                    {"type": "text", "text": "x" * 300_000}]}]}, "/v1/chat/completions"),
                ({"messages": [{"role": "user", "content": "hi"}] * 5_000},
                 "/v1/chat/completions"),
                ({"prompt": [1] * 5_000}, "/v1/completions")):
            t0 = time.perf_counter()
            r = http.post(path, json={"model": MODEL, "max_tokens": 1, **body})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "context_length_exceeded", r.text
            assert time.perf_counter() - t0 < 2
        r = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 1,
                                               "prompt": "hello " * 200})
        assert r.status_code == 200, r.text
    records = read_traces(Path(proxy.config.traces.dir))
    refused = [r for r in records if r["status"] != "ok"]
    assert len(refused) == 5 and all(r["num_attempts"] == 0 for r in refused), refused


def test_closing_the_trace_writer_keeps_a_batch_still_queued_for_its_thread(
        tmp_path: Path) -> None:
    """The drain test's lost records, found: the writer's periodic flush had swapped the
    cut requests' records out and queued their write for a thread, and close() cancelled
    that flush; a queued ``to_thread`` call that has not started is cancelled with it, and
    its batch was lost. Here the thread is kept busy so the write is still queued."""
    import asyncio
    import concurrent.futures

    from proxy.config import TraceConfig
    from proxy.record import RequestRecord
    from proxy.traces import TraceWriter

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=1))
        writer = TraceWriter(TraceConfig(batch_size=2, flush_interval_s=60), tmp_path)
        writer.start()
        busy = loop.run_in_executor(None, time.sleep, 0.3)  # the one thread, taken
        for i in range(2):  # a full batch: the writer's task takes it and queues its write
            writer.append(RequestRecord(request_id=f"r{i}", ts=0.0, t0=0.0,
                                        endpoint="completions"))
        await asyncio.sleep(0.05)
        assert not writer._pending  # swapped out, its write queued behind the busy thread
        await writer.close()
        await busy

    asyncio.run(main())
    assert [r["request_id"] for r in read_traces(tmp_path)] == ["r0", "r1"]
