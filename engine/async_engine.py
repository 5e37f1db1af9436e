"""Drive the engine core from asyncio: one step at a time on a worker thread.

A single background task owns the step loop. Between steps (on the event
loop) it applies queued adds and aborts; the step itself runs on a dedicated
one-thread executor, so the event loop keeps serving HTTP while the model
computes (torch releases the GIL inside its kernels). Outputs are routed to
one ``asyncio.Queue`` per request. Hot reload takes the same lock as a step,
so it happens between two steps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.config import CompiledConfig
from engine.core import EngineCore, RequestOutput, StepStats
from engine.metrics import EngineMetrics
from engine.sequence import GenerationParams

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    queue: asyncio.Queue[RequestOutput]
    arrival_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None


class AsyncEngine:
    def __init__(self, core: EngineCore, metrics: EngineMetrics) -> None:
        self.core = core
        self.metrics = metrics
        self._streams: dict[str, _Stream] = {}
        self._adds: list[tuple[str, list[int], GenerationParams]] = []
        self._aborts: list[str] = []
        self._wakeup = asyncio.Event()
        self._lock = asyncio.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._task: asyncio.Task[None] | None = None
        self._labels = {"model_name": metrics.model_name}

    # -- lifetime ---------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    # -- requests ---------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: GenerationParams) -> AsyncGenerator[RequestOutput, None]:
        """Yield outputs until the request finishes; leaving early aborts it."""
        stream = _Stream(asyncio.Queue(), time.monotonic())
        self._streams[request_id] = stream
        self._adds.append((request_id, prompt_ids, params))
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                out = await stream.queue.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._aborts.append(request_id)
                self._wakeup.set()

    async def reload(self, config: CompiledConfig) -> float:
        """Swap in ``config`` between two steps; returns the seconds the swap took."""
        async with self._lock:
            self._apply_queued()
            loop = asyncio.get_running_loop()
            seconds = await loop.run_in_executor(self._executor, self.core.reload, config)
        self._wakeup.set()
        return seconds

    @property
    def config(self) -> CompiledConfig:
        return self.core.config

    # -- the loop ---------------------------------------------------------------------------

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self.core.has_work or self._adds or self._aborts):
                self._update_gauges()
                self._wakeup.clear()
                await self._wakeup.wait()
            async with self._lock:
                self._apply_queued()
                if not self.core.has_work:
                    continue
                try:
                    outputs, stats = await loop.run_in_executor(self._executor, self.core.step)
                except Exception:
                    logger.exception("engine step failed; aborting the running requests")
                    self._fail_running()
                    continue
            self._deliver(outputs)
            self._record(stats)

    def _apply_queued(self) -> None:
        adds, self._adds = self._adds, []
        for request_id, prompt_ids, params in adds:
            if request_id in self._streams:  # not already gone
                self.core.add_request(request_id, prompt_ids, params)
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            self.core.abort(request_id)

    def _fail_running(self) -> None:
        for request_id in list(self.core.requests):
            self.core.abort(request_id)
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.queue.put_nowait(RequestOutput(request_id, "", [], True, "abort", None,
                                                      0, 0, 0, 0))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.new_token_ids:
                self._time_tokens(stream, now)
            if out.finished:
                self._finish_metrics(stream, out, now)
            stream.queue.put_nowait(out)

    def _time_tokens(self, stream: _Stream, now: float) -> None:
        if stream.first_token_s is None:
            stream.first_token_s = now
            self.metrics.ttft.labels(**self._labels).observe(now - stream.arrival_s)
        elif stream.last_token_s is not None:
            self.metrics.itl.labels(**self._labels).observe(now - stream.last_token_s)
        stream.last_token_s = now

    def _finish_metrics(self, stream: _Stream, out: RequestOutput, now: float) -> None:
        m, labels = self.metrics, self._labels
        m.e2e.labels(**labels).observe(now - stream.arrival_s)
        m.finished.labels(finished_reason=out.finish_reason or "abort", **labels).inc()
        if stream.first_token_s is not None and out.num_output_tokens > 1:
            m.tpot.labels(**labels).observe(
                (now - stream.first_token_s) / (out.num_output_tokens - 1))

    def _record(self, stats: StepStats) -> None:
        m, labels = self.metrics, self._labels
        if stats.num_prompt_tokens:
            m.prompt_tokens.labels(**labels).inc(stats.num_prompt_tokens)
        if stats.num_generated:
            m.generation_tokens.labels(**labels).inc(stats.num_generated)
        if stats.num_preempted:
            m.preemptions.labels(**labels).inc(stats.num_preempted)
        if stats.num_drafts:
            m.spec_drafts.labels(**labels).inc(stats.num_drafts)
            m.spec_draft_tokens.labels(**labels).inc(stats.num_draft_tokens)
            m.spec_accepted_tokens.labels(**labels).inc(stats.num_accepted_tokens)
            for pos, n in enumerate(stats.accepted_per_pos):
                m.spec_accepted_per_pos.labels(position=str(pos), **labels).inc(n)
        self._update_gauges()

    def _update_gauges(self) -> None:
        m, labels = self.metrics, self._labels
        m.running.labels(**labels).set(self.core.num_running)
        m.waiting.labels(**labels).set(self.core.num_waiting + len(self._adds))
        m.kv_usage.labels(**labels).set(self.core.kv_usage)
