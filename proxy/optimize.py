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
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from proxy import keys
from proxy.config import OptimizeConfig
from proxy.pool import Worker, WorkerPool

logger = logging.getLogger(__name__)


class OptimizeSetupError(RuntimeError):
    """``optimize`` names no engine worker the proxy has."""


def pick_worker(pool: WorkerPool, cfg: OptimizeConfig) -> Worker:
    """The worker to optimize: the named one, else the first engine worker."""
    if cfg.worker:
        worker = pool.workers.get(cfg.worker)
        if worker is None:
            raise OptimizeSetupError(f"optimize.worker: no worker named {cfg.worker!r}; "
                                     f"expected one of {sorted(pool.workers)}")
        return worker
    for worker in pool.workers.values():
        if worker.backend == "engine":
            return worker
    raise OptimizeSetupError("optimize: needs an engine worker (backend: engine) to tune; "
                             "name one with optimize.worker")


async def optimizer_ctx(app: web.Application) -> AsyncIterator[None]:
    """Run the optimizer beside the proxy; stopped (cancelled and awaited) on shutdown."""
    config = app[keys.CONFIG]
    if not config.optimize.enabled:
        yield
        return
    from optimizer.service import OptimizerConfig, OptimizerService
    from proxy.promotion import PoolConfigSink, PoolSwitch

    pool = app[keys.POOL]
    worker = pick_worker(pool, config.optimize)
    board = Path(config.optimize.board_path)
    if not board.is_absolute():
        board = Path(config.run_dir) / board
    board.parent.mkdir(parents=True, exist_ok=True)
    service = OptimizerService(
        OptimizerConfig(base=worker.view.config, worker_url=worker.url,
                        worker_backend=worker.backend, board_path=str(board),
                        agents=config.optimize.agents, min_records=config.optimize.min_records),
        sinks=(PoolConfigSink(pool),),
        blue_green=PoolSwitch(app[keys.BLUEGREEN], pool))
    app[keys.RELAY].on_finish.append(lambda rec: service.observe(rec.trace_record()))
    app[keys.OPTIMIZER].append(service)
    logger.info("optimizer: tuning worker %s (%s), board %s", worker.name, worker.url, board)
    task = asyncio.create_task(service.run(), name="optimizer")
    task.add_done_callback(_log_exit)
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def _log_exit(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("optimizer stopped: %s (the proxy keeps serving)", task.exception())
