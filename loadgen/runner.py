"""The send loop: fire prepared requests at their scheduled times and collect results.

The loop is lean on purpose (DESIGN.md: loadgen is never the bottleneck):
bodies are bytes prepared beforehand, every due request is started in one
pass, and the loop sleeps with a short cooperative spin at the end so that
uvloop's millisecond timer resolution does not show up as send-time lag.
The run holds the garbage collector's full collections off
(:func:`polyinfer.heap.settled_heap`): every result is kept until the end, so with
CPython's default thresholds each full collection re-scanned all of them and
showed as send lag.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from loadgen.client import StreamingClient
from loadgen.request import PreparedRequest, RequestResult
from polyinfer.heap import settled_heap

logger = logging.getLogger(__name__)

SPIN_S = 0.001  # wake this long before a send time, then yield until it is due
# NOTE: 1 ms because both epoll (stdlib asyncio) and libuv (uvloop) round timer
# waits up to whole milliseconds; a longer spin only burns CPU that a shared
# machine takes back as lag.


@dataclass
class RunResult:
    results: list[RequestResult]  # one per sent request, in index order
    duration_s: float  # first send to last completion
    num_not_sent: int  # dropped by the duration limit
    started_unix_s: float
    cpu_s: float = 0.0  # this process's CPU time during the run (loadgen's own cost)


async def sleep_until(deadline: float) -> None:
    """Sleep until ``perf_counter() >= deadline``, sub-millisecond late at most when idle."""
    delay = deadline - time.perf_counter()
    if delay > SPIN_S:
        await asyncio.sleep(delay - SPIN_S)
    while time.perf_counter() < deadline:
        await asyncio.sleep(0)


class Runner:
    """Runs one replay of ``requests`` through ``client``."""

    def __init__(self, client: StreamingClient, max_concurrency: int | None = None,
                 duration_s: float | None = None, quiet: bool = False) -> None:
        self.client = client
        self.duration_s = duration_s
        self._slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self._quiet = quiet or not sys.stderr.isatty()
        self._t0 = 0.0  # perf_counter at the start of the run

    async def run(self, requests: Sequence[PreparedRequest]) -> RunResult:
        results: list[RequestResult] = []
        tasks: list[asyncio.Task[None]] = []
        with settled_heap(), tqdm(total=len(requests), disable=self._quiet, unit="req",
                                  smoothing=0.1, dynamic_ncols=True) as bar:
            started_unix = time.time()
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            self._t0 = t0
            loop = asyncio.get_running_loop()
            i, n = 0, len(requests)
            while i < n:
                now = time.perf_counter()
                while i < n and t0 + requests[i].arrival_s <= now:
                    result = RequestResult(index=requests[i].index, line=requests[i].line,
                                           scheduled_s=requests[i].arrival_s,
                                           expected_prompt_tokens=requests[i].prompt_tokens,
                                           max_tokens=requests[i].max_tokens,
                                           domain=requests[i].domain)
                    results.append(result)
                    tasks.append(loop.create_task(self._one(requests[i], result, bar)))
                    i += 1
                if i < n:
                    await sleep_until(t0 + requests[i].arrival_s)
            if tasks:
                await asyncio.gather(*tasks)
            duration = time.perf_counter() - t0
        sent = [r for r in results if r.error != "not sent"]
        return RunResult(sent, duration, len(results) - len(sent), started_unix,
                         time.process_time() - cpu0)

    async def _one(self, req: PreparedRequest, result: RequestResult, bar: tqdm) -> None:
        ready = self._t0 + req.arrival_s
        if self._slots is not None:
            await self._slots.acquire()
            ready = max(ready, time.perf_counter())
        try:
            now = time.perf_counter()
            if self.duration_s is not None and now - self._t0 >= self.duration_s:
                result.error = "not sent"
                return
            result.sent_s = now - self._t0
            result.lag_s = now - ready
            result.queue_s = ready - (self._t0 + req.arrival_s)
            await self.client.send(req, result)
        finally:
            if self._slots is not None:
                self._slots.release()
            bar.update(1)
