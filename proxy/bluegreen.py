"""Blue-green replacement of a worker's compiled config, for workers that cannot hot-reload.

A vLLM server takes its configuration (speculative config, batch caps, ...)
at start-up only, so a new config means a new server. To change it without
losing a request::

    start    launch the candidate beside the live worker (or attach a URL),
             wait for /health and its model list; it gets no traffic yet
    warm up  one 1-token completion straight to the candidate
    shift    in one step on the event loop (no await): the candidate takes the
             worker's name and traffic, the old worker is set draining
    drain    wait until the old worker has no request from this proxy in flight
    stop     stop the old process (or detach the old URL)

NOTE: the drain has no fixed deadline: a request in flight finishes where it
started, bounded by its own limits (its ``max_tokens``, and the relay's
``read_timeout_s`` without a byte, after which the relay fails it anyway). The
drain gives up only when no request on the old worker finished for
``stall_timeout_s`` (the read timeout), or at a deadline the replace request
names itself. A fixed 30 s drain once stopped a worker at capacity with 113
requests still running on it (99 of them got 502s).

If the candidate fails to start, to serve the worker's models, or to warm up,
it is stopped and the live worker is untouched. Requests already running on
the old worker finish there; a request that the old worker fails before any
byte reached the client is retried on the candidate by the relay.

Callers: ``POST /admin/workers/{name}/replace`` (proxy.admin) and the
optimizer, through :meth:`BlueGreen.replace` or :func:`replace_worker`::

    report = await replace_worker(pool, "spec", ReplaceRequest(config=new_config))
    report.total_s   # seconds from launch to the old worker stopped
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

import aiohttp
import orjson

from polyinfer.config import CompiledConfig, ConfigError
from proxy.config import LaunchSpec, WorkerSpec
from proxy.pool import Worker, WorkerPool

logger = logging.getLogger(__name__)

CANDIDATE_SUFFIX = "~next"  # the candidate's name until the shift


class ReplacementError(RuntimeError):
    """The candidate could not take over; the live worker keeps serving unchanged."""


class ReplacementBusy(ReplacementError):
    """A replacement of this worker is already under way."""


@dataclass(frozen=True)
class ReplaceRequest:
    """What to replace a worker with (the body of ``POST /admin/workers/{name}/replace``).

    Every field defaults to the live worker's: ``{"config": {...}}`` relaunches it
    with a new compiled config; ``{"url": ...}`` attaches a server started elsewhere.
    """

    config: CompiledConfig | None = None  # None = the live worker's config
    launch: LaunchSpec | None = None  # None = the live worker's (with a fresh port)
    url: str = ""  # attach this running server instead of launching one
    # a hard deadline for the drain; None = until the old worker is idle (stall-bounded)
    drain_timeout_s: float | None = None
    warmup: bool = True  # send one 1-token completion before the shift
    warmup_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.url and self.launch is not None:
            raise ConfigError(f"replace.url: expected url or launch, not both, got {self.url!r}")
        if self.drain_timeout_s is not None and self.drain_timeout_s < 0:
            raise ConfigError(f"replace.drain_timeout_s: expected >= 0, got "
                              f"{self.drain_timeout_s!r}")
        if self.warmup_timeout_s <= 0:
            raise ConfigError(f"replace.warmup_timeout_s: expected > 0, got "
                              f"{self.warmup_timeout_s!r}")


@dataclass(frozen=True)
class Replacement:
    """What a replacement did and what it cost (seconds, monotonic clock)."""

    name: str
    old_url: str
    new_url: str
    start_s: float  # candidate launched (or attached) until healthy with its models known
    warmup_s: float
    drain_s: float  # shift until the old worker had nothing in flight
    stop_s: float  # stopping the old process
    total_s: float
    num_in_flight_at_shift: int  # requests the old worker was still serving at the shift
    num_abandoned: int  # still in flight at the drain deadline (then stopped regardless)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


class BlueGreen:
    """Replaces workers of one pool, one replacement per worker at a time."""

    def __init__(self, pool: WorkerPool, stall_timeout_s: float) -> None:
        self.pool = pool
        self.stall_timeout_s = stall_timeout_s  # give up draining when nothing finished this long
        self.last: Replacement | None = None  # the last replacement that completed
        self._running: dict[str, asyncio.Task[Replacement]] = {}

    def busy(self, name: str) -> bool:
        return name in self._running

    async def close(self) -> None:
        """Cancel replacements under way (each stops what it started); for app shutdown."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def replace(self, name: str, request: ReplaceRequest) -> Replacement:
        """Replace worker ``name`` as ``request`` says; raise :class:`ReplacementError` on failure.

        The replacement runs in its own task: a caller that goes away (an admin
        client disconnecting) does not stop it half-way.
        """
        if name in self._running:
            raise ReplacementBusy(f"worker {name!r} is already being replaced")
        task = asyncio.create_task(self._replace(name, request), name=f"replace-{name}")
        self._running[name] = task
        task.add_done_callback(lambda _: self._running.pop(name, None))
        return await asyncio.shield(task)

    async def _replace(self, name: str, request: ReplaceRequest) -> Replacement:
        old = self.pool.workers.get(name)
        if old is None:
            raise ReplacementError(f"no worker named {name!r}")
        t0 = time.monotonic()
        candidate = await self._start(old, candidate_spec(old.spec, request))
        t_started = time.monotonic()
        try:
            if request.warmup:
                await warm_up(candidate, old, request.warmup_timeout_s)
            if self.pool.workers.get(name) is not old:
                raise ReplacementError(f"{name}: removed or replaced while the candidate started")
        except BaseException:
            await self._discard(candidate)
            raise
        t_warm = time.monotonic()
        num_in_flight = old.view.outstanding_requests
        shift(self.pool, name, candidate, old)
        logger.info("worker %s: traffic shifted from %s to %s (%d in flight on the old one)",
                    name, old.url, candidate.url, num_in_flight)
        num_abandoned = -1
        try:
            num_abandoned = await drain(old, self.stall_timeout_s, request.drain_timeout_s)
        finally:  # NOTE: even when cancelled: the old process is no longer in the pool
            t_drained = time.monotonic()
            if old.supervisor is not None:
                await old.supervisor.stop()
        t_end = time.monotonic()
        self.last = Replacement(name=name, old_url=old.url, new_url=candidate.url,
                                start_s=t_started - t0, warmup_s=t_warm - t_started,
                                drain_s=t_drained - t_warm, stop_s=t_end - t_drained,
                                total_s=t_end - t0, num_in_flight_at_shift=num_in_flight,
                                num_abandoned=num_abandoned)
        return self.last

    async def _start(self, old: Worker, spec: WorkerSpec) -> Worker:
        try:
            candidate = await self.pool.add(spec)
        except Exception as e:
            raise ReplacementError(f"{old.name}: candidate did not start: {e}") from e
        # NOTE: pool.add returns right after the probe that made the candidate healthy,
        # with no await in between, so no request can have been routed to it yet.
        candidate.view.draining = True
        missing = old.models - candidate.models
        if not candidate.probe_ok or missing:
            await self._discard(candidate)
            why = f"does not serve {sorted(missing)}" if missing else "failed its health probe"
            raise ReplacementError(f"{old.name}: candidate {why}")
        return candidate

    async def _discard(self, candidate: Worker) -> None:
        self.pool.workers.pop(candidate.name, None)
        if candidate.supervisor is not None:
            await candidate.supervisor.stop()


