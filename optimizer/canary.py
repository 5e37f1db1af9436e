"""Per-shape canary: live traffic on a new config against what the incumbent did, shape by shape.

After a switch, the requests the proxy routed to the worker are grouped by the
router's shape class (domain, prompt band: :func:`router.profiles.prompt_band`)
and each shape's TTFT, TPOT and errors on the new config are compared with the
same shape's on the incumbent just before the switch. A whole-worker average
hides a regression on one shape under a mix that moved, or under gains on the
others; per shape it cannot.

The rule, per shape and metric (NOTE: stated so an operator can check it):

- latency (TTFT, TPOT): Welch's one-sided t-test on log seconds. The new config
  regressed when the lower confidence bound of ``after / before`` (geometric
  means) lies above ``1 + max_regression`` (the promotion's ``max_tpot_regression``
  and ``max_ttft_regression``, +15% and +50% by default):
  the slow-down is both beyond noise and beyond what is tolerated. Both sides
  need ``min_samples`` requests of that shape.
- a trade is not a regression: a shape whose end-to-end time improved beyond
  noise (the upper confidence bound of its ``after / before`` below 1) keeps the
  new config even if its TTFT or TPOT got worse. Batching more sequences is
  the usual case: each token comes later, but the request no longer queues,
  so it finishes sooner.
- errors: the new config regressed when at least ``min_errors`` of the shape's
  requests failed and that many or more are unlikely under the incumbent's
  rate, ``P(X >= e | Binomial(n, p0)) < alpha'``, with ``p0 = (e0 + 1) / (n0 + 2)``
  (the incumbent's rate, Laplace-smoothed so a clean incumbent is not rate 0).
- ``alpha' = alpha / (shapes x 4 tests x looks)``: Bonferroni over every test
  the watch may run, so repeated looks at a growing sample do not inflate the
  false-rollback rate beyond ``alpha``.

Example::

    canary = ShapeCanary(CanaryConfig(), before_records, {"ttft_s": 0.5, "tpot_s": 0.15}, looks=6)
    verdict = canary.judge(after_records)
    verdict.regressed          # the first shape/metric beyond the rule, or None
    verdict.table()            # per shape: n, geometric means, ratios (JSON-able)
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from scipy import stats

from polyinfer.trace import STATUS_CANCELLED, STATUS_OK, TraceRecord
from router.profiles import PROMPT_BANDS, prompt_band

METRICS = ("ttft_s", "tpot_s")  # judged
LATENCIES = (*METRICS, "e2e_s")  # compared


@dataclass(frozen=True)
class CanaryConfig:
    min_samples: int = 8  # requests of a shape on each side before its latency is judged
    alpha: float = 0.05  # false-rollback rate over all the watch's tests (Bonferroni)
    min_errors: int = 2  # failed requests of a shape before its error rate is judged
    before_window_s: float = 600.0  # incumbent records younger than this are the baseline
    max_before_samples: int = 200  # the newest per shape

    def __post_init__(self) -> None:
        if not (self.min_samples >= 2 and 0 < self.alpha < 1 and self.min_errors >= 1
                and self.before_window_s > 0 and self.max_before_samples >= self.min_samples):
            raise ValueError(f"canary: inconsistent config {self}")


Shape = tuple[str, int]  # (domain, prompt band)


def shape_of(record: TraceRecord) -> Shape:
    return record.domain, prompt_band(record.prompt_tokens or 0)


def shape_name(shape: Shape) -> str:
    domain, band = shape
    lo = 0 if band == 0 else PROMPT_BANDS[band - 1]
    hi = f"{PROMPT_BANDS[band]}" if band < len(PROMPT_BANDS) else "inf"
    return f"{domain}/prompt {lo}-{hi}"


@dataclass
class _Side:
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    num: int = 0  # finished requests (ok or failed; client cancels excluded)
    num_errors: int = 0


def _group(records: Iterable[TraceRecord]) -> dict[Shape, _Side]:
    out: dict[Shape, _Side] = defaultdict(_Side)
    for r in records:
        if r.status == STATUS_CANCELLED:
            continue
        side = out[shape_of(r)]
        side.num += 1
        if r.status != STATUS_OK:
            side.num_errors += 1
            continue
        for metric in LATENCIES:
            value = getattr(r, metric)
            if value is not None and value > 0:
                getattr(side, metric).append(value)
    return out


def baseline(records: Sequence[TraceRecord], switch_start_unix: float,
             cfg: CanaryConfig) -> list[TraceRecord]:
    """The incumbent's records: finished before the switch began, within the window,
    the newest ``max_before_samples`` of each shape."""
    kept: dict[Shape, list[TraceRecord]] = defaultdict(list)
    for r in sorted(records, key=lambda r: r.ts, reverse=True):
        end = r.ts + (r.e2e_s or 0.0)
        if end > switch_start_unix or r.ts < switch_start_unix - cfg.before_window_s:
            continue
        shape = kept[shape_of(r)]
        if len(shape) < cfg.max_before_samples:
            shape.append(r)
    return [r for rs in kept.values() for r in rs]


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile with upper tail ``p``."""
    return float(stats.t.isf(p, df))


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return float(stats.binom.sf(k - 1, n, p))


