"""The batch-size schedule fit (specdec.schedule) on tiny inputs with worked answers."""

from __future__ import annotations

import json

import pytest

from polyinfer.config import CompiledConfig, VllmConfig
from specdec.errors import ProposerConfigError
from specdec.policy import expected_tokens_per_step
from specdec.schedule import (
    ScheduleConfig,
    SpeculativeSchedule,
    acceptance_from_counts,
    acceptance_from_traces,
    best_depth,
    concurrency_at_arrival,
    domain_mix_by_load,
    fit_schedule,
    fit_step_time,
    with_schedule,
)
from specdec.step_model import StepTimeModel

# t(b, k) = 10 ms + 1 ms per sequence + 0.5 ms per sequence per speculated token
MODEL = StepTimeModel.from_coefficients((0.010, 0.001, 0.0005, 0.0))


def _rec(ts: float, e2e_s: float, domain: str = "chat", worker: str = "w", tokens: int = 10,
         **extra: object) -> dict[str, object]:
    return {"ts": ts, "e2e_s": e2e_s, "domain": domain, "worker": worker,
            "completion_tokens": tokens, "status": "ok", **extra}


def test_best_depth_worked_example():
    # batch 1, a = 0.7: goodput E(0.7, k) / t(1, k):
    #   k=0: 1/0.011 = 90.9   k=1: 1.7/0.0115 = 147.8   k=2: 2.19/0.012 = 182.5
    #   k=3: 2.533/0.0125 = 202.6   k=4: 2.773/0.013 = 213.3  -> k=4, gain 213.3/90.9
    k, gain = best_depth({"chat": 1.0}, {"chat": 0.7}, 1, MODEL, ScheduleConfig(max_depth=4))
    assert k == 4
    assert gain == pytest.approx(expected_tokens_per_step(0.7, 4) / 0.013 * 0.011)
    # with max_depth 3 the cap binds
    assert best_depth({"chat": 1.0}, {"chat": 0.7}, 1, MODEL, ScheduleConfig(max_depth=3))[0] == 3


def test_best_depth_zero_when_acceptance_is_low_or_batch_large():
    cfg = ScheduleConfig(max_depth=4)
    # a = 0.05: k=1 gives 1.05 / 0.0115 = 91.3 vs 90.9 at k=0: under min_gain 1.03
    assert best_depth({"qa": 1.0}, {"qa": 0.05}, 1, MODEL, cfg) == (0, 1.0)
    # batch 200, a = 0.5: k=1 costs 0.1 s more per step for 0.5 more tokens
    assert best_depth({"qa": 1.0}, {"qa": 0.5}, 200, MODEL, cfg)[0] == 0


def test_mixed_domains_weight_the_expected_tokens():
    cfg = ScheduleConfig(max_depth=4)
    code_only = best_depth({"code": 1.0}, {"code": 0.9, "chat": 0.1}, 8, MODEL, cfg)[0]
    chat_only = best_depth({"chat": 1.0}, {"code": 0.9, "chat": 0.1}, 8, MODEL, cfg)[0]
    mixed = best_depth({"code": 0.5, "chat": 0.5}, {"code": 0.9, "chat": 0.1}, 8, MODEL, cfg)[0]
    assert code_only == 4 and chat_only == 0
    assert 0 < mixed <= code_only


