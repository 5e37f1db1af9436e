"""Traces -> a traffic profile and a representative (stratified) replay sample.

Input is the proxy's trace record (:mod:`polyinfer.trace`), one JSON object per
line, from files or handed over live by the proxy. A bad line (not JSON, a missing or
ill-typed field, an unknown domain) is reported with its file and line number
and skipped; it never stops the read.

Example::

    read = read_trace_files(["traces/today.jsonl"])
    for bad in read.bad_lines: logger.warning("%s", bad)
    profile = build_profile(read.records)
    sample = stratified_sample(read.records, 32, seed=0)
"""

from __future__ import annotations

import logging
import math
import os
import random
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from optimizer.errors import TraceError
from polyinfer.config import DOMAINS
from polyinfer.trace import TraceRecord, parse_record

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BadLine:
    source: str  # file path or "live"
    line_no: int  # 1-based
    reason: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line_no}: {self.reason}"


@dataclass(frozen=True)
class TraceRead:
    records: list[TraceRecord]
    bad_lines: list[BadLine]


def profile_record(obj: Any) -> TraceRecord:
    """One decoded trace line -> a record the profile can use; ValueError names the bad field."""
    return checked_record(parse_record(obj))


def checked_record(record: TraceRecord) -> TraceRecord:
    """``record`` if it has what a profile needs (a known domain, a prompt length)."""
    if record.domain not in DOMAINS:
        raise ValueError(f"domain: expected one of {DOMAINS}, got {record.domain!r}")
    if record.prompt_tokens is None:
        raise ValueError("prompt_tokens: expected a non-negative integer, got None")
    return record


def parse_lines(lines: Iterable[bytes | str], source: str, first_line_no: int = 1) -> TraceRead:
    records: list[TraceRecord] = []
    bad: list[BadLine] = []
    for line_no, line in enumerate(lines, start=first_line_no):
        if not line.strip():
            continue
        try:
            records.append(profile_record(orjson.loads(line)))
        except orjson.JSONDecodeError as e:
            bad.append(BadLine(source, line_no, f"not JSON ({e})"))
        except ValueError as e:
            bad.append(BadLine(source, line_no, str(e)))
    return TraceRead(records, bad)


def read_trace_files(paths: Sequence[str | Path]) -> TraceRead:
    """Read JSONL trace files; unreadable files raise TraceError, bad lines are reported."""
    records: list[TraceRecord] = []
    bad: list[BadLine] = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                read = parse_lines(f, str(path))
        except OSError as e:
            raise TraceError(f"{path}: cannot read trace file ({e.strerror})") from e
        records.extend(read.records)
        bad.extend(read.bad_lines)
    for b in bad[:20]:
        logger.warning("skipped bad trace line %s", b)
    if len(bad) > 20:
        logger.warning("skipped %d more bad trace lines", len(bad) - 20)
    return TraceRead(records, bad)


class TraceTail:
    """Reads only the lines appended to a trace file since the last call (for live files)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0  # bytes
        self._line_no = 0

    def read_new(self) -> TraceRead:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._offset:
                    # NOTE: truncated or rotated: start over from the top of the new file.
                    logger.info("%s shrank: reading it from the start", self.path)
                    self._offset, self._line_no = 0, 0
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return TraceRead([], [])
        except OSError as e:
            raise TraceError(f"{self.path}: cannot read trace file ({e.strerror})") from e
        complete = data[: data.rfind(b"\n") + 1]  # NOTE: a half-written last line waits
        self._offset += len(complete)
        lines = complete.split(b"\n")[:-1] if complete else []
        read = parse_lines(lines, str(self.path), self._line_no + 1)
        self._line_no += len(lines)
        return read


@dataclass(frozen=True)
class LengthStats:
    """Distribution of a token count."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: int

    @classmethod
    def of(cls, values: Sequence[int]) -> LengthStats:
        if not values:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0)
        s = sorted(values)
        return cls(len(s), sum(s) / len(s), _quantile(s, 0.5), _quantile(s, 0.9),
                   _quantile(s, 0.99), s[-1])