def candidate_spec(live: WorkerSpec, request: ReplaceRequest) -> WorkerSpec:
    """The candidate's spec: the request's fields over the live worker's."""
    config = request.config if request.config is not None else live.config
    name = live.name + CANDIDATE_SUFFIX
    if request.url:
        # a worker attached as a bare URL (--worker) keeps discovering its models and config
        return WorkerSpec(name=name, url=request.url.rstrip("/"), config=config,
                          discover=live.discover and request.config is None)
    launch = request.launch
    if launch is None:
        if live.launch is None:
            raise ConfigError(f"replace.url: {live.name} is attached by URL; expected a 'url' "
                              "or a 'launch' for the candidate, got neither")
        # NOTE: a fresh port: the live worker still holds its own until it is drained.
        launch = dataclasses.replace(live.launch, port=0)
    return WorkerSpec(name=name, launch=launch, config=config)


async def warm_up(candidate: Worker, live: Worker, timeout_s: float) -> None:
    """One greedy 1-token completion on the candidate, so the first client request is warm."""
    model = next(iter(sorted(live.models & candidate.models)), candidate.spec.config.model_name)
    payload = orjson.dumps({"model": model, "prompt": "Hello", "max_tokens": 1,
                            "temperature": 0})
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async with s.post(f"{candidate.url}/v1/completions", data=payload,
                              headers={"Content-Type": "application/json"}) as r:
                body = await r.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise ReplacementError(f"{live.name}: candidate warm-up failed: {e!r}") from e
    if r.status != 200:
        raise ReplacementError(f"{live.name}: candidate warm-up answered HTTP {r.status}: "
                               f"{body[:200]!r}")


def shift(pool: WorkerPool, name: str, candidate: Worker, old: Worker) -> None:
    """Give ``name`` (and its traffic) to the candidate and set the old worker draining.

    Synchronous on purpose: no request can be routed between the two changes.
    """
    spec = dataclasses.replace(candidate.spec, name=name)
    pool.workers.pop(candidate.name, None)
    candidate.spec = spec
    candidate.view.name = name
    if candidate.supervisor is not None:
        candidate.supervisor.spec = spec
    old.view.draining = True
    pool.workers[name] = candidate
    candidate.view.draining = False


async def drain(old: Worker, stall_timeout_s: float, deadline_s: float | None = None,
                poll_s: float = 0.02) -> int:
    """Wait until ``old`` has no request in flight; answer how many remained when it gave up.

    It gives up when no request finished for ``stall_timeout_s`` (they are stuck, and the
    relay fails them on its own read timeout) or after ``deadline_s`` when one is given.
    """
    t0 = last_progress = time.monotonic()
    remaining = old.view.outstanding_requests
    while remaining > 0:
        now = time.monotonic()
        if now - last_progress > stall_timeout_s or (deadline_s is not None
                                                     and now - t0 > deadline_s):
            logger.warning("worker %s (%s): %d request(s) still in flight after %.1f s of "
                           "drain", old.name, old.url, remaining, now - t0)
            break
        await asyncio.sleep(poll_s)
        if old.view.outstanding_requests < remaining:
            last_progress = time.monotonic()
        remaining = old.view.outstanding_requests
    return remaining


async def replace_worker(pool: WorkerPool, name: str, request: ReplaceRequest, *,
                         stall_timeout_s: float = 600.0) -> Replacement:
    """One-shot :meth:`BlueGreen.replace` (the drain gives up after ``stall_timeout_s``
    without a finished request, or at the request's own ``drain_timeout_s``).

    Prefer the app's :class:`BlueGreen` where one exists: it refuses concurrent
    replacements of the same worker.
    """
    return await BlueGreen(pool, stall_timeout_s).replace(name, request)