def test_ranges_compress_runs_and_k_for_carries_the_tail():
    s = SpeculativeSchedule((4, 4, 3, 3, 3, 0), (2.0,) * 6, {})
    assert s.ranges == ((1, 2, 4), (3, 5, 3), (6, 6, 0))
    assert s.max_k == 4
    assert [s.k_for(b) for b in (0, 1, 3, 6, 100)] == [4, 4, 3, 0, 0]
    spec = s.speculative_config({"method": "ngram", "prompt_lookup_max": 4})
    assert spec == {"method": "ngram", "prompt_lookup_max": 4, "num_speculative_tokens": 4,
                    "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 5, 3], [6, 6, 0]]}
    assert json.loads(s.speculative_config_json({"method": "ngram"}))[
        "num_speculative_tokens_per_batch_size"][0] == [1, 2, 4]


def test_all_zero_schedule_means_no_speculation():
    s = SpeculativeSchedule((0, 0), (1.0, 1.0), {})
    assert s.speculative_config({"method": "ngram"}) is None
    assert s.speculative_config_json({"method": "ngram"}) == ""


def test_fit_without_traces_uses_the_measured_domains():
    s = fit_schedule([], acceptance={"chat": 0.7}, step_time=MODEL,
                     config=ScheduleConfig(max_num_seqs=64, max_depth=4))
    assert s.ranges == ((1, 3, 4), (4, 8, 3), (9, 42, 2), (43, 64, 1))
    assert len(s.per_batch_k) == 64
    # k never increases with load on one domain mix
    assert list(s.per_batch_k) == sorted(s.per_batch_k, reverse=True)


def test_concurrency_at_arrival_per_worker():
    recs = [_rec(0.0, 10.0), _rec(1.0, 1.0), _rec(2.5, 1.0), _rec(3.0, 1.0),
            _rec(1.5, 5.0, worker="other")]
    # r0 alone; r1 joins r0; r2 arrives after r1 ended (2.0): r0 + r2;
    # r3 at 3.0: r0, r2 (ends 3.5), r3; the other worker counts alone
    assert concurrency_at_arrival(recs) == [1, 2, 2, 3, 1]


def test_acceptance_from_counts_inverts_the_geometric_model():
    # a = 0.5, k = 2: a step accepts 0.5 + 0.25 = 0.75 tokens; 100 steps draft 200
    assert acceptance_from_counts(200, 75, 2) == pytest.approx(0.5, abs=1e-6)
    assert acceptance_from_counts(100, 0, 4) == 0.0
    assert acceptance_from_counts(100, 100, 4) == 1.0
    with pytest.raises(ProposerConfigError):
        acceptance_from_counts(0, 0, 2)


def test_acceptance_from_traces_uses_record_depth_or_worker_depth():
    recs = [_rec(0, 1, "code", spec_depth=2, spec_draft_tokens=200, spec_accepted_tokens=75),
            _rec(0, 1, "chat", spec_draft_tokens=100, spec_accepted_tokens=0),
            _rec(0, 1, "qa")]
    assert acceptance_from_traces(recs) == pytest.approx({"code": 0.5})
    with_depth = acceptance_from_traces(recs, worker_depth=4)
    assert with_depth["code"] == pytest.approx(0.5) and with_depth["chat"] == 0.0


def test_domain_mix_by_load_falls_back_to_overall_when_thin():
    cfg = ScheduleConfig(load_buckets=(1, 4), min_bucket_requests=2)
    recs = [_rec(0, 1, "code", tokens=30), _rec(10, 1, "code", tokens=10),
            _rec(20, 1, "chat", tokens=40)]
    mixes = domain_mix_by_load(recs, [1, 1, 3], cfg)
    assert mixes[1] == {"code": 1.0}  # two requests at load 1: its own mix
    assert mixes[4] == {"code": 0.5, "chat": 0.5}  # one request: the overall token mix


def test_load_adaptive_mix_from_traces():
    """Alone, requests are code (acceptance 0.9); under load, chat (0.1): k drops with load."""
    recs = [_rec(float(10 * i), 1.0, "code", tokens=50) for i in range(30)]
    for burst in range(3):
        recs += [_rec(1000.0 + 100 * burst + 0.01 * j, 5.0, "chat", tokens=50) for j in range(16)]
    s = fit_schedule(recs, acceptance={"code": 0.9, "chat": 0.1}, step_time=MODEL,
                     config=ScheduleConfig(max_num_seqs=16, max_depth=5, min_bucket_requests=5))
    assert s.k_for(1) >= 4
    assert s.k_for(16) == 0


def test_fit_step_time_learns_from_trace_decode_times():
    """Records generated from t(b, 0) = 20 ms + 2 ms * b pull the model's k=0 slope there."""
    recs = []
    for group in range(2):
        for j in range(8):  # the j-th of a burst arrives with j others in flight
            step = 0.020 + 0.002 * (j + 1)
            recs.append(_rec(100.0 * group + 0.001 * j, 0.05 + 50 * step, tokens=51, ttft_s=0.05))
    loads = concurrency_at_arrival(recs)
    assert loads[:8] == list(range(1, 9))
    model = fit_step_time(recs, loads, MODEL)
    assert model.predict(1, 0) == pytest.approx(MODEL.predict(1, 0))  # heavy prior: unmoved
    free = fit_step_time(recs, loads, StepTimeModel.from_prior((0.01, 0.001, 0.0005, 0.0), 1e-3))
    for load in (1, 4, 8):
        assert free.predict(load, 0) == pytest.approx(0.020 + 0.002 * load, rel=0.05)


def test_unusable_records_are_ignored():
    recs = [_rec(0, 1, "code"), {"ts": 1.0, "e2e_s": None, "status": "error"},
            {"ts": "x", "e2e_s": 1.0}, _rec(2, float("nan"))]
    s = fit_schedule(recs, acceptance={"code": 0.8}, step_time=MODEL,
                     config=ScheduleConfig(max_num_seqs=4))
    assert len(s.per_batch_k) == 4 and s.k_for(1) > 0


@pytest.mark.parametrize("field,value", [("max_num_seqs", 0), ("max_depth", 0),
                                         ("max_depth", 17), ("min_gain", 0.9),
                                         ("prior_acceptance", 1.0), ("load_buckets", (4, 2)),
                                         ("load_buckets", ()), ("min_bucket_requests", 0)])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ProposerConfigError, match=field):
        ScheduleConfig(**{field: value})


def test_with_schedule_keeps_the_method_and_replaces_the_schedule():
    old = json.dumps({"method": "ngram", "prompt_lookup_max": 4, "num_speculative_tokens": 5,
                      "num_speculative_tokens_per_batch_size": [[1, 8, 5]]})
    config = CompiledConfig(backend="vllm", vllm=VllmConfig(speculative_config=old))
    new = with_schedule(config, SpeculativeSchedule((3, 1, 0), (1.5, 1.1, 1.0), {}))
    assert new.vllm.speculative == {"method": "ngram", "prompt_lookup_max": 4,
                                    "num_speculative_tokens": 3,
                                    "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 2, 1],
                                                                              [3, 3, 0]]}
    assert new.backend == "vllm" and config.vllm.speculative_config == old  # not mutated
    off = with_schedule(config, SpeculativeSchedule((0, 0), (1.0, 1.0), {}))
    assert off.vllm.speculative_config == "" and off.vllm.speculative is None
    with pytest.raises(ProposerConfigError, match="method"):
        with_schedule(CompiledConfig(backend="vllm"), SpeculativeSchedule((2,), (1.2,), {}))
