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
