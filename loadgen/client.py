"""The streaming HTTP client: sends one prepared request and measures it.

Definitions follow vLLM's ``bench serve`` (``backend_request_func``):

- ``ttft_s``: from just before the request is sent to the first chunk that
  carries generated text;
- ``itl_s``: gaps between successive text-bearing chunks (one gap per chunk,
  not per token: tokens that arrive in one chunk arrived together);
- ``e2e_s``: from send to the last text-bearing chunk;
- ``tpot_s = (e2e_s - ttft_s) / (completion_tokens - 1)``, only when more
  than one token came back;
- a stream that ends without ``data: [DONE]`` is an error (a cut stream);
- ``completion_tokens`` from the final ``usage`` (``stream_options.include_usage``),
  falling back to the number of text-bearing chunks when a server sends none.

NOTE: one deliberate difference from ``bench serve``, which times every chunk
that has ``choices``: a chunk with no text (a chat chunk that carries only the
role, a final chunk with only ``finish_reason``) is not a token here. A server
that sends the role chunk before prefill would otherwise report a TTFT of zero. Non-streaming requests have no TTFT/TPOT, only ``e2e_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import orjson

from loadgen.config import ClientConfig
from loadgen.request import PreparedRequest, RequestResult
from polyinfer.errors import error_codes, error_field

logger = logging.getLogger(__name__)

ERROR_BODY_CHARS = 300
ERROR_FIELD_CHARS = 60  # of an error's type or code, kept without record_error_bodies
ERROR_READ_BYTES = 1 << 16  # of an error body, read to parse it


def describe_error(error: object, raw: bytes, record: bool) -> str:
    """What a result keeps of a server's error: its text with ``record`` (up to
    ``ERROR_BODY_CHARS``), else its OpenAI ``type`` and ``code`` -- a server's message can
    quote the prompt, and no prompt text is written unless the operator asks for it.
    ``error``: the parsed ``error`` field, or None; ``raw``: the bytes it came in."""
    if record:
        return raw[:ERROR_BODY_CHARS].decode("utf-8", "replace")
    return " ".join(f"{k}={str(v)[:ERROR_FIELD_CHARS]}" for k, v in error_codes(error).items()) \
        or f"({len(raw)} bytes, not kept)"


async def _read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """The body, or its first ``cap`` bytes (an error body is read whole to parse it)."""
    buf = b""
    while len(buf) < cap:
        chunk = await resp.content.read(cap - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def make_session(cfg: ClientConfig) -> aiohttp.ClientSession:
    """A session with no connection-pool cap (the arrival process decides concurrency).

    aiohttp sets TCP_NODELAY on every connection it opens (``BaseProtocol``);
    tests/loadgen check it, because one small-write stall of 40 ms would swamp
    the latencies measured here.
    """
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300)
    headers = dict(cfg.headers)
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    headers["Content-Type"] = "application/json"
    return aiohttp.ClientSession(
        base_url=cfg.base_url, connector=connector, headers=headers,
        timeout=aiohttp.ClientTimeout(total=cfg.timeout_s), auto_decompress=False)


# NOTE: a response is input from outside: every field is type-checked, so that a
# server sending the wrong shapes fails that request, never the whole run.


def _chunk_text(event: dict[str, Any]) -> str | None:
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    text = choice.get("text")
    if text is None:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text = delta.get("content") or delta.get("reasoning_content")
    return text if isinstance(text, str) and text else None


def _token_count(value: object) -> int | None:
    """A usage count as sent, or None when it is not a non-negative integer."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


class StreamParser:
    """Incremental SSE parser: feed network reads, it timestamps text-bearing events."""

    __slots__ = ("_buf", "first_s", "last_s", "itl_s", "num_chunks", "usage", "error", "done",
                 "record_error_bodies")

    def __init__(self, record_error_bodies: bool = False) -> None:
        self.record_error_bodies = record_error_bodies
        self._buf = b""
        self.first_s: float | None = None  # perf_counter of the first text-bearing chunk
        self.last_s: float | None = None
        self.itl_s: list[float] = []
        self.num_chunks = 0  # text-bearing chunks
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False

    def feed(self, data: bytes, now: float) -> None:
        lines = (self._buf + data).split(b"\n")
        self._buf = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                self._event(line[5:].strip(), now)

    def close(self, now: float) -> None:
        if self._buf.startswith(b"data:"):
            self._event(self._buf[5:].strip(), now)
        self._buf = b""

    def _event(self, payload: bytes, now: float) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            shown = repr(payload[:80]) if self.record_error_bodies else f"{len(payload)} bytes"
            self.error = f"unparseable stream event: {shown}"
            return
        if not isinstance(event, dict):
            return
        if event.get("error"):
            self.error = "stream error: " + describe_error(event["error"], payload,
                                                           self.record_error_bodies)
        if isinstance(event.get("usage"), dict) and event["usage"]:
            self.usage = event["usage"]
        if _chunk_text(event) is None:
            return
        if self.first_s is None:
            self.first_s = now
        else:
            self.itl_s.append(now - self.last_s)  # type: ignore[operator]
        self.last_s = now
        self.num_chunks += 1


