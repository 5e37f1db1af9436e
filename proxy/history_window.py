"""Windows of :mod:`proxy.history` as the page reads them: points, series, routing matrix.

A window is the last ``window_s`` seconds cut into points ``step_s`` long, aligned to
multiples of the step. A point merges the ring slots that start in it and is reduced to
what the page draws (:class:`Point`). A :class:`Frame` keeps one view's finished points
(all their slots closed) and their series between calls, so a refresh drops the points
that left the window and adds the ones that finished since: the cost of a refresh is a
few points times the number of series keys, not the window.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.history_slot import BUCKET_VALUES, Slot, add_counts

PERCENTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))
GAUGES = ("outstanding", "running", "waiting")  # per worker, sampled each second
COUNTED = ("requests_per_s", "errors_per_s", "refused_per_s")  # missing = 0 where covered
SERIES = (*COUNTED, *GAUGES, "spec_depth", "acceptance", "prediction_error", "ttft_s",
          "tpot_s")


@dataclass(frozen=True, slots=True)
class Point:
    """One step of a window, reduced to what the page draws."""

    start_s: float
    covered: bool  # its slots cover some time: a count it lacks is 0, not unknown
    values: dict[str, dict[Any, float]]  # series -> key -> value
    routed: dict[tuple[str, str, str], int]  # (domain, worker, reason) -> requests

    def missing(self, series: str) -> float | None:
        """What a key this point lacks stands for in ``series``."""
        return 0.0 if self.covered and series in COUNTED else None


def point_of(start_s: float, slots: Iterable[Slot]) -> Point:
    merged = Slot(start_s)
    for slot in slots:
        merged.merge(slot)
    span = merged.span_s
    if not span:
        return Point(start_s, False, {}, merged.routed)
    workers = {w: 0.0 for _, w in merged.gauge_num}  # NOTE: a worker with no requests is at 0
    values: dict[str, dict[Any, float]] = {
        "requests_per_s": {**workers, **{w: round(n / span, 4) for w, n in merged.requests.items()}},
        "errors_per_s": {**workers, **{w: round(n / span, 4) for w, n in merged.errors.items()}},
        "refused_per_s": {s: round(n / span, 4) for s, n in merged.refused.items()},
        "spec_depth": {d: round(merged.depth_sum[d] / n, 3) for d, n in merged.depth_num.items()
                       if n},
        "acceptance": {d: round(merged.accepted.get(d, 0) / n, 4)
                       for d, n in merged.drafted.items() if n},
        "prediction_error": dict(merged.prediction_error),
        "ttft_s": {}, "tpot_s": {}, **{g: {} for g in GAUGES},
    }
    for (gauge, worker), n in merged.gauge_num.items():
        if n:
            values[gauge][worker] = round(merged.gauge_sum[(gauge, worker)] / n, 3)
    for (metric, kind, name), hist in merged.latency.items():
        for (pname, _), value in zip(PERCENTILES, percentiles(hist), strict=True):
            values[metric + "_s"][(kind, name, pname)] = value
    return Point(start_s, True, values, merged.routed)


def percentiles(hist: Mapping[int, int]) -> tuple[float, ...]:
    """``PERCENTILES`` of a non-empty bucket histogram in one pass (nearest rank), seconds
    to 4 digits."""
    total = sum(hist.values())
    ranks = [max(1, math.ceil(q * total)) for _, q in PERCENTILES]
    out: list[float] = []
    k, rank, seen = 0, ranks[0], 0
    for i in sorted(hist):
        seen += hist[i]
        while seen >= rank:
            out.append(BUCKET_VALUES[i])
            k += 1
            if k == len(ranks):
                return tuple(out)
            rank = ranks[k]
    raise AssertionError("unreachable: the last rank is the total")


class Frame:
    """A view's finished points, contiguous from the window's first, and their series."""

    def __init__(self) -> None:
        self.points: list[Point] = []
        self.series: dict[str, dict[Any, list[float | None]]] = {s: {} for s in SERIES}
        self.routed: dict[tuple[str, str, str], int] = {}
        self._last_seen: dict[tuple[str, Any], float] = {}  # (series, key) -> point start

    def drop_before(self, first_s: float) -> None:
        num = sum(1 for p in self.points if p.start_s < first_s)
        if not num:
            return
        for p in self.points[:num]:
            for key, n in p.routed.items():
                left = self.routed[key] - n
                if left:
                    self.routed[key] = left
                else:
                    del self.routed[key]
        del self.points[:num]
        for name, table in self.series.items():
            for key in list(table):
                if self._last_seen[(name, key)] < first_s:  # no longer in the window
                    del table[key], self._last_seen[(name, key)]
                else:
                    del table[key][:num]

    def append(self, point: Point) -> None:
        before = self.points[:]
        self.points.append(point)
        add_counts(self.routed, point.routed)
        for name, table in self.series.items():
            for key, value in point.values.get(name, {}).items():
                column = table.get(key)
                if column is None:
                    column = table[key] = [p.missing(name) for p in before]
                column.append(value)
                self._last_seen[(name, key)] = point.start_s
            for column in table.values():
                if len(column) == len(before):
                    column.append(point.missing(name))


    def view(self, ring: Sequence[Slot], first_s: float, step_s: float, num: int,
             closed_until_s: float) -> tuple[list[Point], dict[str, Any], dict[str, Any]]:
        """The window's ``num`` points from ``first_s``, its series and its routing; the
        frame keeps the points that will not change (they end by ``closed_until_s``)."""
        self.advance(ring, first_s, step_s, num, closed_until_s)
        groups = _slots_by_point(ring, first_s, step_s, len(self.points))
        tail = [point_of(first_s + i * step_s, groups.get(i, ()))
                for i in range(len(self.points), num)]
        return self.points + tail, _series(self, tail), _routing(self, tail)

    def advance(self, ring: Sequence[Slot], first_s: float, step_s: float, num: int,
                closed_until_s: float, max_points: int | None = None) -> bool:
        """Slide to ``first_s`` and keep the points that finished since, at most
        ``max_points`` of them; whether it has kept them all."""
        self.drop_before(first_s)
        if self.points and self.points[0].start_s != first_s:  # the clock went back
            self.__init__()  # type: ignore[misc]
        done = len(self.points)
        finished = min(num, math.floor((closed_until_s - first_s) / step_s))
        upto = finished if max_points is None else min(finished, done + max_points)
        if upto > done:
            groups = _slots_by_point(ring, first_s, step_s, done)
            for i in range(done, upto):
                self.append(point_of(first_s + i * step_s, groups.get(i, ())))
        return upto >= finished


def _slots_by_point(ring: Sequence[Slot], first_s: float, step_s: float, from_point: int
                    ) -> dict[int, list[Slot]]:
    """The ring's slots of the points from ``from_point`` on, by point, oldest first."""
    since = first_s + from_point * step_s
    groups: dict[int, list[Slot]] = {}
    for slot in reversed(ring):  # newest first, down to what is asked
        if slot.start_s < since:
            break
        groups.setdefault(math.floor((slot.start_s - first_s) / step_s), []).insert(0, slot)
    return groups


