"""Admin API, behind ``auth.admin_key`` (``Authorization: Bearer <key>`` or ``x-admin-key``).

    GET    /admin/workers                 list workers and their state
    POST   /admin/workers                 add one (a WorkerSpec as JSON; launch or url)
    POST   /admin/workers/{name}/drain    stop sending it new requests
    POST   /admin/workers/{name}/undrain  send it requests again
    DELETE /admin/workers/{name}          drain, wait for in-flight, remove (stop if supervised)
    POST   /admin/workers/{name}/replace  blue-green: start a candidate with a new config, shift
                                          traffic, drain and stop the old (proxy.bluegreen)
    GET    /admin/policy                  the routing policy in use
    PUT    /admin/policy                  {"policy": "least_outstanding"} switch at run time

With no admin key configured every admin endpoint answers 403. What a request may ask
for is what the config's ``admin`` section declares (:class:`proxy.config.AdminConfig`):
worker hosts, launch environment variables, extra arguments; beyond it, 403. Every error
is an OpenAI error body with a 4xx status (502 when a replacement's worker fails).
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

import orjson
from aiohttp import web

from polyinfer.config import CompiledConfig, ConfigError, build_dataclass
from proxy import keys
from proxy.bluegreen import ReplacementBusy, ReplacementError, ReplaceRequest
from proxy.config import LaunchSpec, WorkerSpec
from proxy.errors import Conflict, Forbidden, InvalidRequest, NotFound, Unauthorized, UpstreamError
from proxy.routing import POLICIES, build_policy
from proxy.stats import worker_doc
from proxy.supervisor import WorkerStartError
from proxy.validate import parse_body


def _authorize(request: web.Request) -> None:
    admin_key = request.app[keys.CONFIG].auth.admin_key
    if not admin_key:
        raise Forbidden("admin API disabled: set auth.admin_key")
    given = request.headers.get("x-admin-key") or \
        request.headers.get("Authorization", "").removeprefix("Bearer ")
    if not hmac.compare_digest(given.encode(), admin_key.encode()):
        raise Unauthorized("invalid admin key")


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _check_reach(request: web.Request, url: str, launch: LaunchSpec | None,
                 config: CompiledConfig | None) -> None:
    """Refuse (403) what the operator did not declare an admin request may ask for
    (``admin`` in the config): a worker URL on another host, launch environment variables
    beyond ``admin.launch_env``, extra command-line arguments."""
    proxy_config = request.app[keys.CONFIG]
    admin = proxy_config.admin
    if url:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequest(f"url: expected http(s)://host[:port], got {url[:80]!r}",
                                 param="url")
        host = parts.hostname.lower()
        if host not in proxy_config.admin_worker_hosts():
            raise Forbidden(f"worker host {host!r} is not in admin.worker_hosts", param="url")
    if launch is not None:
        refused = sorted(set(launch.env) - set(admin.launch_env))
        if refused:
            raise Forbidden(f"launch.env may set only admin.launch_env "
                            f"{sorted(admin.launch_env)}, not {refused}", param="launch.env")
        if launch.args and not admin.launch_args:
            raise Forbidden("launch.args needs admin.launch_args: true", param="launch.args")
    if config is not None and config.vllm.args and not admin.launch_args:
        raise Forbidden("vllm.args needs admin.launch_args: true", param="config.vllm.args")


def _worker(request: web.Request) -> str:
    name = request.match_info["name"]
    if name not in request.app[keys.POOL].workers:
        raise NotFound(f"no worker named {name!r}", param="name")
    return name


async def list_workers(request: web.Request) -> web.Response:
    _authorize(request)
    return _json({"workers": [worker_doc(w) for w in request.app[keys.POOL].workers.values()]})


async def add_worker(request: web.Request) -> web.Response:
    _authorize(request)
    body = parse_body(await request.read())
    try:
        spec = build_dataclass(WorkerSpec, body, "worker")
    except ConfigError as e:
        raise InvalidRequest(str(e)) from e
    _check_reach(request, spec.url, spec.launch, spec.config)
    try:
        worker = await request.app[keys.POOL].add(spec)
    except (ConfigError, WorkerStartError, OSError) as e:
        raise InvalidRequest(f"worker {spec.name!r} not added: {e}") from e
    return _json(worker_doc(worker), status=201)


async def drain_worker(request: web.Request) -> web.Response:
    _authorize(request)
    worker = request.app[keys.POOL].drain(_worker(request))
    return _json(worker_doc(worker))


async def undrain_worker(request: web.Request) -> web.Response:
    _authorize(request)
    worker = request.app[keys.POOL].workers[_worker(request)]
    worker.view.draining = False
    return _json(worker_doc(worker))


async def remove_worker(request: web.Request) -> web.Response:
    _authorize(request)
    name = _worker(request)
    await request.app[keys.POOL].remove(name, request.app[keys.CONFIG].limits.drain_timeout_s)
    return _json({"removed": name})


async def replace_worker(request: web.Request) -> web.Response:
    """Blue-green replacement; answers when the old worker is stopped, with the timings."""
    _authorize(request)
    name = _worker(request)
    try:
        replace = build_dataclass(ReplaceRequest, parse_body(await request.read()), "replace")
    except ConfigError as e:
        raise InvalidRequest(str(e)) from e
    _check_reach(request, replace.url, replace.launch, replace.config)
    try:
        report = await request.app[keys.BLUEGREEN].replace(name, replace)
    except ReplacementBusy as e:
        raise Conflict(str(e)) from e
    except ReplacementError as e:
        raise UpstreamError(str(e)) from e
    except ConfigError as e:
        raise InvalidRequest(str(e)) from e
    return _json(report.to_dict())


async def get_policy(request: web.Request) -> web.Response:
    _authorize(request)
    return _json({"policy": request.app[keys.RELAY].policy.name})


async def set_policy(request: web.Request) -> web.Response:
    _authorize(request)
    body = parse_body(await request.read())
    name = body.get("policy")
    # NOTE: registered names only: "module:Class" would import any module (os:abort)
    if not isinstance(name, str) or name not in POLICIES:
        raise InvalidRequest(f"'policy' must be one of {sorted(POLICIES)}", param="policy")
    seed = body.get("seed", request.app[keys.CONFIG].routing.seed)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise InvalidRequest("'seed' must be an integer", param="seed")
    try:
        policy = build_policy(name, seed, request.app[keys.CONFIG].speculation.max_depth)
    except ConfigError as e:
        raise InvalidRequest(str(e), param="policy") from e
    relay = request.app[keys.RELAY]
    previous, relay.policy = relay.policy.name, policy
    return _json({"policy": policy.name, "previous": previous})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/workers", list_workers)
    app.router.add_post("/admin/workers", add_worker)
    app.router.add_post("/admin/workers/{name}/drain", drain_worker)
    app.router.add_post("/admin/workers/{name}/undrain", undrain_worker)
    app.router.add_delete("/admin/workers/{name}", remove_worker)
    app.router.add_post("/admin/workers/{name}/replace", replace_worker)
    app.router.add_get("/admin/policy", get_policy)
    app.router.add_put("/admin/policy", set_policy)
