"""HTTP handlers: the OpenAI API, health, stats, metrics, dashboard; plus the error middleware."""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from polyinfer.errors import error_body
from proxy import keys
from proxy.errors import ModelNotFound, ProxyError, Unauthorized
from proxy.exchange import REC_KEY, AiohttpExchange
from proxy.pool import WorkerPool
from proxy.relay import proxy_headers
from proxy.validate import CHAT, COMPLETIONS

logger = logging.getLogger(__name__)

# On responses that were not routed (health, stats, admin...): same headers, no values.
_NO_ROUTE_HEADERS = {"x-polyinfer-worker": "none", "x-polyinfer-domain": "none",
                     "x-polyinfer-spec-depth": "none"}
_HTTP_ERROR_TYPES = {404: "not_found", 405: "invalid_request_error",
                     413: "invalid_request_error"}


@web.middleware
async def error_middleware(
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Turn every error into an OpenAI error body; put the proxy headers on every response."""
    try:
        resp = await handler(request)
    except ProxyError as e:
        resp = e.to_response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = web.Response(status=e.status, content_type="application/json",
                            body=orjson.dumps(error_body(e.reason, _HTTP_ERROR_TYPES.get(
                                e.status, "invalid_request_error"))))
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        resp = web.Response(status=500, content_type="application/json",
                            body=orjson.dumps(error_body("internal proxy error", "internal_error")))
    if not resp.prepared:
        rec = request.get(REC_KEY)
        if rec is not None:
            resp.headers.update(proxy_headers(rec))
        elif "x-request-id" not in resp.headers:
            resp.headers.update(_NO_ROUTE_HEADERS)
            resp.headers["x-request-id"] = request.app[keys.RELAY].new_request_id()
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    ex = AiohttpExchange(request)
    await request.app[keys.RELAY].handle(ex, CHAT)
    return ex.response


async def completions(request: web.Request) -> web.StreamResponse:
    ex = AiohttpExchange(request)
    await request.app[keys.RELAY].handle(ex, COMPLETIONS)
    return ex.response


def _model_card(pool: WorkerPool, name: str, now: int) -> dict[str, object]:
    # root: the checkpoint (tokenizer included) as vLLM lists it, so that a client such as
    # loadgen counts prompt tokens in the model's own tokenizer
    return {"id": name, "object": "model", "created": now, "owned_by": "polyinfer",
            "root": pool.model_root(name), "parent": None}


def authorize_read(request: web.Request) -> None:
    """With ``auth.protect_reads``, a read endpoint wants an API key or the admin key."""
    auth = request.app[keys.CONFIG].auth
    if not auth.protect_reads:
        return
    given = request.headers.get("Authorization", "").encode()
    # NOTE: every key compared (no early exit), in constant time
    allowed = [hmac.compare_digest(given, f"Bearer {k}".encode())
               for k in (*auth.api_keys, auth.admin_key) if k]
    if not any(allowed):
        raise Unauthorized("invalid or missing API key (Authorization: Bearer <key>)")


async def models(request: web.Request) -> web.Response:
    authorize_read(request)
    now = int(time.time())
    pool = request.app[keys.POOL]
    return _json({"object": "list", "data": [_model_card(pool, m, now)
                                             for m in pool.model_names()]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}`` (the openai SDK's ``models.retrieve``)."""
    authorize_read(request)
    name = request.match_info["model"]
    pool = request.app[keys.POOL]
    if name not in pool.model_names():
        raise ModelNotFound(f"the model '{name}' does not exist; see GET /v1/models",
                            param="model")
    return _json(_model_card(pool, name, int(time.time())))


async def health(request: web.Request) -> web.Response:
    pool = request.app[keys.POOL]
    relay = request.app[keys.RELAY]
    num_routable = pool.num_routable()
    ok = num_routable > 0 and not relay.draining
    return _json({"status": "ok" if ok else "unavailable", "routable_workers": num_routable,
                  "workers": len(pool.workers), "draining": relay.draining},
                 status=200 if ok else 503)


async def stats(request: web.Request) -> web.Response:
    authorize_read(request)
    app = request.app
    relay = app[keys.RELAY]
    doc = app[keys.STATS].snapshot(app[keys.POOL], relay.policy.name)
    doc["loop_lag_ms"] = relay.loop_lag_s * 1e3
    doc["loop_busy"] = relay.loop_busy
    doc["shed_at_door"] = relay.num_shed_at_door  # 429s before a request was read (no trace)
    doc["in_flight_limit"] = relay.in_flight_limit.value  # lowered while the loop is saturated
    gate = app[keys.GATE]
    doc["connections"] = {"open": gate.num_open, "refused": gate.num_refused}
    doc["traces"] = {"written": app[keys.TRACES].num_written,
                     "dropped": app[keys.TRACES].num_dropped,
                     "failed": app[keys.TRACES].num_failed}
    services = app[keys.OPTIMIZER]
    if services:  # NOTE: "optimizer" is the first tuned worker's, "optimizers" all of them
        snapshots = [s.snapshot() for s in services]
        doc["optimizer"] = snapshots[0]
        doc["optimizers"] = {snap["worker"]: snap for snap in snapshots}
    depth_policies = relay.depth_policies()
    if depth_policies:  # the one that picks the depths
        doc["depth_policy"] = depth_policies[0].snapshot()
    return _json(doc)


async def metrics(request: web.Request) -> web.Response:
    authorize_read(request)
    body = generate_latest(request.app[keys.REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def dashboard(request: web.Request) -> web.Response:
    return web.Response(body=request.app[keys.DASHBOARD], content_type="text/html")


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS), status=status,
                        content_type="application/json")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)  # names may hold "/" (org/model)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", dashboard)
    app.router.add_get("/dashboard", dashboard)
