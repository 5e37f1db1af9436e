"""The proxy's short history: per-second aggregates in two bounded rings.

::

    a request ends  -> History.record(rec)    O(1): a few counter increments and one
                                              histogram bucket per latency, into the
                                              second being filled
    every second    -> History.tick(now, s)   closes that second with the gauges sampled
                                              from the pool and the router (a Sample),
                                              keeps it in the 1 s ring (the last 5 min)
                                              and folds it into the 10 s ring (the last hour)
    the page asks   -> History.window(w, s)   the slots of each step merged into a point

Memory is bounded: ``FINE_SLOTS + COARSE_SLOTS`` slots (:mod:`proxy.history_slot`),
each holding counters keyed by worker, domain, reason and status (sets the fleet
bounds) and latency histograms of at most ``NUM_BUCKETS`` buckets per series. A
window's finished points are kept between calls (:mod:`proxy.history_window`), so a
refresh of the page costs the points that changed, not the window.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from polyinfer.trace import STATUS_ERROR, STATUS_OK
from proxy.history_slot import Slot, bucket_of, count_latency
from proxy.history_window import Frame
from proxy.record import RequestRecord

FINE_S = 1.0  # seconds per slot of the fine ring
FINE_SLOTS = 300  # 5 minutes
COARSE_S = 10.0  # seconds per slot of the coarse ring
COARSE_SLOTS = 360  # 1 hour
MAX_WINDOW_S = COARSE_S * COARSE_SLOTS
TARGET_POINTS = 150  # points per series when the caller names no step
MAX_FRAMES = 4  # views (ring, step, window) whose finished points are kept


@dataclass(frozen=True)
class Sample:
    """What the sampler reads once a second, off the request path."""

    gauges: Mapping[tuple[str, str], float]  # (gauge, worker) -> value now
    spec_tokens: Mapping[tuple[str, str], Sequence[int]]  # (worker, domain) -> [drafted, accepted], cumulative
    # the routing policy's running RMS log error of its predictions (router.confidence):
    # "ttft" | "tpot" | "e2e" -> ln-space error; empty for a policy that predicts nothing
    prediction_error: Mapping[str, float] = field(default_factory=dict)


class History:
    """The two rings and the second being filled; one instance per app (in :class:`Stats`)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.fine: deque[Slot] = deque(maxlen=FINE_SLOTS)
        self.coarse: deque[Slot] = deque(maxlen=COARSE_SLOTS)
        self.num_ticks = 0  # changes whenever a window's answer can change
        self._open = Slot(clock())
        self._coarse_open: Slot | None = None
        self._last_tokens: dict[tuple[str, str], tuple[int, int]] = {}
        self._frames: dict[tuple[bool, float, float], Frame] = {}  # (fine, step, window)

    # -- the request path ------------------------------------------------------------

    def refuse(self, status: str) -> None:
        """A request refused before it had a record (the fast path's door 429s)."""
        refused = self._open.refused
        refused[status] = refused.get(status, 0) + 1

    def record(self, rec: RequestRecord) -> None:
        slot = self._open
        if not rec.worker:
            status = str(rec.http_status)
            slot.refused[status] = slot.refused.get(status, 0) + 1
            return
        worker, domain = rec.worker, rec.domain or "none"
        slot.requests[worker] = slot.requests.get(worker, 0) + 1
        if rec.status == STATUS_ERROR:
            slot.errors[worker] = slot.errors.get(worker, 0) + 1
        key = (domain, worker, rec.reason)
        slot.routed[key] = slot.routed.get(key, 0) + 1
        if rec.spec_depth is not None:
            slot.depth_sum[domain] = slot.depth_sum.get(domain, 0) + rec.spec_depth
            slot.depth_num[domain] = slot.depth_num.get(domain, 0) + 1
        if rec.status == STATUS_OK:
            latency = slot.latency
            if rec.ttft_s is not None:
                count_latency(latency, ("ttft", "worker", worker), ("ttft", "domain", domain),
                       bucket_of(rec.ttft_s))
            tpot_s = rec.tpot_s
            if tpot_s is not None:
                count_latency(latency, ("tpot", "worker", worker), ("tpot", "domain", domain),
                       bucket_of(tpot_s))

    # -- the sampler -----------------------------------------------------------------

    def begin(self) -> None:
        """The sampler starts: the second being filled starts now (not when the app was
        built, before its workers started)."""
        self._open.start_s = self.clock()

    def tick(self, sample: Sample) -> None:
        """Close the second being filled with ``sample``; start the next one."""
        now = self.clock()
        slot, self._open = self._open, Slot(now)
        slot.span_s = max(now - slot.start_s, 0.0)
        slot.gauge_sum = {key: float(v) for key, v in sample.gauges.items()}
        slot.gauge_num = dict.fromkeys(sample.gauges, 1)
        slot.drafted, slot.accepted = self._token_deltas(sample.spec_tokens)
        slot.prediction_error = dict(sample.prediction_error)
        self.fine.append(slot)
        self._fold(slot)
        self.num_ticks += 1

    def _token_deltas(self, cumulative: Mapping[tuple[str, str], Sequence[int]]
                      ) -> tuple[dict[str, float], dict[str, float]]:
        """Drafted and accepted tokens per domain since the last tick (the counters only grow;
        the first sight of a pair counts from zero)."""
        drafted: dict[str, float] = {}
        accepted: dict[str, float] = {}
        for key, (num_drafted, num_accepted) in cumulative.items():
            was_drafted, was_accepted = self._last_tokens.get(key, (0, 0))
            if num_drafted > was_drafted:
                domain = key[1]
                drafted[domain] = drafted.get(domain, 0) + num_drafted - was_drafted
                accepted[domain] = accepted.get(domain, 0) + num_accepted - was_accepted
            self._last_tokens[key] = (num_drafted, num_accepted)
        return drafted, accepted

    def _fold(self, slot: Slot) -> None:
        start = math.floor(slot.start_s / COARSE_S) * COARSE_S
        coarse = self._coarse_open
        if coarse is not None and coarse.start_s != start:
            self.coarse.append(coarse)
            coarse = None
        if coarse is None:
            coarse = self._coarse_open = Slot(start)
        coarse.merge(slot)

    # -- the page --------------------------------------------------------------------

    def window(self, window_s: float, step_s: float | None = None) -> dict[str, Any]:
        """The last ``window_s`` seconds as points ``step_s`` apart (a multiple of the ring's
        resolution; by default about ``TARGET_POINTS`` points), JSON-able.

        Points are aligned to multiples of the step, so a refresh moves a point only when a
        slot enters it. A point's rates divide by the seconds its slots cover (None when
        they cover none), so a partial point is not drawn low.
        """
        frame, args = self._view(window_s, step_s)
        points, series, routing = frame.view(*args)
        return {"window_s": min(max(window_s, FINE_S), MAX_WINDOW_S), "step_s": args[2],
                "end_s": self._open.start_s, "t": [p.start_s for p in points],
                "series": series, "routing": routing}

    def prepare(self, window_s: float, step_s: float | None = None,
                max_points: int = 10) -> bool:
        """Summarise at most ``max_points`` more finished points of the view; whether it is
        ready (its next :meth:`window` costs only a refresh). A caller on the event loop
        prepares a first build in slices, yielding between them."""
        frame, args = self._view(window_s, step_s)
        return frame.advance(*args, max_points=max_points)

    def _view(self, window_s: float, step_s: float | None
              ) -> tuple[Frame, tuple[list[Slot], float, float, int, float]]:
        """The view's frame and what it reads: (ring, first point, step, points, the time
        its ring is closed until)."""
        window_s = min(max(window_s, FINE_S), MAX_WINDOW_S)
        fine = window_s <= FINE_S * FINE_SLOTS
        ring, resolution = (list(self.fine), FINE_S) if fine else (list(self.coarse), COARSE_S)
        closed_until = self._open.start_s  # a point that ends by then has all its slots
        if not fine and self._coarse_open is not None:
            ring.append(self._coarse_open)  # NOTE: the hour's last seconds, still folding in
            closed_until = self._coarse_open.start_s
        step = max(resolution, round((step_s or window_s / TARGET_POINTS) / resolution)
                   * resolution)
        end = self._open.start_s
        first = math.floor((end - window_s) / step) * step
        frame = self._frames.pop((fine, step, window_s), None) or Frame()
        self._frames[(fine, step, window_s)] = frame  # NOTE: the most recently asked last
        while len(self._frames) > MAX_FRAMES:
            del self._frames[next(iter(self._frames))]
        return frame, (ring, first, step, math.ceil((end - first) / step), closed_until)
