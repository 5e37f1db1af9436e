"""One slot of the proxy's history: what happened in an interval, mergeable by adding up.

Latencies are counted in log-spaced buckets (ratio ``BUCKET_RATIO`` between edges) so
that slots merge into longer ones exactly and percentiles come out within 10% of the
sample they stand for: enough for a chart, and bounded (``NUM_BUCKETS`` per series),
which samples are not.
"""

from __future__ import annotations

import math
from collections import Counter
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


def count_latency(latency: dict[tuple[str, str, str], Counter[int]], by_worker: tuple[str, str, str],
           by_domain: tuple[str, str, str], bucket: int) -> None:
    for key in (by_worker, by_domain):
        hist = latency.get(key)
        if hist is None:
            latency[key] = Counter({bucket: 1})
        else:
            hist[bucket] += 1


def bucket_value(i: int) -> float:
    """What bucket ``i`` stands for: its geometric middle (within R^0.5 of any member)."""
    return MIN_LATENCY_S if i == 0 else MIN_LATENCY_S * BUCKET_RATIO ** (i - 0.5)


BUCKET_VALUES = tuple(float(f"{bucket_value(i):.4g}") for i in range(NUM_BUCKETS))  # 4 digits


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
    prediction_error: dict[str, float] = field(default_factory=dict)  # latency -> at the end

    def merge(self, other: Slot) -> None:
        self.span_s += other.span_s
        add_counts(self.requests, other.requests)
        add_counts(self.errors, other.errors)
        add_counts(self.refused, other.refused)
        add_counts(self.routed, other.routed)
        _add_pairs(self.depth, other.depth)
        _add_pairs(self.gauges, other.gauges)
        _add_pairs(self.tokens, other.tokens)
        for key, hist in other.latency.items():
            mine = self.latency.get(key)
            if mine is None:
                self.latency[key] = Counter(hist)
            else:
                add_counts(mine, hist)
        self.prediction_error.update(other.prediction_error)


def add_counts(into: dict[Any, int], other: Mapping[Any, int]) -> None:
    """``Counter.update`` for a mapping, without its per-call checks (merges are hot)."""
    get = into.get
    for key, n in other.items():
        into[key] = get(key, 0) + n


def _add_pairs(into: dict[Any, list[float]], other: Mapping[Any, list[float]]) -> None:
    for key, (a, b) in other.items():
        pair = into.setdefault(key, [0.0, 0.0])
        pair[0] += a
        pair[1] += b