def _quantile(sorted_values: Sequence[int], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return float(sorted_values[idx])


@dataclass(frozen=True)
class TrafficProfile:
    """What the traffic looks like; the optimizer tunes for this."""

    num_requests: int
    duration_s: float  # last arrival - first arrival
    arrival_rate_rps: float  # requests per second over the window
    domain_mix: dict[str, float]  # fraction of requests per domain, sums to 1
    prompt_tokens: LengthStats
    output_tokens: LengthStats
    prompt_tokens_by_domain: dict[str, float] = field(default_factory=dict)  # mean
    output_tokens_by_domain: dict[str, float] = field(default_factory=dict)  # mean
    acceptance_by_domain: dict[str, float] = field(default_factory=dict)  # accepted / drafted
    error_rate: float = 0.0
    mean_concurrency: float = 0.0  # Little's law: rate x mean e2e, when e2e is known

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict
        return asdict(self)


def build_profile(records: Sequence[TraceRecord]) -> TrafficProfile:
    if not records:
        return TrafficProfile(0, 0.0, 0.0, {}, LengthStats.of([]), LengthStats.of([]))
    ts = [r.ts for r in records]
    duration = max(ts) - min(ts)
    rate = (len(records) - 1) / duration if duration > 0 else 0.0
    counts = Counter(r.domain for r in records)
    ok = [r for r in records if r.status == "ok"] or list(records)
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    return TrafficProfile(
        num_requests=len(records), duration_s=duration, arrival_rate_rps=rate,
        domain_mix={d: n / len(records) for d, n in sorted(counts.items())},
        prompt_tokens=LengthStats.of([r.prompt_tokens or 0 for r in records]),
        output_tokens=LengthStats.of([r.output_tokens for r in ok]),
        prompt_tokens_by_domain=_mean_by_domain(records, lambda r: r.prompt_tokens),
        output_tokens_by_domain=_mean_by_domain(ok, lambda r: r.output_tokens),
        acceptance_by_domain=_acceptance_by_domain(records),
        error_rate=sum(r.status != "ok" for r in records) / len(records),
        mean_concurrency=rate * (sum(e2e) / len(e2e)) if e2e and rate else 0.0,
    )


def _mean_by_domain(records: Sequence[TraceRecord], value: Any) -> dict[str, float]:
    sums: dict[str, list[float]] = defaultdict(list)
    for r in records:
        sums[r.domain].append(value(r))
    return {d: sum(v) / len(v) for d, v in sorted(sums.items())}


def _acceptance_by_domain(records: Sequence[TraceRecord]) -> dict[str, float]:
    drafted: Counter[str] = Counter()
    accepted: Counter[str] = Counter()
    for r in records:
        drafted[r.domain] += r.spec_draft_tokens
        accepted[r.domain] += r.spec_accepted_tokens
    return {d: accepted[d] / n for d, n in sorted(drafted.items()) if n > 0}


def profile_distance(a: TrafficProfile, b: TrafficProfile) -> float:
    """How different two traffic profiles are, 0 = same; ~0.3 or more is a real shift.

    Total-variation distance of the domain mixes plus the relative changes of
    mean prompt and output length and, when both are known, of the mean
    concurrency (each capped at 1): the same requests at another load want
    other knobs (and another objective, see OptimizerConfig.objective).
    """
    domains = set(a.domain_mix) | set(b.domain_mix)
    tv = 0.5 * sum(abs(a.domain_mix.get(d, 0.0) - b.domain_mix.get(d, 0.0)) for d in domains)
    load = (_rel(a.mean_concurrency, b.mean_concurrency)
            if a.mean_concurrency > 0 and b.mean_concurrency > 0 else 0.0)
    return tv + _rel(a.prompt_tokens.mean, b.prompt_tokens.mean) + _rel(
        a.output_tokens.mean, b.output_tokens.mean) + load


def _rel(x: float, y: float) -> float:
    hi = max(abs(x), abs(y))
    return min(1.0, abs(x - y) / hi) if hi > 0 else 0.0


def stratified_sample(records: Sequence[TraceRecord], n: int, seed: int = 0) -> list[TraceRecord]:
    """``n`` records keeping the domain mix, and within a domain the spread of prompt lengths.

    Each domain gets a share proportional to its count (largest remainder, at
    least one for a domain that exists when n allows); within a domain the
    records are sorted by prompt length and one is drawn from each of the
    equal-sized strata. Deterministic for a given seed.
    """
    if n <= 0 or not records:
        return []
    by_domain: dict[str, list[TraceRecord]] = defaultdict(list)
    for r in records:
        by_domain[r.domain].append(r)
    quotas = _allocate(n if n < len(records) else len(records),
                       {d: len(v) for d, v in by_domain.items()})
    rng = random.Random(seed)
    out: list[TraceRecord] = []
    for domain in sorted(quotas):
        out.extend(_strata_draw(sorted(by_domain[domain], key=lambda r: r.prompt_tokens or 0),
                                quotas[domain], rng))
    rng.shuffle(out)
    return out


def _allocate(n: int, sizes: Mapping[str, int]) -> dict[str, int]:
    total = sum(sizes.values())
    exact = {d: n * s / total for d, s in sizes.items()}
    quotas = {d: min(sizes[d], int(v)) for d, v in exact.items()}
    if n >= len(sizes):
        for d in quotas:
            quotas[d] = max(quotas[d], 1)
    order = sorted(exact, key=lambda d: (exact[d] - int(exact[d]), sizes[d]), reverse=True)
    i = 0
    while sum(quotas.values()) < n and i < 10 * len(order):
        d = order[i % len(order)]
        if quotas[d] < sizes[d]:
            quotas[d] += 1
        i += 1
    while sum(quotas.values()) > n:
        d = max(quotas, key=lambda k: quotas[k])
        quotas[d] -= 1
    return quotas


def _strata_draw(sorted_records: list[TraceRecord], k: int, rng: random.Random) -> list[TraceRecord]:
    if k <= 0:
        return []
    size = len(sorted_records) / k
    return [sorted_records[int(i * size) + rng.randrange(max(1, int((i + 1) * size) - int(i * size)))]
            for i in range(k)]
