"""Pure decision cores: pruning + audit, paired gain, switch pricing, rollback, cost model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from optimizer.abtest import paired_gain
from optimizer.costmodel import (
    CostModel,
    ForwardTimeModel,
    HardwareConstants,
    Workload,
    expected_tokens_per_step,
    roofline_s,
)
from optimizer.profile import build_profile
from optimizer.promote import LiveSample, Promoter, PromotionConfig, window_tpot
from optimizer.pruner import PruneConfig, Pruner
from optimizer.space import SearchSpace
from polyinfer.config import CompiledConfig
from polyinfer.trace import TraceRecord


def test_pruner_waits_for_calibration_then_prunes_and_audits() -> None:
    pruner = Pruner(PruneConfig(margin=0.25, audit_every=2, min_calibration=3),
                    predict=lambda cfg: float(cfg.engine.max_num_seqs))
    cfg = CompiledConfig().with_engine(max_num_seqs=4)
    assert not pruner.decide(cfg, best_measured=100.0, num_calibration=2).prune
    assert not pruner.decide(cfg, best_measured=None, num_calibration=9).prune
    first = pruner.decide(cfg, best_measured=100.0, num_calibration=3)
    assert first.prune and not first.audit and first.threshold == 75.0
    second = pruner.decide(cfg, best_measured=100.0, num_calibration=3)
    assert second.prune and second.audit
    assert not pruner.decide(cfg.with_engine(max_num_seqs=32, max_num_batched_tokens=2048), 40.0,
                             3).prune
    assert pruner.record_audit(second, measured=80.0) is True  # not clearly worse after all
    assert pruner.record_audit(second, measured=50.0) is False
    snap = pruner.snapshot()
    assert (snap["considered"], snap["pruned"], snap["audited"], snap["wrong"]) == (5, 2, 2, 1)
    assert snap["wrong_rate"] == 0.5


def test_paired_gain_beyond_noise() -> None:
    steady = paired_gain([110.0, 111.0, 109.0], [100.0, 100.5, 99.5])
    assert steady.significant and steady.gain == pytest.approx(0.10, abs=0.005)
    noisy = paired_gain([150.0, 80.0, 110.0], [100.0, 100.0, 100.0])
    assert not noisy.significant and noisy.noise > 0.1
    small = paired_gain([101.0, 101.0, 101.0], [100.0, 100.0, 100.0], min_gain=0.02)
    assert not small.significant  # no noise at all, but below the minimum gain
    one = paired_gain([104.0], [100.0])
    assert one.noise == 0.05 and not one.significant
    assert not paired_gain([0.0], [100.0]).significant


def test_switch_is_priced_by_backend() -> None:
    cfg = PromotionConfig(restart_cost_s=120.0, payback_horizon_s=1800.0)
    # 5% gain saves 1800 * 0.05 / 1.05 = 85.7 s of served work
    assert cfg.worth_switching(0.05, "engine", measured_reload_s=0.3)
    assert not cfg.worth_switching(0.05, "vllm")
    assert cfg.worth_switching(0.10, "vllm")  # saves 163.6 s > 120 s
    assert not cfg.worth_switching(-0.1, "engine", 0.0)


def test_window_tpot_and_rollback_rule() -> None:
    a = LiveSample(0.0, tpot_sum_s=1.0, tpot_count=100, e2e_count=10)
    b = LiveSample(5.0, tpot_sum_s=3.0, tpot_count=200, e2e_count=15)
    assert window_tpot(a, b) == (pytest.approx(0.02), 5)
    assert window_tpot(b, b) == (None, 0)
    promoter = Promoter(None, PromotionConfig(min_requests=3, max_tpot_regression=0.15))  # type: ignore[arg-type]
    assert promoter._regressed(0.020, 5, 0.024, 5)
    assert not promoter._regressed(0.020, 5, 0.022, 5)
    assert not promoter._regressed(0.020, 2, 0.040, 5)  # too little traffic before
    assert not promoter._regressed(None, 5, 0.040, 5)


def test_ttft_regression_rolls_back_with_its_reason() -> None:
    promoter = Promoter(None, PromotionConfig(min_requests=3))  # type: ignore[arg-type]
    before = (LiveSample(0.0, 1.0, 100, 10, ttft_sum_s=1.0, ttft_count=10),
              LiveSample(5.0, 2.0, 200, 20, ttft_sum_s=2.0, ttft_count=20))  # TTFT 0.1 s
    slow_start = (LiveSample(6.0, 2.0, 200, 20, ttft_sum_s=2.0, ttft_count=20),
                  LiveSample(11.0, 3.0, 300, 30, ttft_sum_s=4.0, ttft_count=30))  # 0.2 s
    assert "TTFT" in promoter._regression(*before, *slow_start)
    same = (slow_start[0], LiveSample(11.0, 3.0, 300, 30, ttft_sum_s=3.1, ttft_count=30))
    assert promoter._regression(*before, *same) == ""


def test_expected_tokens_per_step() -> None:
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(0.5, 0) == 1.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


@pytest.fixture
def cost_model(model_dir: Path) -> tuple[CostModel, Workload, SearchSpace]:
    base = CompiledConfig(model=str(model_dir)).with_engine(kv_cache_tokens=8192,
                                                            max_model_len=1024)
    space = SearchSpace.default(base, 1 << 30)
    hw = HardwareConstants(mem_bandwidth_bps=10e9, matmul_flops=20e9)
    steps = ForwardTimeModel(space.shape, hw, overhead_s=0.004, scale=2.0)
    profile = build_profile([TraceRecord(float(i), "code", 200, completion_tokens=40)
                             for i in range(10)])
    return CostModel(space, steps), Workload(8, profile), space


def test_roofline_and_step_model(cost_model: tuple[CostModel, Workload, SearchSpace]) -> None:
    model, _, space = cost_model
    hw = model.steps.hw
    params = space.shape.num_params()
    assert roofline_s(space.shape, hw, 1) == pytest.approx(params * 4 / 10e9)
    assert roofline_s(space.shape, hw, 10_000) == pytest.approx(2 * params * 10_000 / 20e9)
    assert model.steps.step_s(1, num_layers=2) < model.steps.step_s(1)


def test_cost_model_ranks_batching_and_calibrates(
        cost_model: tuple[CostModel, Workload, SearchSpace]) -> None:
    model, work, space = cost_model
    one = space.build({"max_num_seqs": 1, "max_num_batched_tokens": 1024})
    eight = space.build({"max_num_seqs": 8, "max_num_batched_tokens": 1024})
    spec = space.build({"max_num_seqs": 8, "max_num_batched_tokens": 1024,
                        "spec_method": "ngram", "spec_max_depth": 4, "spec_default_depth": 3})
    # prefill (200 tokens at ~1.7 ms each here) dominates, so batching gains < 2x
    assert model.predict(eight, work) > 1.5 * model.predict(one, work)
    assert model.predict(spec, work) != model.predict(eight, work)
    # measured twice the analytic value everywhere: calibration learns the scale
    measured = [(c, 2 * model.analytic(c, work)) for c in (one, eight, spec)]
    model.calibrate(measured, work)
    for c, v in measured:
        assert model.predict(c, work) == pytest.approx(v, rel=0.05)
    assert model.num_calibration_points == 3


def test_step_time_fit_on_this_machine(model_dir: Path) -> None:
    space = SearchSpace.default(CompiledConfig(model=str(model_dir)).with_engine(
        kv_cache_tokens=8192, max_model_len=1024), 1 << 30)
    hw = HardwareConstants.measure(size_mb=8, matmul_n=128, repeats=2)
    assert hw.mem_bandwidth_bps > 1e8 and hw.matmul_flops > 1e8
    steps = ForwardTimeModel.fit(space.shape, hw, token_counts=(1, 16), repeats=1)
    assert [n for n, _ in steps.samples] == [1, 16]
    assert all(s > 0 and math.isfinite(s) for _, s in steps.samples)
    assert steps.step_s(16) >= steps.step_s(1)


def test_identical_ratios_still_carry_the_noise_floor() -> None:
    # identical ratios (a coarse clock) must not read as zero noise: 2 x 1% is the bar
    g = paired_gain([101.5, 101.5, 101.5], [100.0, 100.0, 100.0], min_gain=0.0)
    assert g.noise == 0.01 and not g.significant
    # 3% over 5 pairs at the 1% floor: the t interval (2.78 x 1%) clears 0
    assert paired_gain([103.0] * 5, [100.0] * 5, min_gain=0.0).significant


def test_gain_counts_only_when_its_interval_clears_the_minimum() -> None:
    g = paired_gain([105.0, 106.0, 104.0, 105.5, 105.0, 104.5], [100.0] * 6, min_gain=0.02)
    assert g.significant and g.ci_low > 0.02 and g.ci_low < g.gain < g.ci_high
    # the same +5% mean with +-4% per-pair noise: the interval reaches below 2%
    wide = paired_gain([109.0, 101.0] * 3, [100.0] * 6, min_gain=0.02)
    assert wide.gain > 0.04 and wide.ci_low < 0.02 and not wide.significant


def test_sample_size_follows_the_measured_variance() -> None:
    from optimizer.abtest import detectable_effect, pairs_needed

    # n = ((1.96 + 0.84) * sd / log(1.05))^2: 10% per-pair noise needs ~33 pairs for 5%
    assert pairs_needed(0.10, 0.05) == 33
    assert pairs_needed(0.02, 0.05) == 2  # quiet pairs: the pilot already suffices
    assert pairs_needed(0.10, 0.05, max_pairs=10) == 10
    assert detectable_effect(0.10, 33) == pytest.approx(0.05, abs=0.002)


def test_finalists_include_the_best_of_each_spec_method() -> None:
    from optimizer.campaign import pick_finalists

    def key(seqs: int, method: str) -> str:
        return json.dumps({"max_num_seqs": seqs, "spec_method": method}, sort_keys=True)

    measured = {key(32, "none"): 100.0, key(16, "none"): 130.0, key(8, "none"): 125.0,
                key(4, "none"): 120.0, key(4, "ngram"): 110.0, key(8, "ngram"): 105.0,
                key(1, "draft"): 90.0}
    assert pick_finalists(measured, key(32, "none"), 2, None) == [key(16, "none"),
                                                                  key(8, "none")]
    # ngram's best joins; draft (90) is within 15% of the incumbent (100) too, but not 5%
    assert pick_finalists(measured, key(32, "none"), 2, 0.15) == [
        key(16, "none"), key(8, "none"), key(4, "ngram"), key(1, "draft")]
    assert pick_finalists(measured, key(32, "none"), 2, 0.05) == [
        key(16, "none"), key(8, "none"), key(4, "ngram")]
    assert pick_finalists({key(32, "none"): 1.0}, key(32, "none"), 2, 0.15) == []
