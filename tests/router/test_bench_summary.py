"""bench/routing.py's summaries: pooled ratios, the peak-goodput summary, the misses split,
and the start-up check of the plan."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from bench import routing as BENCH

ROOT = Path(__file__).resolve().parents[2]


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


DATA = ROOT / "data"


def write_trace(tmp_path: Path, num: int) -> None:
    """A Mooncake trace of ``num`` requests (blocks ``i % 7`` and ``100 + i``) next to the
    repository's Spec-Bench prompts and Azure trace (the other half of the workload)."""
    trace = tmp_path / BENCH.MOONCAKE
    trace.parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "prompts").symlink_to(DATA / "prompts")
    (trace.parent / "azure_llm_2023_conv.csv").symlink_to(
        DATA / "traces" / "azure_llm_2023_conv.csv")
    trace.write_text("".join(json.dumps({"timestamp": i * 100, "input_length": 600,
                                         "output_length": 20, "hash_ids": [i % 7, 100 + i]})
                             + "\n" for i in range(num)))


def test_per_rate_windows_replay_the_same_requests_at_every_rate_in_fresh_namespaces(
        tmp_path: Path) -> None:
    write_trace(tmp_path, 100)
    args = argparse.Namespace(workload="prefix-mix", data=tmp_path, trace_start=40,
                              rates=[2.0, 4.0], duration=5.0, rounds=5, prefix_share=0.5,
                              trace_windows="per-rate", output_scale=1.0)
    # per round: 5 (rate 2) and 10 (rate 4) Mooncake requests; every rate from 40 again, so
    # 5 rounds need 40 + 5 x 10 = 90 (forward: 40 + 5 x 15 = 115, past the trace's 100)
    schedules = BENCH.Schedules(args)
    assert schedules.mooncake_needed() == 90
    seen = []
    for i, rate in enumerate(args.rates):
        schedules.begin_rate(i)
        warm = [r for r in schedules.warmup(rate, 4, seed=1) if r.hash_ids]
        first = [r for r in schedules.round(rate, int(rate * 5), seed=0) if r.hash_ids]
        second = [r for r in schedules.round(rate, int(rate * 5), seed=1) if r.hash_ids]
        seen.append((warm[0].hash_ids, first[0].hash_ids, second[0].hash_ids))
        assert schedules.window == (40 + len(first), 40 + len(first) + len(second))
    ns = BENCH.NAMESPACE
    # warm-up: the 2 requests before 40 (38 -> blocks 38 % 7 = 3 and 138); round 1 from 40
    # (40 % 7 = 5, 140); round 2 from 45 at rate 2 (45 % 7 = 3, 145), from 50 at rate 4
    assert seen[0] == ((3 + ns, 138 + ns), (5 + ns, 140 + ns), (3 + ns, 145 + ns))
    assert seen[1] == ((3 + 2 * ns, 138 + 2 * ns), (5 + 2 * ns, 140 + 2 * ns),
                       (1 + 2 * ns, 150 + 2 * ns))


def test_forward_windows_walk_the_trace_and_keep_the_recorded_block_ids(tmp_path: Path) -> None:
    write_trace(tmp_path, 100)
    args = argparse.Namespace(workload="prefix-mix", data=tmp_path, trace_start=40,
                              rates=[2.0, 4.0], duration=5.0, rounds=2, prefix_share=0.5,
                              trace_windows="forward", output_scale=1.0)
    schedules = BENCH.Schedules(args)
    assert schedules.mooncake_needed() == 70
    for i, rate in enumerate(args.rates):
        schedules.begin_rate(i)
        for r in range(2):
            records = schedules.round(rate, int(rate * 5), seed=r)
    assert schedules.window == (60, 70)
    assert [r.hash_ids for r in records if r.hash_ids][0] == (60 % 7, 160)


def test_prefix_reuse_counts_leading_blocks_seen_in_the_requests_before() -> None:
    def req(*ids: int) -> Any:
        return BENCH.TraceRequest(line=1, hash_ids=ids)
    trace = [req(1, 2, 3), req(1, 2, 9), req(4, 2), req(1, 5)]
    # request 1: 1, 2 seen, 9 not: 2 of 3; request 2: 4 unseen, so its 2 does not count: 0
    # of 2; request 3 with a look-back of 1 (only request 2: blocks 4, 2): 0 of 2
    assert BENCH.prefix_reuse(trace, 1, 3) == 2 / 5
    assert BENCH.prefix_reuse(trace, 3, 4, lookback=1) == 0.0
    assert BENCH.prefix_reuse(trace, 3, 4, lookback=3) == 1 / 2


