"""Summary metrics over per-request results (pure functions).

Throughput and goodput follow vLLM's ``bench serve``: divided by the run's
duration (first send to last completion); goodput counts completed requests
that meet every SLO that is set, with TPOT taken as 0 for one-token outputs.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from loadgen.config import SloConfig
from loadgen.request import RequestResult

PERCENTILES = (50, 90, 99)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 and max of ``values`` (None when empty), linear percentiles."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    arr = np.asarray(values, dtype=np.float64)
    pcts = np.percentile(arr, PERCENTILES)
    return {"mean": float(arr.mean()), **{f"p{p}": float(v) for p, v in zip(PERCENTILES, pcts,
                                                                               strict=True)},
            "max": float(arr.max())}


def meets_slo(r: RequestResult, slo: SloConfig) -> bool:
    """True when ``r`` completed and met every SLO that is set."""
    if not r.ok:
        return False
    checks: list[tuple[float | None, float | None]] = [
        (slo.ttft_s, r.ttft_s),
        (slo.tpot_s, r.tpot_s if (r.completion_tokens or 0) > 1 else 0.0),
        (slo.e2e_s, r.e2e_s),
    ]
    return all(value is not None and value <= limit for limit, value in checks if limit)


def _values(results: Iterable[RequestResult], get: Callable[[RequestResult], float | None]
            ) -> list[float]:
    return [v for r in results if (v := get(r)) is not None]


def error_kind(error: str) -> str:
    """Group errors by their first words ("HTTP 503", "ClientConnectorError", ...)."""
    head = error.split(":", 1)[0]
    return head[:60]


def group_summary(results: Sequence[RequestResult], duration_s: float, slo: SloConfig
                  ) -> dict[str, Any]:
    """Counts, throughput, goodput and latency distributions of one group of requests."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    in_tokens = sum(r.prompt_tokens or r.expected_prompt_tokens or 0 for r in ok)
    num_good = sum(meets_slo(r, slo) for r in ok)
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_errors": len(results) - len(ok),
        "num_good": num_good,
        "request_throughput": rate(len(ok)),  # req/s
        "output_throughput": rate(out_tokens),  # tok/s
        "total_token_throughput": rate(out_tokens + in_tokens),  # tok/s
        "goodput": rate(num_good),  # req/s meeting every SLO
        "prompt_tokens": in_tokens,
        "completion_tokens": out_tokens,
        "ttft_s": distribution(_values(ok, lambda r: r.ttft_s)),
        "tpot_s": distribution(_values(ok, lambda r: r.tpot_s)),
        "itl_s": distribution([x for r in ok for x in r.itl_s]),
        "e2e_s": distribution(_values(ok, lambda r: r.e2e_s)),
    }


def _grouped(results: Sequence[RequestResult], key: Callable[[RequestResult], str | None],
             duration_s: float, slo: SloConfig) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[RequestResult]] = defaultdict(list)
    for r in results:
        groups[key(r) or "unknown"].append(r)
    return {name: group_summary(rs, duration_s, slo) for name, rs in sorted(groups.items())}


def summarize(results: Sequence[RequestResult], duration_s: float, slo: SloConfig
              ) -> dict[str, Any]:
    """The metrics part of the summary: overall, per domain, per worker, send lag, errors."""
    summary = group_summary(results, duration_s, slo)
    summary["duration_s"] = duration_s
    summary["slo"] = {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "e2e_s": slo.e2e_s}
    summary["lag_s"] = distribution([r.lag_s for r in results])
    summary["queue_s"] = distribution([r.queue_s for r in results])
    summary["errors"] = dict(Counter(error_kind(r.error) for r in results if r.error))
    summary["by_domain"] = _grouped(results, lambda r: r.domain, duration_s, slo)
    summary["by_worker"] = _grouped(results, lambda r: r.worker, duration_s, slo)
    summary["num_prompt_token_mismatch"] = sum(
        1 for r in results if r.ok and r.prompt_tokens is not None
        and r.expected_prompt_tokens is not None and r.prompt_tokens != r.expected_prompt_tokens)
    return summary
