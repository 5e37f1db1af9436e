from __future__ import annotations

import json
from pathlib import Path

import pytest

from optimizer.errors import TraceError
from optimizer.profile import (
    TraceTail,
    TrafficProfile,
    build_profile,
    profile_distance,
    read_trace_files,
    stratified_sample,
)
from polyinfer.trace import TraceRecord


def rec(ts: float, domain: str, prompt: int, out: int, **kw: object) -> dict:
    return {"ts": ts, "request_id": f"r{ts}", "domain": domain, "prompt_tokens": prompt,
            "max_tokens": 64, "completion_tokens": out, "status": "ok", **kw}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_profile_from_small_trace_with_bad_lines(tmp_path: Path) -> None:
    lines = [
        json.dumps(rec(100.0, "code", 100, 10, spec_draft_tokens=40, spec_accepted_tokens=20,
                       e2e_s=0.5)),
        "this is not json",
        json.dumps(rec(101.0, "code", 300, 30, spec_draft_tokens=60, spec_accepted_tokens=10,
                       e2e_s=1.5)),
        json.dumps({"ts": 102.0, "domain": "poetry", "prompt_tokens": 5}),
        json.dumps(rec(102.0, "chat", 50, 20, e2e_s=1.0)),
        json.dumps({"ts": "yesterday", "domain": "chat", "prompt_tokens": 5}),
        "",
        json.dumps(rec(104.0, "chat", 70, 40, status="error", e2e_s=None)),
        json.dumps({"ts": 104.5, "domain": "math", "prompt_tokens": -3}),
        "[1, 2]",
    ]
    read = read_trace_files([write_lines(tmp_path / "t.jsonl", lines)])
    assert [b.line_no for b in read.bad_lines] == [2, 4, 6, 9, 10]
    assert "domain" in read.bad_lines[1].reason and "ts" in read.bad_lines[2].reason
    assert "prompt_tokens" in read.bad_lines[3].reason
    assert str(read.bad_lines[0]).startswith(str(tmp_path / "t.jsonl") + ":2:")
    p = build_profile(read.records)
    assert p.num_requests == 4
    assert p.duration_s == pytest.approx(4.0)
    assert p.arrival_rate_rps == pytest.approx(3 / 4)
    assert p.domain_mix == {"chat": 0.5, "code": 0.5}
    assert p.prompt_tokens.mean == pytest.approx((100 + 300 + 50 + 70) / 4)
    # output lengths only from successful requests
    assert p.output_tokens.mean == pytest.approx((10 + 30 + 20) / 3)
    assert p.output_tokens_by_domain == {"chat": 20.0, "code": 20.0}
    assert p.acceptance_by_domain == {"code": pytest.approx(30 / 100)}
    assert p.error_rate == pytest.approx(0.25)
    assert p.mean_concurrency == pytest.approx(0.75 * 1.0)


def test_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        read_trace_files([tmp_path / "nope.jsonl"])


def test_stratified_sample_keeps_domain_mix_and_length_spread() -> None:
    records = ([TraceRecord(float(i), "code", 10 * i) for i in range(60)]
               + [TraceRecord(100.0 + i, "chat", 5 * i) for i in range(30)]
               + [TraceRecord(200.0 + i, "math", 7) for i in range(10)])
    sample = stratified_sample(records, 10, seed=3)
    assert len(sample) == 10
    by_domain = {d: sorted(r.prompt_tokens for r in sample if r.domain == d)
                 for d in ("code", "chat", "math")}
    assert [len(v) for v in by_domain.values()] == [6, 3, 1]
    # one code record from each sixth of the length-sorted code records
    assert [v // 100 for v in by_domain["code"]] == [0, 1, 2, 3, 4, 5]
    assert stratified_sample(records, 10, seed=3) == sample
    assert len(stratified_sample(records, 1000)) == len(records)
    assert stratified_sample([], 5) == []


def test_rare_domain_gets_at_least_one() -> None:
    records = [TraceRecord(float(i), "chat", 10) for i in range(99)] + [
        TraceRecord(200.0, "code", 10)]
    assert {r.domain for r in stratified_sample(records, 4)} == {"chat", "code"}


def test_profile_distance_sees_a_shift() -> None:
    a = build_profile([TraceRecord(float(i), "code", 400, completion_tokens=10) for i in range(20)])
    b = build_profile([TraceRecord(float(i), "chat", 60, completion_tokens=40) for i in range(20)])
    assert profile_distance(a, a) == 0.0
    assert profile_distance(a, b) > 1.0


def test_profile_distance_sees_a_load_shift() -> None:
    def at(rate: float) -> TrafficProfile:
        return build_profile([TraceRecord(i / rate, "chat", 300, completion_tokens=100, e2e_s=2.0)
                              for i in range(40)])
    busy, quiet = at(5.0), at(0.5)  # ~10 vs ~1 request in flight, same requests
    assert profile_distance(busy, quiet) > 0.8
    assert profile_distance(busy, at(5.5)) < 0.3


def test_tail_reads_only_appended_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "live.jsonl"
    tail = TraceTail(path)
    assert tail.read_new().records == []
    path.write_text(json.dumps(rec(1.0, "qa", 5, 5)) + "\nnot json\n" + '{"ts": 2')
    first = tail.read_new()
    assert len(first.records) == 1 and [b.line_no for b in first.bad_lines] == [2]
    with open(path, "a") as f:
        f.write(', "domain": "qa", "prompt_tokens": 3}\n')
    second = tail.read_new()
    assert [r.ts for r in second.records] == [2.0] and second.bad_lines == []


def test_tail_starts_over_when_the_file_is_truncated(tmp_path: Path) -> None:
    path = tmp_path / "live.jsonl"
    path.write_text(json.dumps(rec(1.0, "qa", 5, 5)) + "\n" + json.dumps(rec(2.0, "qa", 5, 5)) + "\n")
    tail = TraceTail(path)
    assert len(tail.read_new().records) == 2
    path.write_text("oops\n")  # rotated: a new, shorter file
    again = tail.read_new()
    assert again.records == [] and [b.line_no for b in again.bad_lines] == [1]
