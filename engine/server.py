"""The engine's OpenAI-compatible HTTP server (aiohttp).

Routes: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming or one
JSON body), ``/v1/models``, ``/health``, ``/metrics`` (vLLM metric names),
``GET /admin/config``, ``POST /admin/reload``, ``POST /reset_prefix_cache``
(vLLM's path: empties the prefix cache, e.g. between benchmark runs). The model is loaded once at
start-up in a ``cleanup_ctx`` (off the event loop); the step loop runs in the
background for the app's lifetime.

With ``POLYINFER_ENGINE_ADMIN_KEY`` in its environment (set it through the proxy's
``launch.env``), ``POST /admin/reload`` and ``POST /reset_prefix_cache`` want that key
(``Authorization: Bearer <key>`` or ``x-admin-key``); without it they are open, as on a
loopback-only worker. A key in the environment, not on the command line, where any
local user's ``ps`` would show it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from engine.async_engine import AsyncEngine
from engine.core import RequestOutput
from engine.dp import DataParallelEngine
from engine.errors import (
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    ReloadError,
    RequestError,
)
from engine.loader import load_core
from engine.metrics import CONTENT_TYPE, EngineMetrics
from engine.protocol import ParsedRequest, RequestParser
from engine.responses import (
    Choice,
    LogprobFormatter,
    choice_body,
    chunk_body,
    completion_body,
    total_usage,
    usage_chunk,
)
from polyinfer.config import CompiledConfig, ConfigError
from polyinfer.errors import error_body
from polyinfer.heap import settle_heap
from polyinfer.http_log import server_logger

logger = logging.getLogger(__name__)
INLINE_TOKENIZE_BYTES = 16384  # larger bodies are parsed (and tokenized) off the event loop


@dataclass
class EngineState:
    """The live engine and the parser matching its current config (replaced on reload)."""

    engine: AsyncEngine | DataParallelEngine
    parser: RequestParser
    metrics: EngineMetrics
    logprobs: LogprobFormatter  # token texts of the model's tokenizer


STATE = web.AppKey("engine_state", EngineState)
CONFIG = web.AppKey("engine_config", CompiledConfig)
ADMIN_KEY = web.AppKey("engine_admin_key", str)
ADMIN_KEY_ENV = "POLYINFER_ENGINE_ADMIN_KEY"


def _admin_refused(request: web.Request) -> web.Response | None:
    """A 401 unless the request carries the engine's admin key (when it has one)."""
    key = request.app[ADMIN_KEY]
    if not key:
        return None
    given = request.headers.get("x-admin-key") or \
        request.headers.get("Authorization", "").removeprefix("Bearer ")
    if hmac.compare_digest(given.encode(), key.encode()):
        return None
    return _json(error_body("invalid or missing admin key", "authentication_error", None,
                            "invalid_api_key"), 401)


def _error(e: RequestError) -> web.Response:
    return web.json_response(e.to_body(), status=e.status, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def _check_content_type(value: str | None) -> None:
    """JSON bodies only: ``Content-Type`` absent, ``application/json`` or ``+json`` (vLLM's
    server refuses the rest with a 400 too)."""
    media = (value or "").split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not (
            media.startswith("application/") and media.endswith("+json")):
        raise InvalidRequestError(f"Content-Type must be application/json, got {media[:64]!r}")


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise InvalidRequestError(f"the request body is not valid JSON: {e}") from e


async def _parse(state: EngineState, request: web.Request, chat: bool) -> ParsedRequest:
    _check_content_type(request.headers.get("Content-Type"))
    body = await _read_json(request)
    if request.content_length is not None and request.content_length > INLINE_TOKENIZE_BYTES:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, state.parser.parse, body, chat)
    return state.parser.parse(body, chat)


def _parser(engine: AsyncEngine | DataParallelEngine, config: CompiledConfig) -> RequestParser:
    return RequestParser(config, engine.tokenizer, engine.max_model_len, engine.vocab_size)


