"""The proxy's short history: per-second aggregates in two bounded rings.

::

    a request ends  -> History.record(rec)    O(1): a few counter increments and one
                                              histogram bucket per latency, into the
                                              second being filled
    every second    -> History.tick(now, s)   closes that second with the gauges sampled
                                              from the pool and the router (a Sample),
                                              keeps it in the 1 s ring (the last 5 min)
                                              and folds it into the 10 s ring (the last hour)
    the page asks   -> History.window(w, s)   merges the slots of each step into one point

Memory is bounded: ``FINE_SLOTS + COARSE_SLOTS`` slots, each holding counters keyed by
worker, domain, reason and status (sets the fleet bounds), and latency histograms of
at most ``NUM_BUCKETS`` buckets per series. Percentiles come from log-spaced buckets
(ratio ``BUCKET_RATIO`` between edges), so a percentile is within 10% of the sample it
stands for: enough for a chart, and mergeable across slots, which samples are not.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from polyinfer.trace import STATUS_ERROR, STATUS_OK
from proxy.record import RequestRecord

FINE_S = 1.0  # seconds per slot of the fine ring
FINE_SLOTS = 300  # 5 minutes
COARSE_S = 10.0  # seconds per slot of the coarse ring
COARSE_SLOTS = 360  # 1 hour
MAX_WINDOW_S = COARSE_S * COARSE_SLOTS
TARGET_POINTS = 150  # points per series when the caller names no step

MIN_LATENCY_S = 1e-4  # bucket 0 holds everything at or below this
BUCKET_RATIO = 1.2
NUM_BUCKETS = 84  # the last bucket holds everything above ~440 s
_LOG_RATIO = math.log(BUCKET_RATIO)
PERCENTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))
GAUGES = ("outstanding", "running", "waiting")  # per worker, sampled each second


def bucket_of(value_s: float) -> int:
    """The histogram bucket of a latency: bucket i >= 1 holds (MIN * R^(i-1), MIN * R^i]."""
    if not value_s > MIN_LATENCY_S:  # NaN lands here too
        return 0
    i = math.ceil(math.log(value_s / MIN_LATENCY_S) / _LOG_RATIO)
    return min(max(i, 1), NUM_BUCKETS - 1)


def bucket_value(i: int) -> float:
    """What bucket ``i`` stands for: its geometric middle (within R^0.5 of any member)."""
    return MIN_LATENCY_S if i == 0 else MIN_LATENCY_S * BUCKET_RATIO ** (i - 0.5)


def percentile(hist: Mapping[int, int], q: float) -> float | None:
    """The nearest-rank ``q`` quantile of a bucket histogram; None when it is empty."""
    total = sum(hist.values())
    if not total:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for i in sorted(hist):
        seen += hist[i]
        if seen >= rank:
            return bucket_value(i)
    raise AssertionError("unreachable: rank <= total")


@dataclass(slots=True)
class Slot:
    """What happened in one interval; slots merge into longer ones by adding up."""

    start_s: float  # unix seconds
    span_s: float = 0.0  # seconds covered (a merged slot: the sum of its parts)
    requests: Counter[str] = field(default_factory=Counter)  # worker -> finished
    errors: Counter[str] = field(default_factory=Counter)  # worker -> status "error"
    refused: Counter[str] = field(default_factory=Counter)  # HTTP status -> no worker tried
    routed: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (domain, worker, reason)
    depth: dict[str, list[float]] = field(default_factory=dict)  # domain -> [sum of k, requests]
    # (metric, "worker" | "domain", name) -> bucket -> requests
    latency: dict[tuple[str, str, str], Counter[int]] = field(default_factory=dict)
    gauges: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # (gauge, worker) -> [sum, n]
    tokens: dict[str, list[float]] = field(default_factory=dict)  # domain -> [drafted, accepted]
    calibration: dict[str, float] = field(default_factory=dict)  # key -> factor at the end

    def merge(self, other: Slot) -> None:
        self.span_s += other.span_s
        self.requests.update(other.requests)
        self.errors.update(other.errors)
        self.refused.update(other.refused)
        self.routed.update(other.routed)
        _add_pairs(self.depth, other.depth)
        _add_pairs(self.gauges, other.gauges)
        _add_pairs(self.tokens, other.tokens)
        for key, hist in other.latency.items():
            mine = self.latency.get(key)
            if mine is None:
                self.latency[key] = Counter(hist)
            else:
                mine.update(hist)
        self.calibration.update(other.calibration)


def _add_pairs(into: dict[Any, list[float]], other: Mapping[Any, list[float]]) -> None:
    for key, (a, b) in other.items():
        pair = into.setdefault(key, [0.0, 0.0])
        pair[0] += a
        pair[1] += b


@dataclass(frozen=True)
class Sample:
    """What the sampler reads once a second, off the request path."""

    gauges: Mapping[tuple[str, str], float]  # (gauge, worker) -> value now
    spec_tokens: Mapping[tuple[str, str], Sequence[int]]  # (worker, domain) -> [drafted, accepted], cumulative
    calibration: Mapping[str, float] = field(default_factory=dict)  # router: observed / prior


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

    # -- the request path ------------------------------------------------------------

    def record(self, rec: RequestRecord) -> None:
        slot = self._open
        if not rec.worker:
            slot.refused[str(rec.http_status)] += 1
            return
        worker, domain = rec.worker, rec.domain or "none"
        slot.requests[worker] += 1
        if rec.status == STATUS_ERROR:
            slot.errors[worker] += 1
        slot.routed[(domain, worker, rec.reason)] += 1
        if rec.spec_depth is not None:
            depth = slot.depth.setdefault(domain, [0.0, 0.0])
            depth[0] += rec.spec_depth
            depth[1] += 1
        if rec.status == STATUS_OK:
            for metric, value in (("ttft", rec.ttft_s), ("tpot", rec.tpot_s)):
                if value is not None:
                    self._add(slot, (metric, "worker", worker), value)
                    self._add(slot, (metric, "domain", domain), value)

    @staticmethod
    def _add(slot: Slot, key: tuple[str, str, str], value_s: float) -> None:
        hist = slot.latency.get(key)
        if hist is None:
            hist = slot.latency[key] = Counter()
        hist[bucket_of(value_s)] += 1

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
        slot.gauges = {key: [float(v), 1.0] for key, v in sample.gauges.items()}
        slot.tokens = self._token_deltas(sample.spec_tokens)
        slot.calibration = dict(sample.calibration)
        self.fine.append(slot)
        self._fold(slot)
        self.num_ticks += 1

    def _token_deltas(self, cumulative: Mapping[tuple[str, str], Sequence[int]]
                      ) -> dict[str, list[float]]:
        """Drafted and accepted tokens per domain since the last tick (the counters only grow;
        the first sight of a pair counts from zero)."""
        out: dict[str, list[float]] = {}
        for key, (drafted, accepted) in cumulative.items():
            was_drafted, was_accepted = self._last_tokens.get(key, (0, 0))
            if drafted > was_drafted:
                pair = out.setdefault(key[1], [0.0, 0.0])
                pair[0] += drafted - was_drafted
                pair[1] += accepted - was_accepted
            self._last_tokens[key] = (drafted, accepted)
        return out

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
        they cover none), so a partial first or last point is not drawn low.
        """
        window_s = min(max(window_s, FINE_S), MAX_WINDOW_S)
        fine = window_s <= FINE_S * FINE_SLOTS
        ring, resolution = (list(self.fine), FINE_S) if fine else (list(self.coarse), COARSE_S)
        if not fine and self._coarse_open is not None:
            ring.append(self._coarse_open)  # NOTE: the hour's last seconds, still folding in
        step = max(resolution, round((step_s or window_s / TARGET_POINTS) / resolution)
                   * resolution)
        end = self._open.start_s
        first = math.floor((end - window_s) / step) * step
        points = [Slot(first + i * step) for i in range(math.ceil((end - first) / step))]
        for slot in ring:
            i = math.floor((slot.start_s - first) / step)
            if 0 <= i < len(points) and slot.start_s >= end - window_s:
                points[i].merge(slot)
        total = Slot(first)
        for p in points:
            total.merge(p)
        return {"window_s": window_s, "step_s": step, "end_s": end,
                "t": [p.start_s for p in points],
                "series": _series(points), "routing": _routing(total)}