def test_runs_split_over_calls_merge_into_one_report() -> None:
    a = {"slos": {"ttft_s": {"x": 1.0}}, "rates": {"9.0": OUT["rates"]["9.0"]},
         "hit_rate": {"9.0": {"adaptive": 0.25}}}
    b = {"slos": {"ttft_s": {"x": 2.0}}, "rates": {"8.0": OUT["rates"]["8.0"]}}
    merged = BENCH.merge_runs([a, b])
    assert list(merged["rates"]) == ["8.0", "9.0"] and merged["slos"] == a["slos"]
    assert BENCH.peak_summary(merged) == BENCH.peak_summary(OUT)
    # 9.0: adaptive met 18 of 30, RR 14, LO 18
    assert BENCH.attainment_line("9.0", merged) == (
        "   9.0 | SLOs met round_robin 47% / least_outstanding 60% / adaptive 60% | "
        "hit rate adaptive 25.0%")
    with pytest.raises(ValueError, match="rate 9.0 is in more than one run"):
        BENCH.merge_runs([a, a])


def test_slos_follow_the_rule_on_the_run_s_own_probe_unless_fixed_or_given() -> None:
    # unloaded probe per worker, class and prompt: (TTFT s, TPOT s); per prompt the slowest
    # worker's, then the 90th percentile over the prompts (linear: 0.1 of the way from the
    # second prompt's to the third's)
    def two(a: tuple[float, float], b: tuple[float, float]) -> list[tuple[float, float]]:
        return [a, b, (2 * b[0], 2 * b[1])]
    samples = {"spec": {"repetitive": two((0.02, 0.001), (0.01, 0.001)),
                        "conversational": two((0.03, 0.004), (0.03, 0.004)),
                        "long": two((0.30, 0.005), (0.30, 0.005)),
                        "prefix": two((0.20, 0.003), (0.20, 0.003))},
               "batch": {"repetitive": two((0.04, 0.002), (0.02, 0.002)),
                         "conversational": two((0.02, 0.005), (0.02, 0.005)),
                         "long": two((0.25, 0.006), (0.25, 0.006)),
                         "prefix": two((0.30, 0.002), (0.30, 0.002))}}

    def args(**kw: Any) -> argparse.Namespace:
        return argparse.Namespace(**{"slo_seconds": None, "prefix_slo": None, **kw})

    # repetitive: slowest per prompt 0.04, 0.02, 0.04 s -> q90 = 0.04; TPOT 0.002, 0.002,
    # 0.004 -> 0.002 + 0.8 x 0.002 = 0.0036; the others' third prompt is twice the second
    rule = BENCH.slos_from(args(), samples)  # SLO_RULE: 10x / 2.5x, long and prefix 5x / 5x
    assert rule.ttft_s == pytest.approx({"repetitive": 0.4, "conversational": 0.54,
                                         "long": 5 * 0.54, "prefix": 5 * 0.54})
    assert rule.tpot_s == pytest.approx({"repetitive": 2.5 * 0.0036,
                                         "conversational": 2.5 * 0.009,
                                         "long": 5 * 0.0108, "prefix": 5 * 0.0054})
    given = BENCH.slos_from(args(slo_seconds=[1, 2, 3, 4, 5, 6], prefix_slo=[7, 8]), samples)
    assert given.ttft_s == {"repetitive": 1, "conversational": 3, "long": 5, "prefix": 7}
    assert given.tpot_s == {"repetitive": 2, "conversational": 4, "long": 6, "prefix": 8}


def test_probe_lengths_spread_over_the_distribution() -> None:
    assert BENCH.spread_lengths(list(range(1, 101)), 5) == [11, 31, 51, 71, 91]
    assert BENCH.spread_lengths([0, 0, 7], 2) == [1, 7]  # never an empty prompt


