"""The side-by-side table of `polyinfer loadgen compare`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import orjson
import pytest

from loadgen.compare import compare_files, compare_table


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


def _run(tmp_path: Path, name: str, rate: float, target: str) -> str:
    summary = {**_summary(4.0, 0.25), "label": name, "target": target, "model": "tiny-target",
               "trace": {"path": "data/traces/azure_llm_2023_conv.csv", "format": "azure"},
               "arrival": {"mode": "poisson", "rate": rate, "seed": 0},
               "slo": {"ttft_s": 0.5, "tpot_s": 0.05, "e2e_s": None}}
    (tmp_path / name).mkdir()
    (tmp_path / name / "summary.json").write_bytes(orjson.dumps(summary))
    return str(tmp_path / name)


def test_compare_warns_when_the_runs_used_other_settings(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rr = _run(tmp_path, "rr", 4.0, "http://a")
    adaptive = _run(tmp_path, "adaptive", 4.0, "http://b")  # only the target differs
    faster = _run(tmp_path, "faster", 8.0, "http://b")
    compare_files([rr, adaptive])
    assert "not made with the same settings" not in caplog.text
    table = compare_files([rr, adaptive, faster])
    assert "| goodput (req/s) |" in table
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["the runs were not made with the same settings: "
                        "arrival.rate: 4.0 (rr) vs 8.0 (faster)"]


def test_a_missing_trace_file_is_one_error_line(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.cli import main

    missing = tmp_path / "nowhere.csv"
    assert main(["loadgen", "--trace", str(missing), "--target", "http://127.0.0.1:1"]) == 2
    assert f"--trace {missing}: no such file (the repository's traces are in " in caplog.text
    assert "Traceback" not in capsys.readouterr().err


def test_the_default_trace_is_the_repositorys_azure_conversation_trace() -> None:
    from loadgen.cli import DEFAULT_TRACE, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["loadgen", "--target", "http://127.0.0.1:1"])
    assert args.trace == str(DEFAULT_TRACE)
    assert DEFAULT_TRACE == Path(__file__).resolve().parents[2] / "data/traces/azure_llm_2023_conv.csv"
    assert DEFAULT_TRACE.is_file()
