"""Summary metrics with the expected answers written out (vLLM bench serve definitions)."""

from __future__ import annotations

import pytest

from loadgen.config import SloConfig
from loadgen.errors import LoadgenConfigError
from loadgen.metrics import distribution, meets_slo, summarize
from loadgen.request import RequestResult


def _r(i: int, ttft: float, tpot: float | None, e2e: float, tokens: int, ok: bool = True,
       domain: str = "code", worker: str = "w0", error: str | None = None) -> RequestResult:
    return RequestResult(index=i, line=i + 1, scheduled_s=0.0, ttft_s=ttft, tpot_s=tpot,
                         e2e_s=e2e, completion_tokens=tokens, prompt_tokens=10, ok=ok,
                         domain=domain, worker=worker, error=error, lag_s=0.001 * i)


def test_distribution_uses_linear_percentiles() -> None:
    d = distribution([1.0, 2.0, 3.0, 4.0])
    assert d == {"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": pytest.approx(3.97), "max": 4.0}
    assert distribution([])["p99"] is None


def test_goodput_counts_requests_meeting_every_slo() -> None:
    slo = SloConfig(ttft_s=0.5, tpot_s=0.05)
    results = [
        _r(0, 0.2, 0.04, 1.0, 10),  # good
        _r(1, 0.6, 0.01, 1.0, 10),  # TTFT too slow
        _r(2, 0.1, 0.06, 1.0, 10),  # TPOT too slow
        _r(3, 0.5, None, 0.5, 1),  # one token: TPOT counts as 0 -> good (TTFT == SLO)
        _r(4, 0.1, 0.01, 1.0, 10, ok=False, error="HTTP 503: busy"),  # failed
    ]
    assert [meets_slo(r, slo) for r in results] == [True, False, False, True, False]
    s = summarize(results, duration_s=2.0, slo=slo)
    assert s["num_good"] == 2 and s["goodput"] == 1.0
    assert s["num_ok"] == 4 and s["request_throughput"] == 2.0
    assert s["output_throughput"] == (10 + 10 + 10 + 1) / 2.0
    assert s["errors"] == {"HTTP 503": 1}
    assert s["ttft_s"]["max"] == 0.6  # failed requests are not in latency distributions


def test_e2e_slo_and_breakdowns() -> None:
    slo = SloConfig(ttft_s=None, tpot_s=None, e2e_s=1.0)
    results = [_r(0, 0.1, 0.01, 0.9, 5, domain="code", worker="a"),
               _r(1, 0.1, 0.01, 1.1, 5, domain="math", worker="a"),
               _r(2, 0.1, 0.01, 0.2, 5, domain="math", worker="b")]
    s = summarize(results, duration_s=1.0, slo=slo)
    assert s["num_good"] == 2
    assert {k: v["num_good"] for k, v in s["by_domain"].items()} == {"code": 1, "math": 1}
    assert {k: v["num_requests"] for k, v in s["by_worker"].items()} == {"a": 2, "b": 1}
    assert s["lag_s"]["max"] == 0.002


def test_slo_parsing() -> None:
    assert SloConfig.parse("ttft:500ms,tpot:50ms") == SloConfig(0.5, 0.05, None)
    assert SloConfig.parse("e2e:2s, ttft:250") == SloConfig(0.25, None, 2.0)
    with pytest.raises(LoadgenConfigError, match="cannot read"):
        SloConfig.parse("latency:5")