# -- generation ---------------------------------------------------------------------------


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        parsed = await _parse(state, request, chat)
    except RequestError as e:
        return _error(e)
    if not _has_cores(state):
        return _error(EngineUnavailableError("no engine core process is running"))
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    state.metrics.count_slos(parsed.params)
    # NOTE: n samples are n requests of one prompt; with prefix caching the later ones
    # find the prompt's full blocks cached once the first has computed them
    streams = [state.engine.generate(rid if parsed.n == 1 else f"{rid}-{i}", parsed.prompt_ids,
                                     parsed.sample_params(i)) for i in range(parsed.n)]
    model = state.parser.config.model_name
    fmt = state.logprobs if parsed.params.logprobs is not None else None
    async with contextlib.AsyncExitStack() as stack:
        for s in streams:
            await stack.enter_async_context(contextlib.aclosing(s))
        # closed first (LIFO): its pumps are cancelled before the streams are closed
        merged = await stack.enter_async_context(contextlib.aclosing(_merged(streams)))
        if parsed.stream:
            return await _stream(request, merged, parsed, rid, model, fmt)
        return await _collect(merged, parsed, rid, model, fmt)


async def _merged(streams: list[AsyncIterator[RequestOutput]]
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from every stream as they come; the first error is raised."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, Exception | None]] = asyncio.Queue()

    async def pump(i: int, outputs: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in outputs:
                queue.put_nowait((i, out, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _take(choice: Choice, out: RequestOutput) -> None:
    choice.num_output = out.num_output_tokens
    choice.num_draft, choice.num_accepted = out.num_draft_tokens, out.num_accepted_tokens
    choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason


async def _collect(outputs: AsyncIterator[tuple[int, RequestOutput]], parsed: ParsedRequest,
                   rid: str, model: str, fmt: LogprobFormatter | None) -> web.Response:
    choices = [Choice(i, logprobs=[] if fmt is not None else None) for i in range(parsed.n)]
    num_prompt = num_cached = 0
    try:
        async for i, out in outputs:
            choice = choices[i]
            choice.parts.append(out.text)
            if choice.logprobs is not None and out.logprobs:
                choice.logprobs.extend(out.logprobs)
            _take(choice, out)
            num_prompt, num_cached = out.num_prompt_tokens, out.num_cached_tokens
    except RequestError as e:  # e.g. the engine-core process died (engine.dp)
        return _error(e)
    if any(c.finish_reason in (None, "abort") for c in choices):  # the engine failed it
        return _json(error_body("the engine failed while running this request",
                                "internal_error"), 500)
    use = total_usage(choices, num_prompt, num_cached)
    return _json(completion_body(rid, model, parsed.chat, [
        choice_body(parsed.chat, c, "".join(c.parts), fmt, c.logprobs) for c in choices], use))


async def _stream(request: web.Request, outputs: AsyncIterator[tuple[int, RequestOutput]],
                  parsed: ParsedRequest, rid: str, model: str,
                  fmt: LogprobFormatter | None) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    created = int(time.time())
    chat = parsed.chat
    choices = [Choice(i) for i in range(parsed.n)]
    num_prompt = num_cached = 0
    try:
        if chat:
            await _send(resp, chunk_body(rid, model, chat, created, [
                choice_body(chat, c, "", None, None, delta=True, role=True, final=False)
                for c in choices]))
        async for i, out in outputs:
            choice = choices[i]
            _take(choice, out)
            num_prompt, num_cached = out.num_prompt_tokens, out.num_cached_tokens
            lps = out.logprobs if fmt is not None and out.logprobs else None
            if out.finished or out.text or lps:
                await _send(resp, chunk_body(rid, model, chat, created, [choice_body(
                    chat, choice, out.text, fmt, lps, delta=True, final=out.finished)]))
            if lps is not None and fmt is not None:
                choice.text_offset += sum(len(fmt.text(lp.token_id)) for lp in lps)
        if parsed.include_usage:
            await _send(resp, usage_chunk(rid, model, chat, created,
                                          total_usage(choices, num_prompt, num_cached)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except RequestError as e:  # after the headers: the error goes out as the last event
        await _send(resp, e.to_body())
        await resp.write_eof()
    except ConnectionError:  # the client went away: aclosing() aborts the request
        logger.debug("client disconnected from %s", rid)
    return resp


async def _send(resp: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")


# -- the rest of the API ------------------------------------------------------------------


async def handle_models(request: web.Request) -> web.Response:
    config = request.app[STATE].parser.config
    card = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "polyinfer",
            "root": config.model, "max_model_len": request.app[STATE].parser.max_model_len}
    return _json({"object": "list", "data": [card]})


def _has_cores(state: EngineState) -> bool:
    return not isinstance(state.engine, DataParallelEngine) or bool(state.engine.pids)


async def handle_health(request: web.Request) -> web.Response:
    if not _has_cores(request.app[STATE]):
        return web.Response(text="no engine core process is running", status=503)
    return web.Response(text="")


async def handle_metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.expose()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def handle_get_config(request: web.Request) -> web.Response:
    return _json(request.app[STATE].engine.config.to_dict())


async def handle_reload(request: web.Request) -> web.Response:
    if (refused := _admin_refused(request)) is not None:
        return refused
    state = request.app[STATE]
    try:
        body = await _read_json(request)
        config = CompiledConfig.from_dict(body)
        if config.backend != "engine":
            raise ReloadError(f"backend must be 'engine', got {config.backend!r}")
        # NOTE: shielded, so a client that disconnects mid-reload (the handler is cancelled)
        # cannot leave the engine on the new config and the parser on the old one
        seconds = await asyncio.shield(_reload(state, config))
    except RequestError as e:
        return _error(e)
    except (ConfigError, EngineError) as e:
        return _error(InvalidRequestError(str(e), code="invalid_config"))
    body = {"status": "ok", "reload_s": seconds, "config": config.to_dict()}
    if isinstance(state.engine, DataParallelEngine):
        body["reload_s_per_core"] = state.engine.last_reload_s
    return _json(body)


async def _reload(state: EngineState, config: CompiledConfig) -> float:
    """Apply ``config`` to the engine, then parse new requests under it."""
    seconds = await state.engine.reload(config)
    state.parser = _parser(state.engine, config)
    logger.info("reloaded config in %.3f s", seconds)
    return seconds


async def handle_reset_prefix_cache(request: web.Request) -> web.Response:
    if (refused := _admin_refused(request)) is not None:
        return refused
    try:
        num_blocks = await request.app[STATE].engine.reset_prefix_cache()
    except RequestError as e:
        return _error(e)
    return _json({"status": "ok", "num_blocks_dropped": num_blocks})


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    loop = asyncio.get_running_loop()
    metrics = EngineMetrics(config.model_name)
    engine: AsyncEngine | DataParallelEngine
    if config.engine.data_parallel_size >= 1:
        engine = await loop.run_in_executor(None, DataParallelEngine, config, metrics)
    else:
        engine = AsyncEngine(await loop.run_in_executor(None, load_core, config), metrics)
    await engine.start()
    app[STATE] = EngineState(engine, _parser(engine, config), metrics,
                             LogprobFormatter(engine.tokenizer))
    yield
    await engine.stop()


def create_app(config: CompiledConfig, admin_key: str | None = None) -> web.Application:
    """The engine's app; ``admin_key`` None = from ``POLYINFER_ENGINE_ADMIN_KEY``."""
    app = web.Application(client_max_size=32 * 2**20)
    app[CONFIG] = config
    app[ADMIN_KEY] = os.environ.get(ADMIN_KEY_ENV, "") if admin_key is None else admin_key
    app.cleanup_ctx.append(_engine_ctx)
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/admin/config", handle_get_config)
    app.router.add_post("/admin/reload", handle_reload)
    app.router.add_post("/reset_prefix_cache", handle_reset_prefix_cache)
    return app


async def serve(config: CompiledConfig, host: str, port: int) -> None:
    """Run until cancelled or SIGTERM; handlers are cancelled when their client disconnects."""
    runner = web.AppRunner(create_app(config), handler_cancellation=True, access_log=None,
                           logger=server_logger())  # no client bytes in the log
    await runner.setup()  # builds the engine (_engine_ctx)
    settle_heap()
    site = web.TCPSite(runner, host, port)
    await site.start()
    logger.info("engine serving %s on http://%s:%d", config.model_name, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not main thread
        loop.add_signal_handler(signal.SIGTERM, stop.set)  # SIGTERM: stop the engine cleanly
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
