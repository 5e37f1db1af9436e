"""Data-parallel engine cores: the step loop in N spawned processes (``data_parallel_size`` N).

The HTTP process keeps aiohttp, tokenization and the OpenAI protocol; each core
process (:mod:`engine.core_proc`) loads its own weights and KV cache and runs
the step loop, so HTTP and model work no longer share one GIL. A request goes
to the core with the fewest requests in flight; each step's outputs come back
as one message per core, read on the event loop (``loop.add_reader`` on the
pipe). A core that dies fails its requests with :class:`EngineUnavailableError`
and the others keep serving; with none left, new requests get 503.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.process
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from engine import core_proc
from engine.async_engine import OutputRouter
from engine.checkpoint import read_spec
from engine.core import RequestOutput
from engine.errors import EngineError, EngineUnavailableError, ReloadError
from engine.metrics import EngineMetrics
from engine.sequence import GenerationParams
from engine.tokenizer import TextTokenizer
from polyinfer.config import CompiledConfig, restart_fields_changed

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 10.0


@dataclass
class _Core:
    index: int
    process: multiprocessing.process.BaseProcess
    conn: Connection
    pid: int = 0
    alive: bool = False
    requests: set[str] = field(default_factory=set)
    num_sent: int = 0
    # control requests (reload, prefix-cache reset) awaiting the core's answer, by token
    pending: dict[int, asyncio.Future[Any]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"engine core {self.index} (pid {self.pid})"


def _wait_ready(core: _Core) -> int:
    """Block until the child says it is ready; returns its pid (run off the loop)."""
    if not core.conn.poll(START_TIMEOUT_S):
        raise EngineError(f"engine core {core.index} did not start in {START_TIMEOUT_S:.0f} s")
    try:
        msg = core.conn.recv()
    except EOFError:
        msg = ("failed", f"exit code {core.process.exitcode}")
    if msg[0] != "ready":
        raise EngineError(f"engine core {core.index} failed to start: {msg[1]}")
    return int(msg[1])


class DataParallelEngine:
    """The AsyncEngine contract over ``config.engine.data_parallel_size`` core processes."""

    def __init__(self, config: CompiledConfig, metrics: EngineMetrics) -> None:
        assert config.engine.data_parallel_size >= 1
        self.metrics = metrics
        spec = read_spec(config.model)
        self.tokenizer = TextTokenizer(config.model, spec.eos_token_ids)
        self.vocab_size = min(self.tokenizer.vocab_size, spec.vocab_size)  # as EngineCore's
        self._config = config
        self._router = OutputRouter(metrics)
        self._cores: list[_Core] = []
        self._tokens = itertools.count()
        self.last_reload_s: list[float] = []  # per live core, from the last reload

    # -- lifetime ---------------------------------------------------------------------------

    async def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        level = logging.getLogger().getEffectiveLevel()
        for i in range(self._config.engine.data_parallel_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=core_proc.main, args=(self._config, child, level),
                               name=f"engine-core-{i}", daemon=True)
            proc.start()
            child.close()
            self._cores.append(_Core(i, proc, parent))
        loop = asyncio.get_running_loop()
        try:
            pids = await asyncio.gather(*(loop.run_in_executor(None, _wait_ready, c)
                                          for c in self._cores))
        except BaseException:
            await self.stop()
            raise
        for core, pid in zip(self._cores, pids, strict=True):
            core.pid, core.alive = pid, True
            loop.add_reader(core.conn.fileno(), self._on_readable, core)
        logger.info("started %d engine core processes: %s", len(pids), pids)

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        for core in self._cores:
            if core.alive:
                loop.remove_reader(core.conn.fileno())
                core.alive = False
                self._send(core, ("stop",))
        await asyncio.gather(*(loop.run_in_executor(None, self._reap, c) for c in self._cores))

    @staticmethod
    def _reap(core: _Core) -> None:
        core.process.join(STOP_TIMEOUT_S)
        if core.process.is_alive():
            logger.warning("%s did not stop in %.0f s; killing it", core.name, STOP_TIMEOUT_S)
            core.process.kill()
            core.process.join()
        core.conn.close()

    # -- requests (event loop) --------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: GenerationParams) -> AsyncGenerator[RequestOutput, None]:
        """Yield outputs until the request finishes; leaving early aborts it in its core."""
        core = self._pick()
        stream = self._router.open(request_id, core.index)
        core.requests.add(request_id)
        core.num_sent += 1
        self._send(core, ("add", request_id, prompt_ids, params))
        finished = False
        try:
            while not finished:
                out = await stream.queue.get()
                finished = out.finished
                if finished and out.finish_reason == "abort" and not core.alive:
                    raise EngineUnavailableError(f"{core.name} died while running this request")
                if out.error is not None:  # the core refused it (engine.async_engine.StepLoop)
                    raise out.error
                yield out
        finally:
            self._router.close(request_id)
            core.requests.discard(request_id)
            if not finished and core.alive:
                self._send(core, ("abort", request_id))

    def _pick(self) -> _Core:
        alive = [c for c in self._cores if c.alive]
        if not alive:
            raise EngineUnavailableError("no engine core process is running")
        return min(alive, key=lambda c: (len(c.requests), c.num_sent))

    async def reload(self, config: CompiledConfig) -> float:
        """Reload every live core (between their steps); returns the slowest swap's seconds."""
        changed = restart_fields_changed(self._config.engine, config.engine)
        if changed:
            raise ReloadError(f"reload cannot change engine.{changed[0]} (restart-only); "
                              "start a new engine")
        seconds = await self._ask_all("reload", config)
        self._config = config
        self.last_reload_s = list(seconds)
        return max(seconds)

    async def reset_prefix_cache(self) -> int:
        """Empty every live core's prefix cache; returns the cached blocks dropped in all."""
        return sum(await self._ask_all("reset_prefix_cache"))

    async def _ask_all(self, kind: str, *payload: Any) -> list[Any]:
        """Send ``(kind, token, *payload)`` to every live core; their answers, in core order."""
        alive = [c for c in self._cores if c.alive]
        if not alive:
            raise EngineUnavailableError("no engine core process is running")
        loop = asyncio.get_running_loop()
        waits = []
        for core in alive:
            token = next(self._tokens)
            core.pending[token] = loop.create_future()
            waits.append(core.pending[token])
            self._send(core, (kind, token, *payload))
        return list(await asyncio.gather(*waits))

    @property
    def config(self) -> CompiledConfig:
        return self._config

    @property
    def max_model_len(self) -> int:
        return self._config.engine.usable_model_len

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self._cores if c.alive]

    # -- the pipes --------------------------------------------------------------------------

    def _send(self, core: _Core, msg: tuple[Any, ...]) -> None:
        try:
            core.conn.send(msg)
        except (BrokenPipeError, OSError):
            self._lost(core)

    def _on_readable(self, core: _Core) -> None:
        try:
            while core.alive and core.conn.poll():
                self._handle(core, core.conn.recv())
        except (EOFError, OSError):
            self._lost(core)

    def _handle(self, core: _Core, msg: tuple[Any, ...]) -> None:
        if msg[0] == "out":
            for out in msg[1]:
                if out.finished:
                    core.requests.discard(out.request_id)
            self._router.deliver(msg[1], msg[2], core.index)
        elif msg[0] in ("reloaded", "prefix_cache_reset"):
            fut = core.pending.pop(msg[1], None)
            if fut is None or fut.done():
                return
            if msg[3] is None:
                fut.set_result(msg[2])
            else:
                error = ReloadError if msg[0] == "reloaded" else EngineError
                fut.set_exception(error(f"{core.name}: {msg[3]}"))

    def _lost(self, core: _Core) -> None:
        if not core.alive:
            return
        core.alive = False
        asyncio.get_running_loop().remove_reader(core.conn.fileno())
        logger.error("%s exited (code %s); failing its %d requests", core.name,
                     core.process.exitcode, len(core.requests))
        for fut in core.pending.values():
            if not fut.done():
                fut.set_exception(EngineUnavailableError(
                    f"{core.name} died before answering a reload or prefix-cache reset"))
        core.pending.clear()
        self._router.forget_source(core.index)
