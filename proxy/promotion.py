"""The proxy's implementations of the optimizer's interfaces (``polyinfer serve --optimize``).

The optimizer acts on the fleet only through the interfaces it defines in
:mod:`optimizer.promote`; :mod:`proxy.optimize` hands it these::

    sinks = (PoolConfigSink(pool),)           # a ConfigSink: router profiles follow promotions
    blue_green = PoolSwitch(bg, pool)         # a WorkerSwitch: blue-green replacement
    service = OptimizerService(config, sinks=sinks, blue_green=blue_green)

Imported only when the optimizer runs, so a plain proxy never loads it.
"""

from __future__ import annotations

import logging

from optimizer.errors import PromotionError
from optimizer.promote import Switched
from polyinfer.config import CompiledConfig
from proxy.bluegreen import BlueGreen, ReplacementError, ReplaceRequest
from proxy.pool import WorkerPool

logger = logging.getLogger(__name__)


def _name_for(pool: WorkerPool, worker_url: str) -> str:
    url = worker_url.rstrip("/")
    for name, worker in pool.workers.items():
        if worker.url.rstrip("/") == url:
            return name
    raise PromotionError(f"no worker of the proxy has the URL {worker_url}")


class PoolConfigSink:
    """The optimizer's config sink: promoted configs land on the pool's worker views."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def config_promoted(self, worker_url: str, config: CompiledConfig,
                        tokens_per_s: float) -> None:
        try:
            worker = self.pool.workers[_name_for(self.pool, worker_url)]
        except PromotionError:
            logger.warning("promoted config for %s, which the proxy does not know", worker_url)
            return
        worker.view.config = config
        logger.info("worker %s now runs the promoted config (%.1f tok/s measured)", worker.name,
                    tokens_per_s)


class PoolSwitch:
    """The optimizer's worker switch: the proxy's blue-green replacement of a pool worker."""

    def __init__(self, blue_green: BlueGreen, pool: WorkerPool) -> None:
        self.blue_green = blue_green
        self.pool = pool

    async def replace(self, worker_url: str, config: CompiledConfig) -> Switched:
        name = _name_for(self.pool, worker_url)
        try:
            report = await self.blue_green.replace(name, ReplaceRequest(config=config))
        except ReplacementError as e:
            raise PromotionError(f"blue-green replacement of {name} failed: {e}") from e
        return Switched(report.total_s, report.new_url)