def _series(frame: Frame, tail: list[Point]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, table in frame.series.items():
        keys = set(table) | {k for p in tail for k in p.values.get(name, ())}
        columns = {}
        for key in sorted(keys, key=str):
            head = table.get(key) or [p.missing(name) for p in frame.points]
            columns[key] = head + [p.values[name].get(key, p.missing(name)) if p.covered
                                   else None for p in tail]
        out[name] = columns
    for name in ("ttft_s", "tpot_s"):
        nested: dict[str, dict[str, dict[str, list[Any]]]] = {"worker": {}, "domain": {}}
        for (kind, key, pname), values in out[name].items():
            nested[kind].setdefault(key, {})[pname] = values
        out[name] = nested
    return out


def _routing(frame: Frame, tail: list[Point]) -> dict[str, Any]:
    """The window's domain x worker counts, and the decision reasons of each cell."""
    total = dict(frame.routed)
    for p in tail:
        add_counts(total, p.routed)
    matrix: dict[str, dict[str, int]] = {}
    reasons: dict[str, dict[str, dict[str, int]]] = {}
    for (domain, worker, reason), n in total.items():
        row = matrix.setdefault(domain, {})
        row[worker] = row.get(worker, 0) + n
        cell = reasons.setdefault(domain, {}).setdefault(worker, {})
        cell[reason or "none"] = cell.get(reason or "none", 0) + n
    return {"matrix": matrix, "reasons": reasons}