def _series(points: list[Slot]) -> dict[str, Any]:
    workers = sorted({w for p in points for w in p.requests}
                     | {w for p in points for _, w in p.gauges})
    depth_domains = sorted({d for p in points for d in p.depth})
    token_domains = sorted({d for p in points for d in p.tokens})
    statuses = sorted({s for p in points for s in p.refused})
    calibration = sorted({k for p in points for k in p.calibration})
    return {
        "requests_per_s": {w: _rates(points, lambda p: p.requests, w) for w in workers},
        "errors_per_s": {w: _rates(points, lambda p: p.errors, w) for w in workers},
        "refused_per_s": {s: _rates(points, lambda p: p.refused, s) for s in statuses},
        "ttft_s": _latency(points, "ttft"),
        "tpot_s": _latency(points, "tpot"),
        **{g: {w: _means(points, lambda p: p.gauges, (g, w)) for w in workers} for g in GAUGES},
        "spec_depth": {d: _means(points, lambda p: p.depth, d) for d in depth_domains},
        "acceptance": {d: _ratios(points, lambda p: p.tokens, d) for d in token_domains},
        "calibration": {k: [p.calibration.get(k) for p in points] for k in calibration},
    }


def _rates(points: list[Slot], counts: Callable[[Slot], Counter[str]], key: str
           ) -> list[float | None]:
    """Per second; None where the point covers no time."""
    return [round(counts(p)[key] / p.span_s, 4) if p.span_s else None for p in points]