class StreamingClient:
    """Sends prepared requests on one session and fills in their :class:`RequestResult`."""

    def __init__(self, cfg: ClientConfig, session: aiohttp.ClientSession) -> None:
        self.cfg = cfg
        self.session = session

    async def send(self, req: PreparedRequest, result: RequestResult) -> None:
        """Send ``req`` now; never raises (failures land in ``result.error``)."""
        start = time.perf_counter()
        try:
            async with self.session.post(req.path, data=req.body) as resp:
                self._headers(resp, result)
                if resp.status != 200:
                    body = await _read_capped(resp, ERROR_READ_BYTES)
                    result.error = f"HTTP {resp.status}: " + describe_error(
                        error_field(body), body, self.cfg.record_error_bodies)
                    result.e2e_s = time.perf_counter() - start
                    return
                if self.cfg.stream:
                    await self._read_stream(resp, start, result)
                else:
                    await self._read_whole(resp, start, result)
        except asyncio.CancelledError:
            result.error = "cancelled"
            raise
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            result.error = f"{type(e).__name__}: {e}"[:ERROR_BODY_CHARS]
            result.e2e_s = time.perf_counter() - start
        except Exception as e:  # NOTE: one bad response must not end the run
            logger.exception("request %d (trace line %d) failed in the client", req.index,
                             req.line)
            result.ok = False
            result.error = f"client error: {type(e).__name__}: {e}"[:ERROR_BODY_CHARS]
            result.e2e_s = time.perf_counter() - start

    @staticmethod
    def _headers(resp: aiohttp.ClientResponse, result: RequestResult) -> None:
        result.http_status = resp.status
        headers = resp.headers
        result.worker = headers.get("x-polyinfer-worker")
        result.domain = headers.get("x-polyinfer-domain") or result.domain
        result.spec_depth = headers.get("x-polyinfer-spec-depth")
        result.request_id = headers.get("x-request-id")

    async def _read_stream(self, resp: aiohttp.ClientResponse, start: float,
                           result: RequestResult) -> None:
        parser = StreamParser(self.cfg.record_error_bodies)
        async for data in resp.content.iter_any():
            parser.feed(data, time.perf_counter())
        parser.close(time.perf_counter())
        if parser.first_s is None or parser.last_s is None:
            result.e2e_s = time.perf_counter() - start
            result.error = parser.error or "stream carried no tokens"
            return
        result.ttft_s = parser.first_s - start
        result.e2e_s = parser.last_s - start
        result.itl_s = parser.itl_s
        self._usage(result, parser.usage, parser.num_chunks)
        tokens = result.completion_tokens or 0
        if tokens > 1:
            result.tpot_s = (result.e2e_s - result.ttft_s) / (tokens - 1)
        result.error = parser.error or (None if parser.done else "stream ended before [DONE]")
        result.ok = result.error is None

    async def _read_whole(self, resp: aiohttp.ClientResponse, start: float,
                          result: RequestResult) -> None:
        raw = await resp.read()
        result.e2e_s = time.perf_counter() - start
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            shown = repr(raw[:80]) if self.cfg.record_error_bodies else f"{len(raw)} bytes"
            result.error = f"unparseable response body: {shown}"
            return
        self._usage(result, body.get("usage") if isinstance(body, dict) else None, 0)
        result.ok = bool(result.completion_tokens)
        if not result.ok:
            result.error = "response carried no tokens"

    @staticmethod
    def _usage(result: RequestResult, usage: object, num_chunks: int) -> None:
        if isinstance(usage, dict):
            result.prompt_tokens = _token_count(usage.get("prompt_tokens"))
            result.completion_tokens = _token_count(usage.get("completion_tokens"))
        if not result.completion_tokens and num_chunks:
            result.completion_tokens = num_chunks  # NOTE: a server that sends no usage