@dataclass(frozen=True)
class Finding:
    shape: str
    metric: str  # "ttft_s" | "tpot_s" | "errors"
    before: float  # geometric-mean seconds, or error rate
    after: float
    ratio_low: float  # one-sided lower confidence bound of after / before (latency)
    ratio_high: float  # and upper
    num_before: int
    num_after: int
    p_value: float | None = None  # errors only

    def reason(self) -> str:
        if self.metric == "errors":
            return (f"shape {self.shape}: errors {self.after:.0%} of {self.num_after} vs "
                    f"{self.before:.0%} of {self.num_before} before (p={self.p_value:.2g})")
        what = "TTFT" if self.metric == "ttft_s" else "TPOT"
        return (f"shape {self.shape}: live {what} {self.after:.4f}s vs {self.before:.4f}s "
                f"before (x{self.after / self.before:.2f}, lower bound x{self.ratio_low:.2f}; "
                f"n={self.num_after} vs {self.num_before})")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"shape": self.shape, "metric": self.metric,
                               "before": round(self.before, 5), "after": round(self.after, 5),
                               "num_before": self.num_before, "num_after": self.num_after}
        if self.p_value is not None:
            return {**out, "p_value": self.p_value}
        return {**out, "ratio_low": round(self.ratio_low, 3),
                "ratio_high": round(self.ratio_high, 3)}


@dataclass(frozen=True)
class Verdict:
    regressed: Finding | None
    shapes: dict[str, dict[str, Any]]  # shape -> per-metric comparison, JSON-able
    num_judged: int  # shape x metric comparisons with enough samples on both sides
    alpha_per_test: float

    def table(self) -> dict[str, dict[str, Any]]:
        return self.shapes


class ShapeCanary:
    def __init__(self, cfg: CanaryConfig, before: Iterable[TraceRecord],
                 max_regression: dict[str, float], looks: int = 1) -> None:
        self.cfg = cfg
        self.max_regression = max_regression  # metric -> tolerated slow-down (0.15 = +15%)
        self.before = _group(before)
        tests = max(1, len(self.before)) * (len(LATENCIES) + 1) * max(1, looks)
        self.alpha_per_test = cfg.alpha / tests

    def ready(self, after: Iterable[TraceRecord]) -> bool:
        """Every baseline shape with enough samples has as many after the switch."""
        now = _group(after)
        return all(len(now[s].ttft_s) >= self.cfg.min_samples
                   for s, side in self.before.items() if len(side.ttft_s) >= self.cfg.min_samples)

    def judge(self, after: Iterable[TraceRecord]) -> Verdict:
        now = _group(after)
        shapes: dict[str, dict[str, Any]] = {}
        found: list[Finding] = []
        judged = 0
        for shape in sorted(set(self.before) | set(now)):
            b, a = self.before.get(shape, _Side()), now.get(shape, _Side())
            row: dict[str, Any] = {"requests": [b.num, a.num], "errors": [b.num_errors,
                                                                          a.num_errors]}
            name = shape_name(shape)
            e2e = self._latency(name, "e2e_s", b.e2e_s, a.e2e_s)
            if e2e is not None:
                row["e2e_s"] = e2e.to_dict()
            faster = e2e is not None and e2e.ratio_high < 1.0
            for metric in METRICS:
                f = self._latency(name, metric, getattr(b, metric), getattr(a, metric))
                if f is not None:
                    judged += 1
                    row[metric] = f.to_dict()
                    if f.ratio_low > 1.0 + self.max_regression[metric] and not faster:
                        found.append(f)
            err = self._errors(shape_name(shape), b, a)
            if err is not None:
                row["errors_p"] = err.p_value
                if err.p_value is not None and err.p_value < self.alpha_per_test:
                    found.append(err)
            shapes[shape_name(shape)] = row
        worst = max(found, key=lambda f: f.ratio_low if f.metric != "errors" else math.inf,
                    default=None)
        return Verdict(worst, shapes, judged, self.alpha_per_test)

    def _latency(self, shape: str, metric: str, before: list[float],
                 after: list[float]) -> Finding | None:
        n0, n1 = len(before), len(after)
        if min(n0, n1) < self.cfg.min_samples:
            return None
        x, y = [math.log(v) for v in before], [math.log(v) for v in after]
        v0, v1 = statistics.variance(x) / n0, statistics.variance(y) / n1
        se = math.sqrt(v0 + v1) or 1e-9
        df = (v0 + v1) ** 2 / ((v0 ** 2 / (n0 - 1) + v1 ** 2 / (n1 - 1)) or 1e-18)
        diff = statistics.fmean(y) - statistics.fmean(x)
        half = t_quantile(self.alpha_per_test, max(df, 1.0)) * se
        return Finding(shape, metric, math.exp(statistics.fmean(x)),
                       math.exp(statistics.fmean(y)), math.exp(diff - half),
                       math.exp(diff + half), n0, n1)

    def _errors(self, shape: str, before: _Side, after: _Side) -> Finding | None:
        if after.num == 0 or after.num_errors < self.cfg.min_errors:
            return None
        p0 = (before.num_errors + 1) / (before.num + 2)
        p = binomial_tail(after.num_errors, after.num, p0)
        return Finding(shape, "errors", before.num_errors / max(1, before.num),
                       after.num_errors / after.num, 0.0, math.inf, before.num, after.num, p)
