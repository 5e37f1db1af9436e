"""The dashboard: its page and scripts, ``GET /stats/history``, and the sampler that feeds it.

::

    GET /  and  /dashboard       the page (proxy/static/dashboard.html, by proxy.handlers)
    GET /dashboard/{name}.js     its scripts (proxy/static/*.js), read once at start-up
    GET /stats/history?window=300[&step=2]
                                 the last ``window`` seconds (<= 3600) of
                                 proxy.history, the routing matrix over them, and the
                                 optimizer's activity (proxy.timeline), JSON

With ``auth.api_keys`` set, ``/stats/history`` wants one of them (or the admin key)
as ``Authorization: Bearer <key>``; the page asks for it once and keeps it in the
tab's sessionStorage (or takes it from ``?key=``). The page and its scripts hold no
data and stay open.

The sampler is an app lifetime: once a second it closes the history's second with
what the pool's scrapes and the proxy's own counters say now (outstanding, running,
waiting per worker; acceptance counters; the adaptive router's prediction error), and
samples the optimizer's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path

import orjson
from aiohttp import web

from proxy import keys
from proxy.config import ProxyConfig
from proxy.errors import InvalidRequest, Unauthorized
from proxy.history import MAX_WINDOW_S, Sample
from proxy.stats import worker_doc
from proxy.timeline import OptimizerTimeline
from router.confidence import PredictionErrors

logger = logging.getLogger(__name__)

SCRIPTS = ("charts.js", "dashboard.js")
TICK_S = 1.0
_SCRIPTS_KEY = web.AppKey("dashboard_scripts", dict)  # name -> bytes


def optimizer_board(config: ProxyConfig) -> Path | None:
    """The optimizer's board file, as :func:`proxy.optimize.optimizer_ctx` places it; None
    when the optimizer is off."""
    if not config.optimize.enabled:
        return None
    board = Path(config.optimize.board_path)
    return board if board.is_absolute() else Path(config.run_dir) / board


def add_routes(app: web.Application) -> None:
    static = resources.files("proxy").joinpath("static")
    app[_SCRIPTS_KEY] = {name: static.joinpath(name).read_bytes() for name in SCRIPTS}
    app[keys.TIMELINE] = OptimizerTimeline(optimizer_board(app[keys.CONFIG]))
    app.router.add_get("/stats/history", history)
    app.router.add_get("/dashboard/{name}", script)


async def script(request: web.Request) -> web.Response:
    body = request.app[_SCRIPTS_KEY].get(request.match_info["name"])
    if body is None:
        raise web.HTTPNotFound()
    return web.Response(body=body, content_type="text/javascript",
                        headers={"Cache-Control": "no-cache"})


def authorize_read(request: web.Request) -> None:
    """With ``auth.api_keys`` set, the request must carry one of them or the admin key."""
    auth = request.app[keys.CONFIG].auth
    if not auth.api_keys:
        return
    given = request.headers.get("Authorization", "")
    allowed = {f"Bearer {k}" for k in (*auth.api_keys, auth.admin_key) if k}
    if given not in allowed:
        raise Unauthorized("invalid or missing API key (Authorization: Bearer <key>)")


async def history(request: web.Request) -> web.Response:
    authorize_read(request)
    window_s = _number(request, "window", 300.0)
    step_s = _number(request, "step", 0.0) or None
    if not 0 < window_s <= MAX_WINDOW_S:
        raise InvalidRequest(f"window: expected 0 < seconds <= {MAX_WINDOW_S:.0f}",
                             param="window")
    app = request.app
    stats = app[keys.STATS]
    while not stats.history.prepare(window_s, step_s):
        await asyncio.sleep(0)  # NOTE: a first build in slices, not one long stall of the loop
    doc = stats.history.window(window_s, step_s)
    doc["optimizer"] = await app[keys.TIMELINE].doc(doc["t"], doc["step_s"], doc["end_s"])
    relay = app[keys.RELAY]
    doc["now"] = {"policy": relay.policy.name, "in_flight": stats.in_flight,
                  "requests_total": sum(stats.requests.values()),
                  "workers": [worker_doc(w) for w in app[keys.POOL].workers.values()]}
    return web.Response(body=orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS),
                        content_type="application/json", headers={"Cache-Control": "no-store"})


def _number(request: web.Request, name: str, default: float) -> float:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError as e:
        raise InvalidRequest(f"{name}: expected a number of seconds, got {raw[:40]!r}",
                             param=name) from e


# -- the sampler ---------------------------------------------------------------------


def sample(app: web.Application) -> Sample:
    """What the workers' latest scrapes, the proxy's counters and the router say now."""
    gauges: dict[tuple[str, str], float] = {}
    for name, worker in app[keys.POOL].workers.items():
        view = worker.view
        gauges[("outstanding", name)] = view.outstanding_requests
        gauges[("running", name)] = view.running
        gauges[("waiting", name)] = view.waiting
    return Sample(gauges=gauges, spec_tokens=app[keys.STATS].spec_tokens,
                  prediction_error=prediction_error(app[keys.RELAY].policy))


def prediction_error(policy: object) -> dict[str, float]:
    """The policy's fleet-wide RMS log error of TTFT, TPOT and end-to-end time, predicted
    against observed (the adaptive policy's :class:`router.confidence.PredictionErrors`);
    only the latencies it has outcomes for."""
    errors = getattr(policy, "errors", None)
    if not isinstance(errors, PredictionErrors):
        return {}
    summary = errors.summary()
    out = {}
    if summary["num_ttft"]:
        out["ttft"] = summary["ttft_rms_log"]
    if summary["num_tpot"]:
        out["tpot"] = summary["tpot_rms_log"]
        out["e2e"] = summary["e2e_rms_log"]
    return out


async def sampler_ctx(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(_sample_loop(app), name="dashboard-sampler")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _sample_loop(app: web.Application) -> None:
    history, timeline = app[keys.STATS].history, app[keys.TIMELINE]
    history.begin()
    while True:
        # NOTE: on the second boundary, so slots line up with the clock the page shows
        await asyncio.sleep(TICK_S - time.time() % TICK_S)
        try:
            history.tick(sample(app))
            for service in app[keys.OPTIMIZER]:
                timeline.observe(time.time(), service.snapshot())
        except Exception:  # NOTE: the dashboard must never take the proxy down
            logger.exception("dashboard sampler failed")
