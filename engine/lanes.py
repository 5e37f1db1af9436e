"""Split one step's batch into lanes that run their forwards on separate threads (CPU).

NOTE: why lanes and not more OpenMP threads: at this model size a step is
hundreds of small ops, and OpenMP parallelizes each one with a fork/join
whose spinning workers stall whenever the box is oversubscribed (a shared
2-core box measured 3-10x slower with 2 intra-op threads under load). A lane
is a whole forward over a subset of the sequences on its own thread with one
intra-op thread: torch and the C attention kernel release the GIL in their
kernels, so two lanes use two cores, and a descheduled lane only delays its
own half. Lanes never share a KV slot (each sequence owns its blocks), so
their cache writes never race.

NOTE: lanes still hand the GIL back and forth on every op, and on a box whose
other cores are busy the second lane has no core to run on: a shared 2-core
box under load measured 2 lanes 30-40% slower than 1. So :class:`LaneChooser`
decides online, by measured wall time per token of big decode steps (the runner
records only those, so prefill-heavy steps never skew the comparison), whether
big steps run in one lane or in all of them, and keeps re-trying the other.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")

MIN_LANE_TOKENS = 16  # a step with fewer query tokens per lane runs in one lane
CONTEXT_COST = 1 / 500  # attention cost of one context token, in query-token units
EXPLORE_EVERY = 10  # every n-th big step runs with the choice that is not the best now
EWMA_WEIGHT = 0.2  # weight of the newest step in a choice's mean seconds per token


def split_lanes(q_lens: Sequence[int], contexts: Sequence[int], num_lanes: int) -> list[list[int]]:
    """Sequence indices per lane, balancing ``q_len + context * CONTEXT_COST``.

    Longest-processing-time first: each sequence, heaviest first, goes to the
    lightest lane; lanes keep the input order of their sequences. Fewer lanes
    come back when the step is too small to be worth splitting.
    """
    num_lanes = min(num_lanes, len(q_lens), max(1, sum(q_lens) // MIN_LANE_TOKENS))
    if num_lanes <= 1:
        return [list(range(len(q_lens)))]
    cost = [q + c * CONTEXT_COST for q, c in zip(q_lens, contexts, strict=True)]
    load = [0.0] * num_lanes
    lanes: list[list[int]] = [[] for _ in range(num_lanes)]
    for i in sorted(range(len(cost)), key=lambda i: -cost[i]):
        lane = min(range(num_lanes), key=load.__getitem__)
        lanes[lane].append(i)
        load[lane] += cost[i]
    return [sorted(lane) for lane in lanes]


class LaneChooser:
    """Picks 1 or ``max_lanes`` lanes per step from the measured seconds per token of each."""

    def __init__(self, max_lanes: int) -> None:
        self.max_lanes = max_lanes
        self.seconds_per_token: dict[int, float | None] = {1: None, max_lanes: None}
        self._num_big = 0

    def lanes_for(self, num_tokens: int) -> int:
        """Lanes for a step of ``num_tokens`` query tokens (1 below the splitting size)."""
        if self.max_lanes == 1 or num_tokens < 2 * MIN_LANE_TOKENS:
            return 1
        self._num_big += 1
        untried = [n for n, s in self.seconds_per_token.items() if s is None]
        if untried:
            return untried[0]
        best = min(self.seconds_per_token, key=lambda n: self.seconds_per_token[n] or 0.0)
        if self._num_big % EXPLORE_EVERY == 0:
            return self.max_lanes if best == 1 else 1
        return best

    def record(self, num_lanes: int, num_tokens: int, seconds: float) -> None:
        """A big step's forward took ``seconds`` (wall) with ``num_lanes`` lanes."""
        if num_lanes not in self.seconds_per_token or num_tokens < 2 * MIN_LANE_TOKENS:
            return
        now = seconds / num_tokens
        old = self.seconds_per_token[num_lanes]
        self.seconds_per_token[num_lanes] = now if old is None else (
            (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * now)


class Lanes:
    """Runs one callable per lane: the first on the calling thread, the rest on workers."""

    def __init__(self, num_lanes: int, threads_per_lane: int) -> None:
        self.num_lanes = num_lanes
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        if num_lanes > 1:
            # NOTE: torch's intra-op thread count is per thread: set it in each worker.
            self._pool = concurrent.futures.ThreadPoolExecutor(
                num_lanes - 1, thread_name_prefix="engine-lane",
                initializer=torch.set_num_threads, initargs=(threads_per_lane,))

    def run(self, jobs: Sequence[Callable[[], T]]) -> list[T]:
        """Results in ``jobs`` order; an exception in any lane is raised after all finish."""
        if len(jobs) == 1 or self._pool is None:
            return [job() for job in jobs]
        futures = [self._pool.submit(job) for job in jobs[1:]]
        try:
            first = jobs[0]()
        finally:
            concurrent.futures.wait(futures)
        return [first, *(f.result() for f in futures)]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
