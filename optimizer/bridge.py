"""Adapters that let the optimizer act on a running proxy (``polyinfer serve --optimize``).

    sinks = (PoolConfigSink(pool),)              # router profiles follow promotions
    blue_green = PoolBlueGreen(bg, pool)         # vLLM workers: blue-green replacement
    service = OptimizerService(config, sinks=sinks, blue_green=blue_green)

``PoolConfigSink`` sets the promoted config on the proxy's view of the worker;
the adaptive router keys each worker's latency profile on that config object,
so a promotion restarts the profile from the new config's prior (a hot reload
changes the worker's speed; old measurements would mislead it).
``PoolBlueGreen`` maps a worker URL to its pool name and runs the proxy's
blue-green replacement (issue 8), returning the seconds it took.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from optimizer.errors import PromotionError
from optimizer.promote import Switched
from polyinfer.config import CompiledConfig

if TYPE_CHECKING:
    from proxy.bluegreen import BlueGreen as ProxyBlueGreen
    from proxy.pool import WorkerPool

logger = logging.getLogger(__name__)


def _name_for(pool: WorkerPool, worker_url: str) -> str:
    url = worker_url.rstrip("/")
    for name, worker in pool.workers.items():
        if worker.url.rstrip("/") == url:
            return name
    raise PromotionError(f"no worker of the proxy has the URL {worker_url}")


class PoolConfigSink:
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


class PoolBlueGreen:
    def __init__(self, blue_green: ProxyBlueGreen, pool: WorkerPool) -> None:
        self.blue_green = blue_green
        self.pool = pool

    async def replace(self, worker_url: str, config: CompiledConfig) -> Switched:
        from proxy.bluegreen import ReplacementError, ReplaceRequest

        name = _name_for(self.pool, worker_url)
        try:
            report = await self.blue_green.replace(name, ReplaceRequest(config=config))
        except ReplacementError as e:
            raise PromotionError(f"blue-green replacement of {name} failed: {e}") from e
        return Switched(report.total_s, report.new_url)