def test_a_trace_workload_is_its_own_class_with_its_slo_in_the_bodies() -> None:
    records = list(BENCH.read_trace(DATA / "traces" / "azure_llm_2023_code.csv"))[:300]
    synth = BENCH.trace_synthesizer("code", 0)
    sched = BENCH.build_trace_workload(records, synth, "code", 0.25, 48, 20, 2.0, seed=3)
    assert len(sched) == 20 and {BENCH.record_class(r) for r in sched} == {"trace"}
    assert {r.domain for r in sched} == {"code"}
    span = sched[-1].timestamp_s - sched[0].timestamp_s
    assert span == pytest.approx(20 / 2.0)  # arrival gaps scaled to the rate
    first = records[sched[0].line - BENCH.TRACE_LINE]
    n = BENCH.trace_lengths([first], 0.25, 48)[0]
    text = sched[0].messages[0]["content"]
    assert synth.counter.count(text) == n and "def" in text.split()  # code, as recorded x 0.25
    again = BENCH.build_trace_workload(records, synth, "code", 0.25, 48, 20, 4.0, seed=3)
    assert [r.line for r in again] == [r.line for r in sched]  # same window at every rate
    texts = [r.messages[0]["content"] for r in sched]
    assert [r.messages[0]["content"] for r in again] == texts  # and the same prompts ...
    other = BENCH.build_trace_workload(records, synth, "code", 0.25, 48, 20, 4.0, seed=3,
                                       key_offset=BENCH.NAMESPACE)
    assert [r.line for r in other] == [r.line for r in sched]
    # ... unless another key namespace (Schedules: one per rate), whose prompts are new
    assert not set(r.messages[0]["content"] for r in other) & set(texts)
    assert [synth.counter.count(r.messages[0]["content"]) for r in other] == \
        [synth.counter.count(x) for x in texts]


def test_capacities_per_round_give_an_interval_and_round_by_round_ratios() -> None:
    # round 0: LO 95% -> 70% between 4 and 8 (4.8 at 90%); adaptive 100% -> 85% (6.67)
    # round 1: LO 100% -> 50% (4.8); adaptive 100% -> 90% -> holds to 8 (>= 8)
    sweep = {"rates": {
        "4.0": {"least_outstanding": [run(0, 19, 20), run(0, 20, 20)],
                "adaptive": [run(0, 20, 20), run(0, 20, 20)]},
        "8.0": {"least_outstanding": [run(0, 14, 20), run(0, 10, 20)],
                "adaptive": [run(0, 17, 20), run(0, 18, 20)]}}}
    lines = BENCH.capacity_summary(sweep)
    assert lines[0] == ("capacity at 90% attainment, median (min-max) of rounds: "
                        "least_outstanding 4.80 (4.80-4.80) / adaptive 7.33 (6.67-8.00) [=,>=]")
    assert lines[1] == "  adaptive/least_outstanding at 90%: 1.53 (1.39-1.67)"


def test_the_never_worse_line_pools_rounds_beside_the_a_a() -> None:
    sweep = {"rates": {
        "1.0": {"least_outstanding": [run(0, 9), run(0, 9)],
                "least_outstanding-twin": [run(0, 10), run(0, 8)],
                "adaptive": [run(0, 9), run(0, 10)]},
        "2.0": {"least_outstanding": [run(0, 5), run(0, 5)],
                "least_outstanding-twin": [run(0, 5), run(0, 6)],
                "adaptive": [run(0, 4), run(0, 5)]}}}
    lines = BENCH.never_worse_summary(sweep)
    assert lines == ["pooled SLOs met adaptive/least_outstanding per rate: 1.0 1.06x, "
                     "2.0 0.90x | min 0.90x",
                     "pooled SLOs met least_outstanding-twin/least_outstanding per rate: "
                     "1.0 1.00x, 2.0 1.10x | min 1.00x"]


def test_goal_rate_is_where_attainment_first_falls_below_the_goal_interpolated() -> None:
    assert BENCH.goal_rate([(4.0, 0.95), (8.0, 0.85), (6.0, 0.95)], 0.9) == \
        ("", pytest.approx(7.0))
    assert BENCH.goal_rate([(4.0, 0.85), (8.0, 0.5)], 0.9) == ("<", 4.0)  # even the lowest
    assert BENCH.goal_rate([(4.0, 0.99), (8.0, 0.91)], 0.9) == (">=", 8.0)  # none misses
    # the first crossing counts, though a later, noisier rate meets the goal again
    assert BENCH.goal_rate([(4.0, 0.9), (6.0, 0.8), (8.0, 0.95)], 0.9) == \
        ("", pytest.approx(4.0))


