"""Arrival processes: when each request is sent, as offsets from the run start (seconds)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np

from loadgen.config import ArrivalConfig
from loadgen.errors import TraceError
from loadgen.request import TraceRequest

logger = logging.getLogger(__name__)

# NOTE: a rate-driven run without --max-requests or --duration sends the
# trace once; with a limit it cycles through the trace's prompts.


def trace_arrivals(records: Iterable[TraceRequest], cfg: ArrivalConfig
                   ) -> list[tuple[float, TraceRequest]]:
    """Recorded timestamps, windowed, times ``time_scale``, sorted; first one at 0 s."""
    stamped: list[tuple[float, TraceRequest]] = []
    for r in records:
        if r.timestamp_s is None:
            raise TraceError(f"line {r.line} has no timestamp: --arrival trace needs one on "
                             "every record; use --arrival poisson, gamma or concurrency")
        stamped.append((r.timestamp_s, r))
    if not stamped:
        return []
    num_unordered = sum(1 for a, b in zip(stamped, stamped[1:], strict=False) if b[0] < a[0])
    if num_unordered:
        logger.warning("%d records are out of timestamp order; replaying in time order",
                       num_unordered)
    stamped.sort(key=lambda pair: pair[0])  # stable: equal stamps keep file order
    start = stamped[0][0] + cfg.window_start_s
    end = None if cfg.window_end_s is None else stamped[0][0] + cfg.window_end_s
    window = [(t, r) for t, r in stamped if t >= start and (end is None or t < end)]
    if not window:
        return []
    first = window[0][0]
    return _limit([((t - first) * cfg.time_scale, r) for t, r in window], cfg)


def rate_offsets(num: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """``num`` send times for a gamma process (Poisson when burstiness is 1), first at 0.

    Gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)), as in vLLM's
    ``bench serve``: the mean gap is 1/rate whatever the burstiness.
    """
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(num - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])


def rate_arrivals(records: list[TraceRequest], cfg: ArrivalConfig
                  ) -> list[tuple[float, TraceRequest]]:
    """Poisson / gamma / closed-loop arrivals over the records in file order (cycled)."""
    if not records:
        return []
    if cfg.mode == "concurrency":
        num = cfg.max_requests or len(records)
        return [(0.0, records[i % len(records)]) for i in range(num)]
    assert cfg.rate is not None
    # without --max-requests: enough arrivals to cover the duration, else one pass
    num = cfg.max_requests or (int(cfg.duration_s * cfg.rate * 1.5) + 16 if cfg.duration_s
                               else len(records))
    offsets = rate_offsets(num, cfg.rate, cfg.burstiness, cfg.seed)
    out = [(float(t), records[i % len(records)]) for i, t in enumerate(offsets)]
    return _limit(out, cfg)


def _limit(arrivals: list[tuple[float, TraceRequest]], cfg: ArrivalConfig
           ) -> list[tuple[float, TraceRequest]]:
    if cfg.duration_s is not None:
        arrivals = [a for a in arrivals if a[0] < cfg.duration_s]
    if cfg.max_requests is not None:
        arrivals = arrivals[:cfg.max_requests]
    return arrivals


def arrivals(records: list[TraceRequest], cfg: ArrivalConfig
             ) -> list[tuple[float, TraceRequest]]:
    """(send offset in seconds, record) pairs in send order."""
    if cfg.mode == "trace":
        return trace_arrivals(records, cfg)
    return rate_arrivals(records, cfg)
