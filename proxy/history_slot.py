"""One slot of the proxy's history: what happened in an interval, mergeable by adding up.

Latencies are counted in log-spaced buckets (ratio ``BUCKET_RATIO`` between edges) so
that slots merge into longer ones exactly and percentiles come out within 10% of the
sample they stand for: enough for a chart, and bounded (``NUM_BUCKETS`` per series),
which samples are not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MIN_LATENCY_S = 1e-4  # bucket 0 holds everything at or below this
BUCKET_RATIO = 1.2
NUM_BUCKETS = 84  # the last bucket holds everything above ~440 s
_PER_LOG_RATIO = 1.0 / math.log(BUCKET_RATIO)
_PER_MIN = 1.0 / MIN_LATENCY_S


def bucket_of(value_s: float) -> int:
    """The histogram bucket of a latency: bucket i >= 1 holds (MIN * R^(i-1), MIN * R^i]."""
    if not value_s > MIN_LATENCY_S:  # NaN lands here too
        return 0
    i = math.ceil(math.log(value_s * _PER_MIN) * _PER_LOG_RATIO)
    return i if i < NUM_BUCKETS else NUM_BUCKETS - 1


def count_latency(latency: dict[tuple[str, str, str], dict[int, int]],
                  by_worker: tuple[str, str, str], by_domain: tuple[str, str, str],
                  bucket: int) -> None:
    for key in (by_worker, by_domain):
        hist = latency.get(key)
        if hist is None:
            latency[key] = {bucket: 1}
        else:
            hist[bucket] = hist.get(bucket, 0) + 1


def bucket_value(i: int) -> float:
    """What bucket ``i`` stands for: its geometric middle (within R^0.5 of any member)."""
    return MIN_LATENCY_S if i == 0 else MIN_LATENCY_S * BUCKET_RATIO ** (i - 0.5)


BUCKET_VALUES = tuple(float(f"{bucket_value(i):.4g}") for i in range(NUM_BUCKETS))  # 4 digits


@dataclass(slots=True)
class Slot:
    """What happened in one interval; slots merge into longer ones by adding up.

    NOTE: every table is a plain dict of numbers (no lists, no Counters), so that once a
    slot is closed the garbage collector stops tracking its tables: a full hour of slots
    must not make each of the proxy's full collections longer.
    """

    start_s: float  # unix seconds
    span_s: float = 0.0  # seconds covered (a merged slot: the sum of its parts)
    requests: dict[str, int] = field(default_factory=dict)  # worker -> finished
    errors: dict[str, int] = field(default_factory=dict)  # worker -> status "error"
    refused: dict[str, int] = field(default_factory=dict)  # HTTP status -> no worker tried
    routed: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (domain, worker, reason)
    depth_sum: dict[str, float] = field(default_factory=dict)  # domain -> speculative depths sent
    depth_num: dict[str, int] = field(default_factory=dict)  # domain -> requests with a depth
    # (metric, "worker" | "domain", name) -> bucket -> requests
    latency: dict[tuple[str, str, str], dict[int, int]] = field(default_factory=dict)
    gauge_sum: dict[tuple[str, str], float] = field(default_factory=dict)  # (gauge, worker)
    gauge_num: dict[tuple[str, str], int] = field(default_factory=dict)  # samples of it
    drafted: dict[str, float] = field(default_factory=dict)  # domain -> tokens
    accepted: dict[str, float] = field(default_factory=dict)
    prediction_error: dict[str, float] = field(default_factory=dict)  # latency -> at the end

    def merge(self, other: Slot) -> None:
        self.span_s += other.span_s
        for mine, theirs in ((self.requests, other.requests), (self.errors, other.errors),
                             (self.refused, other.refused), (self.routed, other.routed),
                             (self.depth_sum, other.depth_sum), (self.depth_num, other.depth_num),
                             (self.gauge_sum, other.gauge_sum), (self.gauge_num, other.gauge_num),
                             (self.drafted, other.drafted), (self.accepted, other.accepted)):
            add_counts(mine, theirs)  # type: ignore[arg-type]
        for key, hist in other.latency.items():
            known = self.latency.get(key)
            if known is None:
                self.latency[key] = dict(hist)
            else:
                add_counts(known, hist)
        self.prediction_error.update(other.prediction_error)


def add_counts(into: dict[Any, Any], other: Mapping[Any, Any]) -> None:
    """``Counter.update`` for plain dicts of numbers."""
    get = into.get
    for key, n in other.items():
        into[key] = get(key, 0) + n
