"""The app factory: builds every long-lived object once and files it under a typed key.

Lifetimes are ``cleanup_ctx`` generators, started in order and stopped in
reverse: the trace writer (last to stop, so it flushes every record), the
upstream client, the thread that serves large bodies' CPU work (proxy.offload), then the
worker pool (supervised workers started and
waited for; probe and scrape loops), the loop-lag probe, with
``optimize.enabled`` the background optimizer, and the dashboard's once-a-second
sampler (first to stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path

from aiohttp import web

from proxy import admin, dashboard, handlers, keys
from proxy.bluegreen import BlueGreen
from proxy.config import ProxyConfig
from proxy.connections import ConnectionGate
from proxy.metrics import DoorCollector, make_registry
from proxy.offload import CpuLane
from proxy.optimize import optimizer_ctx
from proxy.pool import WorkerPool
from proxy.relay import Relay
from proxy.routing import build_policy
from proxy.shape import HeuristicShapeEstimator, ShapeEstimator
from proxy.stats import Stats
from proxy.step_times import StepTimeFeeds
from proxy.traces import TraceCollector, TraceWriter
from proxy.upstream import UpstreamClient
from proxy.vllm_acceptance import ScrapedAcceptance
from router.base import RoutingPolicy
from specdec.policy import DepthPolicy, PolicyConfig

logger = logging.getLogger(__name__)


def create_app(config: ProxyConfig, *, estimator: ShapeEstimator | None = None,
               policy: RoutingPolicy | None = None) -> web.Application:
    """A proxy app for ``config``; ``estimator`` and ``policy`` override the configured ones."""
    app = web.Application(client_max_size=config.limits.max_body_bytes,
                          middlewares=[handlers.error_middleware])
    stats = Stats()
    pool = WorkerPool(config.health, Path(config.run_dir))
    relay = Relay(config, pool, stats, estimator or default_estimator(config),
                  policy or build_policy(config.routing.policy, config.routing.seed,
                                         config.speculation.max_depth),
                  DepthPolicy(PolicyConfig(max_depth=config.speculation.max_depth)))
    app[keys.CONFIG] = config
    app[keys.STATS] = stats
    app[keys.POOL] = pool
    app[keys.RELAY] = relay
    app[keys.TRACES] = TraceWriter(config.traces, Path(config.traces.dir))
    app[keys.GATE] = ConnectionGate(config.limits.max_connections, config.limits.retry_after_s)
    app[keys.REGISTRY] = make_registry(stats, pool, lambda: relay.policy.name)
    app[keys.REGISTRY].register(TraceCollector(app[keys.TRACES]))
    app[keys.REGISTRY].register(DoorCollector(app[keys.GATE],
                                              lambda: relay.in_flight_limit.value))
    app[keys.DASHBOARD] = resources.files("proxy").joinpath("static/dashboard.html").read_bytes()
    app[keys.BLUEGREEN] = BlueGreen(pool, stall_timeout_s=config.limits.read_timeout_s)
    app[keys.OPTIMIZER] = []
    acceptance = ScrapedAcceptance(stats, relay.depth_policy)  # vLLM: scraped spec counters
    pool.on_scrape.append(acceptance.on_scrape)
    pool.on_scrape.append(StepTimeFeeds(relay).on_scrape)  # engine: per-step timings
    relay.on_finish.append(acceptance.on_finish)
    app.cleanup_ctx.extend([_traces_ctx, _client_ctx, _offload_ctx, _pool_ctx, _lag_ctx,
                            optimizer_ctx, dashboard.sampler_ctx])
    handlers.add_routes(app)
    admin.add_routes(app)
    dashboard.add_routes(app)
    return app


def default_estimator(config: ProxyConfig) -> ShapeEstimator:
    """The router's classifier with the first local model's tokenizer, else the heuristic.

    Blocking (reads the tokenizer and classifier files): start-up only.
    """
    if config.routing.shape_estimator == "heuristic":
        return HeuristicShapeEstimator()
    tokenizer_dir = next((w.config.model for w in config.workers
                          if (Path(w.config.model) / "tokenizer.json").is_file()), None)
    try:
        from router.shape import ShapeConfig
        from router.shape import ShapeEstimator as ClassifierShapeEstimator
        from router.tokens import TokenConfig
        # the engine workers' context limits: counted exactly near them
        limits = {w.config.engine.usable_model_len for w in config.workers
                  if w.config.backend == "engine"}
        shape_config = ShapeConfig(
            tokens=TokenConfig(block_chars=config.routing.prefix_block_chars),
            slo_ttft_s=config.routing.slo_by_domain("slo_ttft_s"),
            slo_tpot_s=config.routing.slo_by_domain("slo_tpot_s"),
            exact_edges_tokens=tuple(sorted(limits)))
        return ClassifierShapeEstimator.load(tokenizer_dir, config=shape_config)
    except Exception as e:  # a broken artefact must not stop the proxy from serving
        logger.warning("router shape estimator unavailable (%s); using the heuristic one", e)
        return HeuristicShapeEstimator()


async def _traces_ctx(app: web.Application) -> AsyncIterator[None]:
    writer = app[keys.TRACES]
    if app[keys.CONFIG].traces.enabled:
        writer.check_writable()  # every record would be lost: a start-up error
        app[keys.RELAY].traces = writer
        writer.start()
    yield
    await writer.close()


async def _client_ctx(app: web.Application) -> AsyncIterator[None]:
    limits = app[keys.CONFIG].limits
    # NOTE: no cap on connections per worker; the proxy's own max_in_flight bounds load.
    client = UpstreamClient(limits.connect_timeout_s, limits.read_timeout_s)
    app[keys.RELAY].client = client
    yield
    client.close()


async def _offload_ctx(app: web.Application) -> AsyncIterator[None]:
    relay = app[keys.RELAY]
    if not app[keys.CONFIG].limits.offload_body_bytes:
        yield  # every body on the loop
        return
    relay.offload = CpuLane()
    yield
    relay.offload.close()
    relay.offload = None


async def _lag_ctx(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[keys.RELAY].measure_loop_lag(), name="loop-lag")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _pool_ctx(app: web.Application) -> AsyncIterator[None]:
    pool = app[keys.POOL]
    specs = app[keys.CONFIG].workers
    results = await asyncio.gather(*(pool.add(s) for s in specs), return_exceptions=True)
    failed = [(s.name, r) for s, r in zip(specs, results, strict=True)
              if isinstance(r, BaseException)]
    if failed:
        await pool.close()
        raise RuntimeError("; ".join(f"worker {n}: {e}" for n, e in failed))
    loops = asyncio.create_task(pool.run_loops(), name="pool-loops")
    yield
    loops.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await loops
    await app[keys.BLUEGREEN].close()
    await pool.close()
