"""The prefix-mix simulation's SLOs by the bench's rule (bench/sim/prefix_mix_sim.py)."""

from __future__ import annotations

import pytest

from bench.sim.prefix_mix_sim import CONTEXT_S, class_of, prefix_mix, rule_slos


def test_rule_slos_are_the_bench_rule_on_the_model_s_unloaded_latencies() -> None:
    slos = rule_slos()
    step = 0.0025 + 0.00015  # one sequence's step on any worker
    # TPOT: 2.5 x the best unloaded; repetitive's best is spec, whose n-gram halves the step
    assert slos["repetitive"][1] == pytest.approx(2.5 * 0.5 * step)
    assert slos["conversational"][1] == pytest.approx(2.5 * step)
    assert slos["long"][1] == pytest.approx(5.0 * step)
    # TTFT: 10 x (a median short prompt's prefill + a step); 5 x for a median long one
    assert slos["conversational"][0] == pytest.approx(10 * (215 * 0.0002 + step))
    assert slos["long"][0] == pytest.approx(5 * (1050 * 0.0002 + step))
    # with context: a shared-prefix prompt's decode pays for its context, and spec's n-gram
    # no longer speeds it (so its SLO is loose, as on the device)
    ctx = rule_slos(CONTEXT_S)
    assert ctx["prefix"][1] == pytest.approx(5.0 * (step + CONTEXT_S * 960))
    assert ctx["prefix"][1] > 2 * ctx["conversational"][1]


def test_prefix_mix_carries_the_given_slos() -> None:
    slos = rule_slos(CONTEXT_S)
    for _, shape in prefix_mix(8.0, 60, 1, tight=True, slos=slos):
        assert (shape.slo_ttft_s, shape.slo_tpot_s) == slos[class_of(shape)]
