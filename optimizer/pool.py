"""Measurement engines by restart class: candidates that a hot reload cannot reach.

Most knobs are hot-reloadable: one persistent engine measures every
candidate. A few are not (:data:`polyinfer.config.RESTART_FIELDS`, e.g.
``data_parallel_size``: engine-core processes are spawned at start-up). A
candidate that changes one of them needs an engine started with it, which
costs a cold start (seconds) where a reload costs a tenth of a second.

:class:`EnginePool` keeps up to ``max_engines`` engines, one per restart class
(the values of the restart-only fields), least recently used stopped first,
so that interleaved pairs (incumbent, candidate) across two classes pay the
cold start once, not on every switch. :meth:`EnginePool.get` returns the
engine for a config and the start-up seconds it cost (0 when it was already
up): the measurer charges that to the experiment, which is how the search
prices a restart.

Example::

    pool = EnginePool(session, max_engines=2)
    handle, start_s = await pool.get(candidate)   # start_s > 0: a cold start was paid
    ...
    await pool.close()
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from optimizer.engine_proc import EngineProcess
from optimizer.errors import MeasurementError
from optimizer.measure import EngineClient
from polyinfer.config import RESTART_FIELDS, CompiledConfig

logger = logging.getLogger(__name__)


def restart_class(cfg: CompiledConfig) -> tuple[Any, ...]:
    """What must match for a hot reload: backend, model and the restart-only engine fields."""
    return (cfg.backend, cfg.model, *(getattr(cfg.engine, f) for f in RESTART_FIELDS))


@dataclass(frozen=True)
class EngineHandle:
    client: EngineClient
    process: EngineProcess | None  # None: an engine this pool did not start (no CPU clock)

    def cpu_seconds(self) -> float | None:
        return self.process.cpu_seconds() if self.process is not None else None


class EnginePool:
    """Up to ``max_engines`` measurement engines, one per restart class."""

    def __init__(self, session: aiohttp.ClientSession, max_engines: int = 2,
                 log_dir: str | Path | None = None, nice: int = 0) -> None:
        if max_engines < 1:
            raise MeasurementError(f"max_engines: expected >= 1, got {max_engines}")
        self.session = session
        self.max_engines = max_engines
        self.log_dir = Path(log_dir) if log_dir else None
        self.nice = nice
        self._engines: OrderedDict[tuple[Any, ...], EngineHandle] = OrderedDict()
        self.num_starts = 0
        self.start_seconds = 0.0

    async def adopt(self, cfg: CompiledConfig, client: EngineClient,
                    process: EngineProcess | None = None) -> None:
        """Register an engine that is already running ``cfg``'s restart class."""
        if not client.model:  # NOTE: completions name the served model, learnt here
            await client.wait_ready()
        self._engines[restart_class(cfg)] = EngineHandle(client, process)

    async def get(self, cfg: CompiledConfig) -> tuple[EngineHandle, float]:
        """The engine for ``cfg``'s restart class and the cold-start seconds paid for it."""
        key = restart_class(cfg)
        if key in self._engines:
            self._engines.move_to_end(key)
            return self._engines[key], 0.0
        while len(self._engines) >= self.max_engines:
            _, old = self._engines.popitem(last=False)
            if old.process is not None:
                await old.process.stop()
        log = (self.log_dir / f"engine-{self.num_starts}.log") if self.log_dir else None
        proc = EngineProcess(cfg.with_engine(measure_num_layers=None), log_path=log,
                             nice=self.nice)
        start_s = await proc.start()
        self.num_starts += 1
        self.start_seconds += start_s
        client = EngineClient(proc.url, self.session)
        await client.wait_ready()
        handle = EngineHandle(client, proc)
        self._engines[key] = handle
        logger.info("started a measurement engine for %s in %.1f s", key[2:], start_s)
        return handle, start_s

    async def close(self) -> None:
        """Stop the engines this pool started (adopted ones without a process are left)."""
        while self._engines:
            _, handle = self._engines.popitem()
            if handle.process is not None:
                await handle.process.stop()
