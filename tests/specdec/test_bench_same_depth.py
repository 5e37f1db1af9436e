"""bench/spec_depth.py's same-depth comparison and per-request dump (concurrency 1).

The adaptive mode's requests are compared with fixed-k requests of the same prompt at the
depth it chose; the dump names prompts by index and never writes prompt or output text.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import spec_depth


@pytest.fixture(scope="module")
def bench():  # type: ignore[no-untyped-def]
    return spec_depth


def _outcome(bench, prompt: str, mode: int | str, depth: int, e2e: float,  # type: ignore[no-untyped-def]
             drafted: int = 10, accepted: int = 5, cpu: float = 0.0):
    return bench.Outcome(prompt, "chat", mode, 1, depth, 1, f"answer to {prompt}", 128, drafted,
                         accepted, ttft_s=0.1, e2e_s=e2e, cpu_s=cpu)


def test_adaptive_paired_with_fixed_twins_of_same_prompt_and_depth(bench) -> None:  # type: ignore[no-untyped-def]
    outcomes = [
        _outcome(bench, "p1", 4, 4, 1.1, cpu=0.9),  # twin of p1 at 4, round 1
        _outcome(bench, "p1", 4, 4, 1.3, cpu=1.1),  # round 2: twin time = mean 1.2 - 0.1
        _outcome(bench, "p1", 8, 8, 0.2),  # another depth: not a twin
        _outcome(bench, "p2", 4, 4, 0.2),  # another prompt: not a twin
        _outcome(bench, "p1", bench.ADAPTIVE, 4, 1.5, drafted=12, accepted=6, cpu=1.2),
        _outcome(bench, "p3", bench.ADAPTIVE, 4, 9.0),  # no fixed run of p3: left out
        _outcome(bench, "p2", bench.ADAPTIVE, 3, 9.0),  # no fixed k=3: left out
    ]
    rows = bench.same_depth(outcomes)
    assert list(rows) == [4]
    r = rows[4]
    assert r.requests == 1
    assert r.decode_s == pytest.approx(1.4)
    assert r.twin_decode_s == pytest.approx(1.1)
    assert r.cpu_s == pytest.approx(1.2)
    assert r.twin_cpu_s == pytest.approx(1.0)
    assert (r.drafted, r.twin_drafted, r.accepted, r.twin_accepted) == (12, 10, 6, 5)


def test_same_depth_table_printed_with_time_ratio(bench, capsys) -> None:  # type: ignore[no-untyped-def]
    outcomes = [_outcome(bench, "p1", 4, 4, 0.9), _outcome(bench, "p1", bench.ADAPTIVE, 4, 1.1)]
    bench.print_same_depth("ngram", outcomes)
    out = capsys.readouterr().out
    assert "k=4" in out and "(x0.800)" in out  # fixed 0.8 s / adaptive 1.0 s of decode


def test_no_table_without_pairs(bench, capsys) -> None:  # type: ignore[no-untyped-def]
    bench.print_same_depth("ngram", [_outcome(bench, "p1", 4, 4, 0.9)])
    assert capsys.readouterr().out == ""


def test_request_dump_has_no_prompt_or_output_text(bench, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    prompts = [bench.Prompt("chat", "secret prompt one"), bench.Prompt("qa", "secret two")]
    outcomes = [_outcome(bench, "secret two", bench.ADAPTIVE, 4, 0.5),
                _outcome(bench, "secret prompt one", 0, 0, 0.7)]
    path = tmp_path / "requests.jsonl"
    bench.write_requests(path, "ngram", outcomes, prompts)
    text = path.read_text()
    assert "secret" not in text and "answer to" not in text
    rows = [json.loads(line) for line in text.splitlines()]
    assert [(r["prompt"], r["mode"], r["depth"], r["order"]) for r in rows] == [
        (1, "adaptive", 4, 0), (0, 0, 0, 1)]
    assert rows[0]["e2e_s"] == 0.5 and rows[0]["ttft_s"] == 0.1
    assert isinstance(rows[0]["output_crc"], int)


def _timed(bench, mode: int | str, seconds: float, rnd: int):  # type: ignore[no-untyped-def]
    # 101 tokens, 1 from prefill: 100 decode tokens in `seconds` of decode
    return bench.Outcome("p", "chat", mode, 1, 4 if mode == bench.ADAPTIVE else int(mode), 1,
                         "", 101, 0, 0, ttft_s=0.0, e2e_s=seconds, rnd=rnd)


def test_held_out_best_k_is_picked_on_the_other_round(bench) -> None:  # type: ignore[no-untyped-def]
    # k=4 wins round 0 by noise, k=8 wins round 1; adaptive is as fast as each in its round.
    outcomes = [_timed(bench, 4, 1.0, 0), _timed(bench, 8, 1.25, 0), _timed(bench, bench.ADAPTIVE, 1.25, 0),
                _timed(bench, 4, 1.25, 1), _timed(bench, 8, 1.0, 1), _timed(bench, bench.ADAPTIVE, 1.0, 1)]
    # plain: best fixed k=4 or 8 both at 200 tokens / 2.25 s; adaptive 200 / 2.25 s -> 1.0,
    # held out: round 0 uses round 1's winner (k=8: 1.25 s), round 1 round 0's (k=4: 1.25 s)
    assert bench.held_out_ratio(outcomes, "decode_s") == pytest.approx(2.5 / 2.25)


def test_held_out_needs_two_rounds(bench) -> None:  # type: ignore[no-untyped-def]
    outcomes = [_timed(bench, 4, 1.0, 0), _timed(bench, bench.ADAPTIVE, 1.0, 0)]
    assert bench.held_out_ratio(outcomes, "decode_s") is None


def test_held_out_interval_is_student_t_over_the_rounds(bench) -> None:  # type: ignore[no-untyped-def]
    # mean 1.0, sd 0.1 over 4 rounds: half width t(0.95, 3) = 2.3534 x 0.1 / 2
    mean, lo, hi = bench.held_out_interval([0.9, 1.0, 1.0, 1.1])
    assert mean == pytest.approx(1.0)
    sd = (0.02 / 3) ** 0.5
    assert hi - mean == pytest.approx(2.353363 * sd / 2, rel=1e-5)
    assert mean - lo == pytest.approx(hi - mean)


def test_print_held_out_pairs_each_round_with_the_other_rounds_winner(  # type: ignore[no-untyped-def]
        bench, capsys) -> None:
    # k=4 wins round 0 by noise, k=8 rounds 1 and 2; every round is compared with k=8, the
    # best on the other rounds (k=4 sums 3.0 or 2.5 s there, k=8 2.0 or 2.25 s):
    # adaptive / k=8 per round = 1.25 / 1.0, 1.0 / 1.0 and 1.0 / 1.1
    outcomes = [_timed(bench, 4, 1.0, 0), _timed(bench, 8, 1.25, 0), _timed(bench, bench.ADAPTIVE, 1.0, 0),
                _timed(bench, 4, 1.5, 1), _timed(bench, 8, 1.0, 1), _timed(bench, bench.ADAPTIVE, 1.0, 1),
                _timed(bench, 4, 1.5, 2), _timed(bench, 8, 1.0, 2), _timed(bench, bench.ADAPTIVE, 1.1, 2)]
    assert [len(a) == len(p) == 1 and p[0].mode == 8
            for a, p in bench.held_out_pairs(outcomes, "e2e_s")] == [True, True, True]
    bench.print_held_out(outcomes)
    out = capsys.readouterr().out
    mean = (1.25 + 1.0 + 1.0 / 1.1) / 3
    assert f"adaptive / best = {3.25 / 3.1:.3f}" in out
    assert f"per round mean {mean:.3f}" in out and "over 3 rounds" in out
