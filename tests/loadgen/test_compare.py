"""The side-by-side table of `polyinfer loadgen compare`."""

from __future__ import annotations

from typing import Any

from loadgen.compare import compare_table


def _summary(goodput: float, ttft_p99_s: float | None) -> dict[str, Any]:
    dist = {"mean": 0.1, "p50": 0.1, "p90": 0.2, "p99": ttft_p99_s, "max": 0.5}
    return {"num_ok": 100, "num_errors": 0, "request_throughput": 10.0,
            "output_throughput": 1234.5, "goodput": goodput, "ttft_s": dist, "tpot_s": dist,
            "e2e_s": dist, "lag_s": dist}


def test_columns_and_ratios_to_the_first_run() -> None:
    table = compare_table([_summary(4.0, 0.250), _summary(6.0, None)], ["rr", "adaptive"])
    lines = table.splitlines()
    assert lines[0] == "| metric | rr | adaptive | adaptive / rr |"
    assert "| goodput (req/s) | 4 | 6 | 1.5x |" in lines
    assert "| output (tok/s) | 1,234 | 1,234 | 1x |" in lines
    assert "| TTFT p99 (ms) | 250 | - | - |" in lines
    assert "| errors | 0 | 0 | - |" in lines
