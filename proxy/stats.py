"""Request statistics behind ``/stats``, ``/metrics`` and the dashboard.

Recording is a handful of counter increments and ring-buffer writes per
request; percentiles and histograms are computed only when someone asks.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from itertools import repeat
from typing import TYPE_CHECKING, Any

import numpy as np

from polyinfer.trace import STATUS_OK
from proxy.history import History
from proxy.record import RequestRecord

if TYPE_CHECKING:
    from proxy.pool import WorkerPool

# Histogram bucket upper bounds, seconds (exported as Prometheus histograms).
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0, 30.0, 60.0)
WINDOW = 4096  # latest samples kept per series for percentiles
FOLD_SAMPLES = 256  # samples appended before they are folded in (LatencySeries)
ALL = "all"


class LatencySeries:
    """Count, sum, bucket counts (since start) and a ring of the latest samples (seconds).

    NOTE: a sample is appended to a list and folded into the count, sum, buckets and ring
    in batches (``FOLD_SAMPLES``, or when any of them is read): every request adds six
    samples, and the fold's C loops cost a fraction of a per-sample update in Python. The
    values are the per-sample updates' (the sum added in the same order).
    """

    __slots__ = ("_count", "_sum", "_buckets", "_ring", "_new")

    def __init__(self) -> None:
        self._count = 0
        self._sum = 0.0
        self._buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)  # last = +Inf
        self._ring: deque[float] = deque(maxlen=WINDOW)
        self._new: list[float] = []  # samples not yet folded in

    def add(self, value_s: float) -> None:
        new = self._new
        new.append(value_s)
        if len(new) >= FOLD_SAMPLES:
            self._fold()

    def add_pair(self, other: LatencySeries, value_s: float) -> None:
        """``self.add(value_s); other.add(value_s)`` in one call (the "all" series and a
        worker's, for every request)."""
        new, other_new = self._new, other._new
        new.append(value_s)
        other_new.append(value_s)
        if len(new) >= FOLD_SAMPLES:
            self._fold()
        if len(other_new) >= FOLD_SAMPLES:
            other._fold()

    def _fold(self) -> None:
        new = self._new
        if not new:
            return
        self._new = []
        self._count += len(new)
        self._sum = sum(new, self._sum)
        buckets = self._buckets
        for bucket, n in Counter(map(bisect.bisect_left, repeat(LATENCY_BUCKETS_S), new)).items():
            buckets[bucket] += n
        self._ring.extend(new)

    @property
    def count(self) -> int:
        self._fold()
        return self._count

    @property
    def sum(self) -> float:
        self._fold()
        return self._sum

    @property
    def buckets(self) -> list[int]:
        """Samples per bucket of ``LATENCY_BUCKETS_S`` (not cumulative), +Inf last."""
        self._fold()
        return self._buckets

    def recent(self) -> list[float]:
        """The latest ``WINDOW`` samples, oldest first."""
        self._fold()
        return list(self._ring)

    def percentiles(self) -> dict[str, float | None]:
        self._fold()
        if not self._ring:
            return {"p50": None, "p90": None, "p99": None, "mean": None, "count": 0}
        p50, p90, p99 = np.percentile(np.fromiter(self._ring, float, len(self._ring)),
                                      [50, 90, 99])
        return {"p50": float(p50), "p90": float(p90), "p99": float(p99),
                "mean": self._sum / self._count, "count": self._count}


class Stats:
    """Everything counted per request; one instance per app."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.requests: Counter[tuple[str, str, str]] = Counter()  # (worker, domain, status)
        self.errors: Counter[tuple[str, str]] = Counter()  # (worker, error kind)
        self.rejected: Counter[int] = Counter()  # HTTP status of requests refused by the proxy
        self.reasons: Counter[str] = Counter()
        self.spec_depths: Counter[str] = Counter()  # depth sent, "default" when none
        self.spec_tokens: dict[tuple[str, str], list[int]] = {}  # (worker, domain) -> [draft, acc]
        # (model, worker) -> [prompt, generated] tokens: the worker's usage counts, else (prompt
        # tokens of a request without usage) the shape's estimate
        self.tokens: dict[tuple[str, str], list[int]] = {}
        self.retries = 0
        # the proxy's admission queue (proxy.admission): waiting now, ever waited, seconds
        self.queue_waiting = 0
        self.queued = 0
        self.queued_s = 0.0
        self.latency: dict[str, dict[str, LatencySeries]] = {
            m: {ALL: LatencySeries()} for m in ("ttft", "tpot", "e2e")}
        self.history = History()  # the dashboard's per-second rings
        self._by_worker: dict[str, tuple[LatencySeries, ...]] = {}  # record()'s series

    def refused_at_door(self, http_status: int) -> None:
        """A request refused before it was parsed: counted as a refusal, with no record."""
        self.rejected[http_status] += 1
        self.history.refuse(str(http_status))

    def record(self, rec: RequestRecord) -> None:
        self.history.record(rec)
        worker = rec.worker or "none"
        domain = rec.domain or "none"
        self.requests[(worker, domain, rec.status)] += 1
        if rec.num_attempts > 1:
            self.retries += rec.num_attempts - 1
        if rec.status != STATUS_OK:
            self.errors[(worker, rec.error.split(":", 1)[0] or rec.status)] += 1
        if not rec.worker:
            self.rejected[rec.http_status] += 1
            return
        self.reasons[rec.reason] += 1
        prompt = rec.usage_prompt_tokens
        if prompt is None and rec.shape is not None:
            prompt = rec.shape.prompt_tokens
        pair = self.tokens.get((rec.model, worker))
        if pair is None:  # NOTE: not setdefault: its default list is made on every call
            pair = self.tokens[(rec.model, worker)] = [0, 0]
        pair[0] += prompt or 0
        pair[1] += rec.completion_tokens or 0
        self.spec_depths["default" if rec.spec_depth is None else str(rec.spec_depth)] += 1
        if rec.spec_draft_tokens:
            pair = self.spec_tokens.setdefault((worker, domain), [0, 0])
            pair[0] += rec.spec_draft_tokens
            pair[1] += rec.spec_accepted_tokens
        if rec.status == STATUS_OK:
            # NOTE: each latency added to the "all" series and the worker's (found once per
            # request, not per metric): this runs for every request
            both = self._by_worker.get(worker)
            if both is None:
                both = self._by_worker[worker] = self._worker_series(worker)
            value_s = rec.ttft_s
            if value_s is not None:
                both[0].add_pair(both[1], value_s)
            value_s = rec.tpot_s
            if value_s is not None:
                both[2].add_pair(both[3], value_s)
            value_s = rec.e2e_s
            if value_s is not None:
                both[4].add_pair(both[5], value_s)

    def _worker_series(self, worker: str) -> tuple[LatencySeries, ...]:
        """(ttft all, ttft worker, tpot all, tpot worker, e2e all, e2e worker)."""
        out: list[LatencySeries] = []
        for metric in ("ttft", "tpot", "e2e"):
            series = self.latency[metric]
            per_worker = series.get(worker)
            if per_worker is None:
                per_worker = series[worker] = LatencySeries()
            out += (series[ALL], per_worker)
        return tuple(out)

    def snapshot(self, pool: WorkerPool, policy_name: str) -> dict[str, Any]:
        """The /stats JSON document."""
        per_worker: Counter[str] = Counter()
        per_domain: Counter[str] = Counter()
        per_pair: dict[str, dict[str, int]] = {}
        for (worker, domain, _status), n in self.requests.items():
            per_worker[worker] += n
            per_domain[domain] += n
            per_pair.setdefault(domain, {})
            per_pair[domain][worker] = per_pair[domain].get(worker, 0) + n
        return {
            "policy": policy_name,
            "in_flight": self.in_flight,
            "requests_total": sum(self.requests.values()),
            "requests_by_status": _count_by(self.requests, 2),
            "requests_by_worker": dict(per_worker),
            "requests_by_domain": dict(per_domain),
            "requests_by_domain_worker": per_pair,
            "errors": {f"{w}/{k}": n for (w, k), n in self.errors.items()},
            "rejected_by_status": {str(k): n for k, n in self.rejected.items()},
            "retries": self.retries,
            "admission": {"waiting": self.queue_waiting, "queued_total": self.queued,
                          "queued_seconds_total": round(self.queued_s, 6)},
            "decision_reasons": dict(self.reasons),
            "spec_depths": dict(self.spec_depths),
            "acceptance": self._acceptance(),
            "latency_s": {m: {w: s.percentiles() for w, s in series.items()}
                          for m, series in self.latency.items()},
            "workers": [worker_doc(w) for w in pool.workers.values()],
        }

    def _acceptance(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for (worker, domain), (draft, accepted) in self.spec_tokens.items():
            out.setdefault(worker, {})[domain] = {
                "draft_tokens": draft, "accepted_tokens": accepted,
                "rate": accepted / draft if draft else None}
        return out


def _count_by(counter: Counter[tuple[str, str, str]], index: int) -> dict[str, int]:
    out: Counter[str] = Counter()
    for key, n in counter.items():
        out[key[index]] += n
    return dict(out)


def worker_doc(w: Any) -> dict[str, Any]:
    v = w.view
    w.refresh_health(time.monotonic())
    drafted = w.scraped_draft_tokens
    return {
        "name": w.name, "url": w.url, "backend": v.backend, "models": sorted(w.models),
        "healthy": v.healthy, "probe_ok": w.probe_ok, "draining": v.draining,
        "breaker": w.breaker.state, "outstanding_requests": v.outstanding_requests,
        "outstanding_tokens": v.outstanding_tokens, "running": v.running,
        "waiting": v.waiting, "kv_cache_usage": v.kv_cache_usage,
        "spec_acceptance_scraped": (w.scraped_accepted_tokens / drafted) if drafted else None,
        "restarts": w.supervisor.num_restarts if w.supervisor is not None else None,
        "pid": w.supervisor.pid if w.supervisor is not None else None,
        "spec_method": v.config.engine.spec_method if v.backend == "engine" else None,
    }