def _means(points: list[Slot], pairs: Callable[[Slot], Mapping[Any, list[float]]], key: Any
           ) -> list[float | None]:
    """sum / n of each point's [sum, n] pair; None where it has none."""
    out: list[float | None] = []
    for p in points:
        pair = pairs(p).get(key)
        out.append(round(pair[0] / pair[1], 3) if pair and pair[1] else None)
    return out


def _ratios(points: list[Slot], pairs: Callable[[Slot], Mapping[Any, list[float]]], key: Any
            ) -> list[float | None]:
    """b / a of each point's [a, b] pair (accepted / drafted); None where a is 0."""
    out: list[float | None] = []
    for p in points:
        pair = pairs(p).get(key)
        out.append(round(pair[1] / pair[0], 4) if pair and pair[0] else None)
    return out


def _latency(points: list[Slot], metric: str) -> dict[str, dict[str, dict[str, list[Any]]]]:
    """{"worker": {name: {"p50": [...], ...}}, "domain": {...}}: seconds, None where empty."""
    out: dict[str, dict[str, dict[str, list[Any]]]] = {"worker": {}, "domain": {}}
    keys = sorted({k for p in points for k in p.latency if k[0] == metric})
    for key in keys:
        hists = [p.latency.get(key) for p in points]
        out[key[1]][key[2]] = {
            name: [None if not h else _round_s(percentile(h, q)) for h in hists]
            for name, q in PERCENTILES}
    return out


def _round_s(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.4g}")


def _routing(total: Slot) -> dict[str, Any]:
    """The window's domain x worker counts, and the decision reasons of each cell."""
    matrix: dict[str, dict[str, int]] = {}
    reasons: dict[str, dict[str, dict[str, int]]] = {}
    for (domain, worker, reason), n in total.routed.items():
        row = matrix.setdefault(domain, {})
        row[worker] = row.get(worker, 0) + n
        cell = reasons.setdefault(domain, {}).setdefault(worker, {})
        cell[reason or "none"] = cell.get(reason or "none", 0) + n
    return {"matrix": matrix, "reasons": reasons}
