"""``polyinfer serve --optimize``: the background optimizer as one more app lifetime.

The optimizer only reads traffic and writes configs: every finished request's
trace record is handed to :meth:`OptimizerService.observe` (cheap, never
raising), and promotions reach the proxy through the optimizer's own interfaces,
implemented in :mod:`proxy.promotion`: ``PoolConfigSink`` (a :class:`optimizer.promote.ConfigSink`)
sets the promoted config on the proxy's view of the worker, and the adaptive
router keys each worker's latency profile on that config object, so a promotion
restarts the profile from the new config's prior (a hot reload changes the
worker's speed; old measurements would mislead it). ``PoolSwitch`` (a
:class:`optimizer.promote.WorkerSwitch`) maps a worker URL to its pool name and
runs the proxy's blue-green replacement (vLLM workers, restart-only fields).
Nothing in the request path waits on it; a failing optimizer is logged and
shown in ``/stats``, and the proxy keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from proxy import keys
from proxy.config import OptimizeConfig
from proxy.pool import Worker, WorkerPool

if TYPE_CHECKING:
    from optimizer.service import OptimizerService

logger = logging.getLogger(__name__)


class OptimizeSetupError(RuntimeError):
    """``optimize`` names no engine worker the proxy has, or its settings are wrong."""


def pick_workers(pool: WorkerPool, cfg: OptimizeConfig,
                 declared: tuple[str, ...]) -> list[Worker]:
    """The workers to tune: the named one, else every engine worker, in declared order.

    NOTE: declared order (the config's), not the pool's, which holds workers in the
    order they became healthy: which worker is tuned must not depend on start-up.
    """
    if cfg.worker:
        worker = pool.workers.get(cfg.worker)
        if worker is None:
            raise OptimizeSetupError(f"optimize.worker: no worker named {cfg.worker!r}; "
                                     f"expected one of {sorted(pool.workers)}")
        return [worker]
    order = [n for n in declared if n in pool.workers] + sorted(set(pool.workers) - set(declared))
    picked = [pool.workers[n] for n in order if pool.workers[n].backend == "engine"]
    if not picked:
        raise OptimizeSetupError("optimize: needs an engine worker (backend: engine) to tune; "
                                 "name one with optimize.worker")
    return picked


def pick_worker(pool: WorkerPool, cfg: OptimizeConfig) -> Worker:
    """The first worker :func:`pick_workers` tunes."""
    return pick_workers(pool, cfg, tuple(pool.workers))[0]


def _board_for(base: Path, name: str, num_workers: int) -> str:
    """One board per tuned worker (each its own campaigns); one worker keeps the plain path."""
    return str(base if num_workers == 1 else base.with_name(f"{base.stem}-{name}{base.suffix}"))


async def optimizer_ctx(app: web.Application) -> AsyncIterator[None]:
    """Run one optimizer per tuned worker beside the proxy; cancelled and awaited on shutdown.

    Each service sees only the trace records of requests routed to its worker (the shapes
    the router sends it) and promotes only to it; blue-green keeps the worker's name.
    """
    config = app[keys.CONFIG]
    if not config.optimize.enabled:
        yield
        return
    from optimizer.errors import OptimizerError
    from optimizer.service import OptimizerService
    from optimizer.settings import build_config, load_settings
    from proxy.promotion import PoolConfigSink, PoolSwitch

    try:
        settings = load_settings(config.optimize.settings) if config.optimize.settings else {}
    except OptimizerError as e:
        raise OptimizeSetupError(str(e)) from e
    pool = app[keys.POOL]
    workers = pick_workers(pool, config.optimize, tuple(w.name for w in config.workers))
    board = Path(config.optimize.board_path)
    if not board.is_absolute():
        board = Path(config.run_dir) / board
    board.parent.mkdir(parents=True, exist_ok=True)
    tasks = []
    for worker in workers:
        try:
            opt = build_config(settings, base=worker.view.config, worker_url=worker.url,
                               worker_name=worker.name, worker_backend=worker.backend,
                               board_path=_board_for(board, worker.name, len(workers)),
                               agents=config.optimize.agents,
                               llm_url=config.optimize.llm_url or None,
                               llm_model=config.optimize.llm_model,
                               min_records=config.optimize.min_records)
        except OptimizerError as e:
            raise OptimizeSetupError(str(e)) from e
        service = OptimizerService(
            opt,
            sinks=(PoolConfigSink(pool),),
            blue_green=PoolSwitch(app[keys.BLUEGREEN], pool))
        app[keys.RELAY].on_finish.append(_observer(service, worker.name))
        app[keys.OPTIMIZER].append(service)
        logger.info("optimizer: tuning worker %s (%s), board %s", worker.name, worker.url,
                    service.config.board_path)
        task = asyncio.create_task(service.run(), name=f"optimizer-{worker.name}")
        task.add_done_callback(_log_exit)
        tasks.append(task)
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def _observer(service: OptimizerService, name: str) -> Callable[[Any], None]:
    def observe(rec: Any) -> None:
        if rec.worker == name:
            service.observe(rec.trace_record())

    return observe


def _log_exit(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("optimizer stopped: %s (the proxy keeps serving)", task.exception())
