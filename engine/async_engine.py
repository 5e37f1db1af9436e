"""Drive the engine core from asyncio: the core steps on its own thread, back to back.

The event loop never waits for a step and the step thread never waits for the
event loop: requests, aborts and reloads go to the engine thread through a
thread-safe inbox, which it drains between steps; each step's outputs come back
with one ``call_soon_threadsafe`` and are routed to one ``asyncio.Queue`` per
request. NOTE: a per-step round trip through an executor costs two thread
wake-ups per step, which on a loaded 2-core box measured several times the
step itself; a free-running thread pays for none of them. torch releases the
GIL inside its kernels, so HTTP keeps flowing while the model computes.

:class:`StepLoop` (the thread side) and :class:`OutputRouter` (the event-loop
side: streams and metrics) are shared with :mod:`engine.dp`, which runs the
same step loop in engine-core processes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.core import EngineCore, RequestOutput, StepStats
from engine.errors import RequestError
from engine.metrics import EngineMetrics
from engine.sequence import GenerationParams
from engine.tokenizer import TextTokenizer
from polyinfer.config import CompiledConfig

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    queue: asyncio.Queue[RequestOutput]
    arrival_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    source: int = 0  # which step loop runs the request


@dataclass(frozen=True)
class Add:
    request_id: str
    prompt_ids: list[int]
    params: GenerationParams


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Reload:
    config: CompiledConfig
    done: concurrent.futures.Future[float] = field(default_factory=concurrent.futures.Future)


@dataclass(frozen=True)
class ResetPrefixCache:
    done: concurrent.futures.Future[int] = field(default_factory=concurrent.futures.Future)


Command = Add | Abort | Reload | ResetPrefixCache
# NOTE: idle work (EngineCore.idle) holds the GIL; started at once it would delay the event
# loop's sending of the outputs the last step just posted.
IDLE_WORK_AFTER_S = 0.002
Post = Callable[[list[RequestOutput], StepStats | None], None]
T = TypeVar("T")


def aborted_output(request_id: str, error: RequestError | None = None) -> RequestOutput:
    """The output that fails a request (finish_reason "abort"); ``error`` when the request
    itself was refused (the server answers it, instead of a 500)."""
    return RequestOutput(request_id, "", [], True, "abort", None, 0, 0, 0, 0, error=error)


def _settle(done: concurrent.futures.Future[T], work: Callable[[], T]) -> None:
    """Run ``work`` for a waiting caller and settle ``done`` with its result or error.

    NOTE: a caller that gives up (a cancelled ``asyncio.wrap_future``, e.g. an HTTP client
    that disconnected) cancels ``done``; the work is then skipped. Setting a result on a
    cancelled future raises, which used to kill the step thread (every request then hung).
    """
    if not done.set_running_or_notify_cancel():
        return
    try:
        done.set_result(work())
    except Exception as e:  # never leave the caller waiting
        done.set_exception(e)


class StepLoop:
    """Steps ``core`` back to back, applying inbox commands between steps; ``None`` stops it."""

    def __init__(self, core: EngineCore, inbox: queue.SimpleQueue[Command | None],
                 post: Post) -> None:
        self.core = core
        self.inbox = inbox
        self.post = post
        self._held: tuple[list[RequestOutput], StepStats] | None = None  # see _step
        self._launched = False  # this step launched an asynchronous forward
        core.on_launch = self._on_launch

    def run(self) -> None:
        while True:
            block = not self.core.has_work
            if block:
                self._release_held()
            try:
                while True:
                    cmd = self._next(block)
                    if cmd is None:
                        self._release_held()
                        return
                    self._apply(cmd)
                    block = False
            except queue.Empty:
                pass
            if self.core.has_work:
                self._step()
            else:  # idle after aborts: publish the freed cache
                self.post([], self._gauges(StepStats()))

    def _next(self, block: bool) -> Command | None:
        """The next command; blocking, the core's idle work runs once the inbox has stayed
        empty for IDLE_WORK_AFTER_S (so the event loop sends the last outputs first)."""
        if not block:
            return self.inbox.get(block=False)
        try:
            return self.inbox.get(timeout=IDLE_WORK_AFTER_S)
        except queue.Empty:
            self.core.idle()
        return self.inbox.get()

    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, Add):
            try:
                self.core.add_request(cmd.request_id, cmd.prompt_ids, cmd.params)
            except RequestError as e:  # e.g. too long for a config reloaded since parsing
                logger.info("refused request %s: %s", cmd.request_id, e)
                self.post([aborted_output(cmd.request_id, e)], None)
            except Exception:
                logger.exception("cannot add request %s", cmd.request_id)
                self.post([aborted_output(cmd.request_id)], None)
        elif isinstance(cmd, Abort):
            self.core.abort(cmd.request_id)
        elif isinstance(cmd, ResetPrefixCache):
            _settle(cmd.done, self.core.reset_prefix_cache)
        else:
            self._release_held()
            _settle(cmd.done, lambda: self.core.reload(cmd.config))
            self.post([], self._gauges(StepStats()))

    def _step(self) -> None:
        """One step. A step that launched its forward asynchronously (a CUDA-graph replay:
        ``EngineCore.on_launch``) holds its outputs until the next step has launched its
        own, or until the loop waits for commands; any other step posts them at its end.

        NOTE: posting wakes the event loop, whose work for a step (metrics, the request's
        queue, the SSE chunk and its socket write) holds the GIL. Posted at the end of a
        step, that work contended with the next step's host work before its launch
        (propose, schedule, filling the inputs) while the GPU idled; posted after the launch
        it runs while the GPU computes (the step thread waits for it without the GIL). The
        CPU's eager forward is no such wait (its Python holds the GIL between kernels):
        holding there measured 2-7% slower on the 2-core box (bench/engine_host.py).
        """
        self._launched = False
        try:
            outputs, stats = self.core.step()
        except Exception:
            logger.exception("engine step failed; aborting the running requests")
            outputs, stats = [], StepStats()
            for request_id in list(self.core.requests):
                self.core.abort(request_id)
                outputs.append(aborted_output(request_id))
        self._release_held()  # the step launched no forward
        if self._launched:
            self._held = (outputs, self._gauges(stats))
        else:
            self.post(outputs, self._gauges(stats))

    def _on_launch(self) -> None:
        self._launched = True
        self._release_held()

    def _release_held(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self.post(*held)

    def _gauges(self, stats: StepStats) -> StepStats:
        stats.num_running = self.core.num_running
        stats.num_waiting = self.core.num_waiting
        stats.kv_usage = self.core.kv_usage
        return stats


class OutputRouter:
    """Event-loop side: one queue per request, and the vLLM metrics from outputs and stats.

    Gauges are kept per source (step loop) and exported as the sum of running and
    waiting and the mean KV-cache usage (the sources have equal caches).
    """

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self._streams: dict[str, _Stream] = {}
        self._labels = {"model_name": metrics.model_name}
        self._gauges: dict[int, StepStats] = {}
        self._m = _Children(metrics)

    def open(self, request_id: str, source: int = 0) -> _Stream:
        stream = _Stream(asyncio.Queue(), time.monotonic(), source=source)
        self._streams[request_id] = stream
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def in_flight(self, source: int) -> list[str]:
        return [rid for rid, s in self._streams.items() if s.source == source]

    def forget_source(self, source: int) -> None:
        """A source is gone: fail its requests and drop its gauges."""
        self._gauges.pop(source, None)
        self.deliver([aborted_output(rid) for rid in self.in_flight(source)], None, source)
        self._set_gauges()

    def deliver(self, outputs: list[RequestOutput], stats: StepStats | None,
                source: int = 0) -> None:
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
        if stats is not None:
            self._record(stats)
            self._gauges[source] = stats
            self._set_gauges()

    def _time_tokens(self, stream: _Stream, now: float) -> None:
        if stream.first_token_s is None:
            stream.first_token_s = now
            self._m.ttft.observe(now - stream.arrival_s)
        elif stream.last_token_s is not None:
            self._m.itl.observe(now - stream.last_token_s)
        stream.last_token_s = now

    def _finish_metrics(self, stream: _Stream, out: RequestOutput, now: float) -> None:
        m = self._m
        m.e2e.observe(now - stream.arrival_s)
        m.finished(out.finish_reason or "abort").inc()
        if stream.first_token_s is not None and out.num_output_tokens > 1:
            m.tpot.observe((now - stream.first_token_s) / (out.num_output_tokens - 1))

    def _record(self, stats: StepStats) -> None:
        m = self._m
        if stats.num_prompt_tokens:
            m.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generated:
            m.generation_tokens.inc(stats.num_generated)
        if stats.num_prefix_queries:
            m.prefix_cache_queries.inc(stats.num_prefix_queries)
            m.prefix_cache_hits.inc(stats.num_prefix_hits)
            m.prompt_tokens_cached.inc(stats.num_prefix_hits)
        if stats.num_preempted:
            m.preemptions.inc(stats.num_preempted)
        if stats.paced:
            m.paced_steps.inc()
        if stats.decode_step is not None:
            self.metrics.decode_steps.add(stats.decode_step)
        if stats.num_drafts:
            m.spec_drafts.inc(stats.num_drafts)
            m.spec_draft_tokens.inc(stats.num_draft_tokens)
            m.spec_accepted_tokens.inc(stats.num_accepted_tokens)
            for pos, n in enumerate(stats.accepted_per_pos):
                m.accepted_at(pos).inc(n)

    def _set_gauges(self) -> None:
        m, gauges = self._m, list(self._gauges.values())
        m.running.set(sum(g.num_running for g in gauges))
        m.waiting.set(sum(g.num_waiting for g in gauges))
        m.kv_usage.set(sum(g.kv_usage for g in gauges) / len(gauges) if gauges else 0.0)


class _Children:
    """The metrics' children under this engine's labels, looked up once.

    NOTE: ``metric.labels(...)`` hashes and validates the label values on every call; the
    router updated ~10 children a step (one more per accepted draft position), so at batch 1
    on a GPU the lookups cost more than the updates. The children are the same objects
    ``labels`` returns, so what is exported does not change.
    """

    def __init__(self, metrics: EngineMetrics) -> None:
        self._metrics = metrics
        self._labels = {"model_name": metrics.model_name}
        lab = self._labels
        self.ttft = metrics.ttft.labels(**lab)
        self.itl = metrics.itl.labels(**lab)
        self.tpot = metrics.tpot.labels(**lab)
        self.e2e = metrics.e2e.labels(**lab)
        self.prompt_tokens = metrics.prompt_tokens.labels(**lab)
        self.generation_tokens = metrics.generation_tokens.labels(**lab)
        self.prefix_cache_queries = metrics.prefix_cache_queries.labels(**lab)
        self.prefix_cache_hits = metrics.prefix_cache_hits.labels(**lab)
        self.prompt_tokens_cached = metrics.prompt_tokens_cached.labels(**lab)
        self.preemptions = metrics.preemptions.labels(**lab)
        self.paced_steps = metrics.paced_steps.labels(**lab)
        self.spec_drafts = metrics.spec_drafts.labels(**lab)
        self.spec_draft_tokens = metrics.spec_draft_tokens.labels(**lab)
        self.spec_accepted_tokens = metrics.spec_accepted_tokens.labels(**lab)
        self.running = metrics.running.labels(**lab)
        self.waiting = metrics.waiting.labels(**lab)
        self.kv_usage = metrics.kv_usage.labels(**lab)
        self._finished: dict[str, Any] = {}
        self._per_pos: list[Any] = []

    def finished(self, reason: str) -> Any:
        child = self._finished.get(reason)
        if child is None:
            child = self._finished[reason] = self._metrics.finished.labels(
                finished_reason=reason, **self._labels)
        return child

    def accepted_at(self, pos: int) -> Any:
        while len(self._per_pos) <= pos:
            self._per_pos.append(self._metrics.spec_accepted_per_pos.labels(
                position=str(len(self._per_pos)), **self._labels))
        return self._per_pos[pos]


class AsyncEngine:
    """The in-process engine: one step thread (``engine.data_parallel_size`` 0)."""

    def __init__(self, core: EngineCore, metrics: EngineMetrics) -> None:
        self.core = core
        self.metrics = metrics
        self._router = OutputRouter(metrics)
        self._inbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._config = core.config

    # -- lifetime ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        step_loop = StepLoop(self.core, self._inbox, self._post)
        self._thread = threading.Thread(target=step_loop.run, name="engine-step", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # -- requests (event loop) --------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: GenerationParams) -> AsyncGenerator[RequestOutput, None]:
        """Yield outputs until the request finishes; leaving early aborts it."""
        stream = self._router.open(request_id)
        self._inbox.put(Add(request_id, prompt_ids, params))
        finished = False
        try:
            while not finished:
                out = await stream.queue.get()
                finished = out.finished
                if out.error is not None:
                    raise out.error
                yield out
        finally:
            self._router.close(request_id)
            if not finished:
                self._inbox.put(Abort(request_id))

    async def reload(self, config: CompiledConfig) -> float:
        """Swap in ``config`` between two steps; returns the seconds the swap took."""
        cmd = Reload(config)
        self._inbox.put(cmd)
        seconds = await asyncio.wrap_future(cmd.done)
        self._config = config
        return seconds

    async def reset_prefix_cache(self) -> int:
        """Empty the prefix cache between two steps; returns the cached blocks dropped."""
        cmd = ResetPrefixCache()
        self._inbox.put(cmd)
        return await asyncio.wrap_future(cmd.done)

    @property
    def config(self) -> CompiledConfig:
        return self._config

    @property
    def tokenizer(self) -> TextTokenizer:
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    def _post(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._router.deliver, outputs, stats)
        except RuntimeError:  # the loop is closed: shutting down
            pass