def test_goal_rate_summary_prints_each_policy_s_rate_and_the_ratios() -> None:
    sweep = {"rates": {
        "4.0": {"least_outstanding": [run(0, 19, 20)], "adaptive": [run(0, 20, 20)]},
        "8.0": {"least_outstanding": [run(0, 14, 20)], "adaptive": [run(0, 17, 20)]},
        "12.0": {"least_outstanding": [run(0, 5, 20)], "adaptive": [run(0, 10, 20)]}}}
    lines = BENCH.goal_rate_summary(sweep)
    # 90%: LO falls from 95% to 70% between 4 and 8 (at 4.8); adaptive 100% -> 85% (6.67)
    assert lines[0] == "rate holding 90% of SLOs: least_outstanding 4.80 / adaptive 6.67"
    assert lines[1] == "  adaptive/least_outstanding at 90%: 1.39x"
    # 80%: LO at 4 + 4 x 15/25 = 6.4; adaptive 85% -> 50% between 8 and 12: 8 + 4 x 5/35
    assert lines[2] == "rate holding 80% of SLOs: least_outstanding 6.40 / adaptive 8.57"
    assert lines[3] == "  adaptive/least_outstanding at 80%: 1.34x"
    # a bound where the sweep does not bracket the goal
    low = {"rates": {r: {"least_outstanding": [run(0, 10, 20)], "adaptive": [run(0, 20, 20)]}
                     for r in ("4.0", "8.0")}}
    lines = BENCH.goal_rate_summary(low)
    assert lines[0] == "rate holding 90% of SLOs: least_outstanding <4.00 / adaptive >=8.00"
    assert lines[1] == "  adaptive/least_outstanding at 90%: 2.00x (bounds: >= / <)"


def test_each_rate_of_a_trace_sweep_sends_its_own_prompts() -> None:
    """The rounds' windows are picked by seed, the same lines at every rate; without a key
    namespace per schedule a later round re-sent an earlier one's prompts into warm caches."""
    args = argparse.Namespace(workload=BENCH.TRACE, data=DATA, trace_start=3000,
                              trace_windows="per-rate", rates=[2.0, 4.0], duration=5.0,
                              rounds=1, prefix_share=0.5, output_scale=1.0,
                              trace=DATA / "traces" / "azure_llm_2023_code.csv",
                              trace_format="auto", trace_domain="code", seed=0,
                              trace_prompt_scale=0.25, max_output=48)
    schedules = BENCH.Schedules(args)
    rounds = []
    for i in range(2):
        schedules.begin_rate(i)
        rounds.append(schedules.round(4.0, 10, seed=0))
    assert [r.line for r in rounds[0]] == [r.line for r in rounds[1]]
    texts = [{r.messages[0]["content"] for r in rs} for rs in rounds]
    assert not texts[0] & texts[1]
    # ... and two rounds of one rate whose windows overlap (seeds pick the starts) too
    again = schedules.round(4.0, 10, seed=0)
    assert [r.line for r in again] == [r.line for r in rounds[1]]
    assert not {r.messages[0]["content"] for r in again} & texts[1]


def test_fleet_counters_sum_prefix_cache_and_preemption_counters_over_workers() -> None:
    a = ('# TYPE vllm:prefix_cache_queries counter\n'
         'vllm:prefix_cache_queries_total{model_name="m",engine="0"} 100.0\n'
         'vllm:prefix_cache_hits_total{model_name="m",engine="0"} 30.0\n'
         'vllm:prefix_cache_hits_created{model_name="m"} 1.7e9\n'
         'vllm:num_preemptions_total{model_name="m",engine="0"} 2.0\n')
    b = 'vllm:prefix_cache_queries{engine="1"} 50\nvllm:num_preemptions_total 1\n'
    assert BENCH.counter_totals([a, b]) == (150.0, 30.0, 3.0)
