"""bench/routing.py's summaries: pooled ratios, the peak-goodput summary fixed before the
session-5 round-2 measurement, the misses split, and the start-up check of the plan."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_routing", ROOT / "bench" / "routing.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


BENCH = load_bench()


def run(goodput: float, good: int, sent: int = 10) -> dict[str, Any]:
    return {"goodput": goodput, "num_good": good, "num_requests": sent}


OUT = {"rates": {
    "8.0": {"round_robin": [run(5.0, 5), run(6.0, 6), run(1.0, 1)],
            "least_outstanding": [run(6.0, 6), run(6.0, 6), run(6.0, 6)],
            "adaptive": [run(7.0, 7), run(9.0, 9), run(8.0, 8)]},
    "9.0": {"round_robin": [run(2.0, 2), run(3.0, 3), run(9.0, 9)],
            "least_outstanding": [run(7.0, 7), run(7.0, 7), run(4.0, 4)],
            "adaptive": [run(6.0, 6), run(6.0, 6), run(6.0, 6)]}}}


def test_peak_goodput_is_the_max_over_rates_of_the_median_over_rounds() -> None:
    lines = BENCH.peak_summary(OUT)
    # RR: medians 5 (8) and 3 (9), though its single best round is 9; LO 6 and 7; adaptive 8 and 6
    assert "peak goodput round_robin: 5.000 req/s at rate 8.0" in lines
    assert "peak goodput least_outstanding: 7.000 req/s at rate 9.0" in lines
    assert "peak goodput adaptive: 8.000 req/s at rate 8.0" in lines
    assert "peak ratio adaptive/round_robin: 1.60x" in lines
    assert "peak ratio adaptive/least_outstanding: 1.14x" in lines


def test_pooled_ratios_count_met_requests_over_all_rounds() -> None:
    line = BENCH.pooled_line("8.0", OUT["rates"]["8.0"])
    assert "met round_robin 12 / least_outstanding 18 / adaptive 24 of 30" in line
    assert "adaptive/round_robin 2.00x" in line and "adaptive/least_outstanding 1.33x" in line


def test_misses_are_split_by_class_worker_and_kind() -> None:
    slos = {"ttft_s": {"prefix": 1.0}, "tpot_s": {"prefix": 0.01}}
    row = {"class": "prefix", "worker": "w", "ok": True, "good": False, "tokens": 10}
    rows = [{**row, "ttft_s": 2.0, "tpot_s": 0.005}, {**row, "ttft_s": 0.5, "tpot_s": 0.02},
            {**row, "ttft_s": 2.0, "tpot_s": 0.02}, {**row, "ok": False, "ttft_s": None,
                                                     "tpot_s": None, "worker": None},
            {**row, "good": True, "ttft_s": 0.1, "tpot_s": 0.001}]
    assert BENCH.miss_line(rows, slos) == \
        "4 missed: prefix@none err1, prefix@w both1/tpot1/ttft1"


def test_a_plan_the_trace_cannot_cover_fails_before_any_fleet_starts(tmp_path: Path) -> None:
    trace = tmp_path / BENCH.MOONCAKE
    trace.parent.mkdir(parents=True)
    trace.write_text("".join(json.dumps({"timestamp": i * 100, "input_length": 600,
                                         "output_length": 20, "hash_ids": [i]}) + "\n"
                             for i in range(100)))
    args = argparse.Namespace(workload="prefix-mix", data=tmp_path, trace_start=40,
                              rates=[2.0, 4.0], duration=5.0, rounds=3, prefix_share=0.5)
    # per round: 5 + 10 Mooncake requests; 3 rounds from 40 -> needs 40..84
    assert BENCH.Schedules(args).mooncake_needed() == 85
    args.rounds = 5  # 40..114: past the trace's 100
    with pytest.raises(ValueError, match=r"needs Mooncake requests 40\.\.114.* has 100"):
        BENCH.Schedules(args)
