"""bench/routing.py's plan options: the policies it compares, rates set from the run's probe
(``--rate-multiples``), the argument checks, and the ratios in the reports (answers written
out)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import routing as BENCH
from router.adaptive import AdaptivePolicy


def test_the_twin_is_least_outstanding_again() -> None:
    twin, lo = BENCH.make_policy("least_outstanding-twin", 3), BENCH.make_policy(
        "least_outstanding", 3)
    assert type(twin).__name__ == type(lo).__name__ == "LeastOutstandingPolicy"
    assert twin is not lo
    assert ("least_outstanding-twin", "least_outstanding") in BENCH.COMPARISONS


@pytest.mark.parametrize(("name", "cls"), [
    ("round_robin", "RoundRobinPolicy"), ("declared_fit", "DeclaredFitPolicy"),
    ("adaptive", "AdaptivePolicy"), ("least_outstanding-twin", "LeastOutstandingPolicy")])
def test_each_name_is_a_product_policy(name: str, cls: str) -> None:
    policy = BENCH.make_policy(name, 3)
    assert type(policy).__name__ == cls
    if isinstance(policy, AdaptivePolicy):  # the product's adaptive policy, as configured
        assert policy.config == AdaptivePolicy().config


def test_speed_index_is_the_median_latency_ratio_over_the_shared_cells() -> None:
    ref = {"a": {"x": (0.1, 0.010), "y": (0.2, 0.002)}, "b": {"x": (0.3, 0.003)}}
    # a/x: 0.5, 0.25; a/y: 0.5, 0.5; b/x: 1.0, 0.5; "z" and worker "c" are not in the reference
    probe = {"a": {"x": (0.2, 0.040), "y": (0.4, 0.004), "z": (9.0, 9.0)},
             "b": {"x": (0.3, 0.006)}, "c": {"x": (1.0, 1.0)}}
    assert BENCH.speed_index(ref, probe) == pytest.approx(0.5)
    assert BENCH.speed_index(ref, {"a": {"x": (0.05, 0.005)}}) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        BENCH.speed_index(ref, {"c": {"x": (1.0, 1.0)}})


def test_the_reference_probe_gives_speed_one_and_rates_scale_with_it() -> None:
    assert BENCH.speed_index(BENCH.REF_PROBE, BENCH.REF_PROBE) == pytest.approx(1.0)
    assert BENCH.rates_from_probe([5.0, 8.0, 11.0, 14.0], 0.49) == [2.5, 3.9, 5.4, 6.9]
    assert BENCH.rates_from_probe([0.1], 0.2) == [0.1]  # never 0 req/s


def parse(*argv: str) -> Any:
    ap = BENCH.build_parser()
    args = ap.parse_args(["--workload", "specbench", *argv])
    BENCH.check_args(ap, args)
    return args


def test_the_default_policies_are_the_baselines_and_adaptive() -> None:
    args = parse()
    assert args.policies == ["round_robin", "least_outstanding", "adaptive"]
    assert args.rates == [2.0] and args.rate_multiples is None and args.probe_passes == 1


def test_rate_multiples_stand_in_for_the_rates_until_the_probe_sets_them() -> None:
    args = parse("--rate-multiples", "11", "5", "8")
    assert args.rate_multiples == [5.0, 8.0, 11.0] and args.rates == [5.0, 8.0, 11.0]


@pytest.mark.parametrize("argv", [
    ("--rates", "4", "--rate-multiples", "5"),  # both
    ("--rate-multiples", "0", "5"),  # not positive
    ("--rates", "-1"),
    ("--policies", "adaptive", "adaptive"),  # twice
    ("--policies", "adaptive-stall"),  # unknown
    ("--probe-passes", "0"),
])
def test_bad_plans_are_refused(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit):
        parse(*argv)


def run(goodput: float, good: int, sent: int = 10) -> dict[str, Any]:
    return {"goodput": goodput, "num_good": good, "num_requests": sent}


ROUNDS = {"round_robin": [run(4.0, 4), run(2.0, 2)],
          "adaptive": [run(6.0, 6), run(6.0, 6)],
          "least_outstanding": [run(5.0, 5), run(3.0, 3)]}


def test_the_ratios_are_in_every_report_line() -> None:
    # rounds: 6/5 = 1.2 and 6/3 = 2.0 -> median 1.6; pooled 12 / 8 = 1.5
    assert "adaptive/least_outstanding 1.60x (1.20-2.00)" in BENCH.ratio_line(8.0, ROUNDS)
    assert "adaptive/round_robin 2.25x (1.50-3.00)" in BENCH.ratio_line(8.0, ROUNDS)
    line = BENCH.pooled_line("8.0", ROUNDS)
    assert "adaptive/least_outstanding 1.50x" in line and "adaptive/round_robin 2.00x" in line
    assert "least_outstanding-twin" not in line  # it did not run
    # peaks: medians RR 3, adaptive 6, LO 4
    assert BENCH.peak_summary({"rates": {"8.0": ROUNDS}})[-2:] == [
        "peak ratio adaptive/round_robin: 2.00x", "peak ratio adaptive/least_outstanding: 1.50x"]


@pytest.mark.parametrize("name", list(BENCH.POLICIES))
def test_every_policy_gets_a_valid_proxy_config_with_the_run_s_slos(name: str) -> None:
    slos = BENCH.Slos({c: 1.0 for c in BENCH.CLASSES}, {c: 0.01 for c in BENCH.CLASSES})
    configs = BENCH.fleet_configs("equal", 2, "cpu")
    config = BENCH.proxy_config(name, {n: f"http://{n}" for n in configs}, configs, slos)
    assert [w.name for w in config.workers] == ["spec", "batch", "long"]
    assert config.routing.slo_tpot_s["chat"] == 0.01
    base = BENCH.BASELINE_OF.get(name, name)
    baseline = base in ("round_robin", "least_outstanding", "declared_fit")
    assert config.speculation.mode == ("policy" if baseline else "adaptive")
    assert config.routing.policy == (base if baseline else "adaptive")
    assert all(w.max_outstanding == 0 for w in config.workers)
    assert not config.routing.forward_slos


def test_the_gpu_fleet_differs_as_a_gpu_fleet_does() -> None:
    configs = BENCH.fleet_configs("gpu", 2, "cuda")
    engines = {n: c.engine for n, c in configs.items()}
    assert {n: e.spec_method for n, e in engines.items()} == {
        "spec": "ngram", "draft": "draft", "batch": "none"}
    assert engines["spec"].max_num_seqs < engines["draft"].max_num_seqs < engines[
        "batch"].max_num_seqs
    assert engines["draft"].draft_model and all(e.device == "cuda" for e in engines.values())


DATA = Path(__file__).resolve().parents[2] / "data"


def test_a_warm_up_probe_pass_sends_other_prompts_than_the_pass_that_counts() -> None:
    # the counting pass sends what a one-pass probe sends; a warm-up pass the next ones, so
    # none of the counting pass's prompts is a prefix-cache hit
    four, first, second = (BENCH.class_prompts(DATA, n, skip) for n, skip in
                           ((4, 0), (2, 0), (2, 2)))
    for c in BENCH.CLASSES:
        assert four[c] == first[c] + second[c] and not set(first[c]) & set(second[c])
    trace = [BENCH.TraceRequest(line=i, prompt_tokens=640, hash_ids=(i,)) for i in range(10)]
    texts = BENCH.prefix_probe_texts(trace, 0, 3, 96, seed=1)
    assert BENCH.prefix_probe_texts(trace, 0, 2, 96, seed=1, skip=1) == texts[1:]
    assert len(set(texts)) == 3


def test_the_class_line_shows_where_each_class_went_and_what_met() -> None:
    rows = [{"class": "repetitive", "worker": "spec", "good": True},
            {"class": "repetitive", "worker": "batch", "good": False},
            {"class": "repetitive", "worker": "batch", "good": True},
            {"class": "prefix", "worker": None, "good": False}]
    assert BENCH.class_line(rows) == \
        "prefix 0/1 (none 1(0)); repetitive 2/3 (batch 2(1), spec 1(1))"
