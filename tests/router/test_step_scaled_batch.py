"""TPOT's growth with the batch from the worker's own measured steps (the engine's step feed),
not from the requests' TPOT: profiles learn at batch 1, crowding is the steps' fraction.
Answers written out."""

from __future__ import annotations

import numpy as np
import pytest

from polyinfer.config import CompiledConfig
from router.adaptive import AdaptiveConfig, AdaptivePolicy
from router.base import RequestOutcome, RequestShape, WorkerView
from router.inflight import Flight
from router.profiles import LatencyPrior, PriorConfig, WorkerProfile
from specdec.policy import DepthPolicy
from specdec.step_model import NUM_FEATURES, step_features

SPEC = CompiledConfig().with_engine(max_num_seqs=4, max_num_batched_tokens=256,
                                    spec_method="ngram", spec_max_depth=4)
BATCH = CompiledConfig().with_engine(max_num_seqs=32, max_num_batched_tokens=256)
NO_EXPLORE = AdaptiveConfig(explore_prob=0.0)


def feed_linear_steps(depth_policy: DepthPolicy, worker: str, base_s: float, per_seq_s: float,
                      steps_per_batch: int = 1000) -> None:
    """The engine's step sums for plain decode steps taking base + per_seq x batch seconds,
    batches 1-4 (specdec.step_feed's weights: 1 / step^2)."""
    xtx, xty = np.zeros((NUM_FEATURES, NUM_FEATURES)), np.zeros(NUM_FEATURES)
    for b in (1, 2, 3, 4):
        x = np.array(step_features(b, 0, 0))
        y = base_s + per_seq_s * b
        xtx += steps_per_batch / y**2 * np.outer(x, x)
        xty += steps_per_batch / y * x
    depth_policy.observe_step_sums(worker, xtx.tolist(), xty.tolist(), 4 * steps_per_batch)


def test_profile_learns_at_batch_one_and_scales_by_the_step_ratio() -> None:
    prof = WorkerProfile(LatencyPrior(SPEC, PriorConfig()))
    # physics: 2 ms at batch 1, steps 25% longer per added sequence
    for _ in range(200):
        for b in (1, 2, 3, 4):
            ratio = 1.0 + 0.25 * (b - 1)
            prof.observe("chat", 100, b - 1, b, 0, 0.05, 0.002 * ratio, step_ratio=ratio)
    one = prof.predict("chat", 100, 0, 1, 0, step_ratio=1.0).tpot_s
    assert one == pytest.approx(0.002, rel=0.01)
    # at batch 4 (ratio 1.75): 3.5 ms, exactly the batch-1 prediction x the ratio
    four = prof.predict("chat", 100, 3, 4, 0, step_ratio=1.75).tpot_s
    assert four == pytest.approx(0.0035, rel=0.01)
    assert four == pytest.approx(1.75 * one, rel=1e-12)


def test_load_correlated_excess_does_not_become_a_batch_slope() -> None:
    """Round 4's spec worker: the requests' TPOT rises with load far faster than the steps
    (stalls left in, lower depth under load). Learned against the batch, that excess is a
    per-sequence charge of ~6 ms; with the step ratio it is level (a higher intercept)."""
    old = WorkerProfile(LatencyPrior(SPEC, PriorConfig()))
    new = WorkerProfile(LatencyPrior(SPEC, PriorConfig()))
    for _ in range(200):
        for b in (1, 2, 3, 4):
            ratio = 1.0 + 0.25 * (b - 1)
            tpot = 0.002 * ratio + 0.006 * (b - 1)  # 2 / 8.5 / 15 / 21.5 ms
            old.observe("chat", 100, b - 1, b, 0, 0.05, tpot)
            new.observe("chat", 100, b - 1, b, 0, 0.05, tpot, step_ratio=ratio)
    assert old.tpot_per_seq_s() == pytest.approx(0.0065, rel=0.05)  # 6 ms + the steps' 0.5
    old_1, old_4 = (old.predict("chat", 100, b - 1, b, 0).tpot_s for b in (1, 4))
    new_1, new_4 = (new.predict("chat", 100, b - 1, b, 0, step_ratio=1.0 + 0.25 * (b - 1)
                                ).tpot_s for b in (1, 4))
    assert old_4 / old_1 == pytest.approx(21.5 / 2.0, rel=0.1)
    assert new_4 / new_1 == pytest.approx(1.75, rel=1e-9)  # the steps' growth, no more


def test_bad_step_ratios_are_ignored() -> None:
    prof = WorkerProfile(LatencyPrior(SPEC, PriorConfig()))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert prof.predict("chat", 100, 2, 3, 0, step_ratio=bad) == \
            prof.predict("chat", 100, 2, 3, 0)
        prof.observe("chat", 100, 2, 3, 0, 0.05, 0.004, step_ratio=bad)
    assert prof.num_samples("chat", 100) == 4


def test_step_ratio_and_crowding_come_from_the_fed_steps() -> None:
    p = AdaptivePolicy(NO_EXPLORE)
    assert p.step_ratio("spec", 3, 0) is None  # nothing fed: the profiles' slope, as before
    feed_linear_steps(p.depth_policy, "spec", 0.010, 0.002)
    # t(b) = 10 + 2b ms: t(3) / t(1) = 16 / 12 (the step model's prior pulls a little)
    assert p.step_ratio("spec", 3, 0) == pytest.approx(16 / 12, rel=0.01)
    prof = p.profile(WorkerView("spec", "http://s", "engine", SPEC))
    # two running: joining makes their steps t(3) / t(2) - 1 = 16 / 14 - 1 longer
    crowd_s, frac = p._crowding("spec", prof, 2, 4, 0)
    assert crowd_s == 0.0 and frac == pytest.approx(16 / 14 - 1, rel=0.05)
    assert p._crowding("spec", prof, 4, 4, 0) == (0.0, 0.0)  # at capacity it waits
    assert p._crowding("spec", prof, 0, 4, 0) == (0.0, 0.0)  # nobody to slow
    off = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0, step_scaled_batch=False))
    feed_linear_steps(off.depth_policy, "spec", 0.010, 0.002)
    assert off.step_ratio("spec", 3, 0) is None
    assert off._crowding("spec", prof, 2, 4, 0) == (prof.tpot_per_seq_s(), 0.0)
    # /stats: t(2), t(4), t(8) over t(1) = 14 / 12, 18 / 12, 26 / 12
    assert p.stats()["step_ratios"]["spec"] == pytest.approx([14 / 12, 18 / 12, 26 / 12],
                                                             rel=0.02)
    assert off.stats()["step_ratios"] == {}


def test_the_step_ratio_ignores_the_client_side_overhead() -> None:
    """The step model also learns, per batch bucket, what clients wait per step beyond the
    engine's step (from requests' mean step times): not part of the batch's step cost."""
    p = AdaptivePolicy(NO_EXPLORE)
    feed_linear_steps(p.depth_policy, "spec", 0.010, 0.002)
    before = [p.step_ratio("spec", b, 0) for b in (2, 3, 4)]
    model = p.depth_policy.step_time("spec")
    for _ in range(50):  # requests at batch 2 saw 20 ms per step beyond the 14-ms steps
        model.observe(2, 0, 0.034)
    assert model.overhead(2) == pytest.approx(0.020, rel=0.01)
    assert [p.step_ratio("spec", b, 0) for b in (2, 3, 4)] == before


def test_crowd_delay_is_the_fraction_of_the_shared_time() -> None:
    f = Flight("spec", 1, 2, 0, sent_s=0.0, ttft_s=0.1, tpot_s=0.002, num_tokens=101,
               prefill_s=0.0)  # predicted cost 0.3 s
    # the new request costs 0.2 s, the flight has 0.25 s left at t = 0.05: 0.2 s shared
    assert AdaptivePolicy._crowd_delay(f, 0.05, 0.2, 0.0, 0.1) == pytest.approx(0.02)
    # the profile's slope: 0.5 ms per shared step, 0.2 / 0.002 = 100 steps
    assert AdaptivePolicy._crowd_delay(f, 0.05, 0.2, 0.0005, 0.0) == pytest.approx(0.05)


def test_a_tight_slo_request_is_not_priced_off_the_fast_worker_by_an_inflated_slope() -> None:
    """Round 4's spec worker: short requests' TPOT grows with its steps (2 ms at batch 1,
    +15% per sequence), while long-prompt requests there meet ~6 ms more per concurrent
    request (stalls); a batch worker gives 3.4 ms. With one short request running on spec,
    the next 3.2-ms-SLO one belongs on spec too (~2.3 ms each). Round 4's pricing charges
    the running one the worker-level slope the long prompts taught (~6.5 ms per token) and
    sends it to batch; the steps' fraction keeps it on spec."""
    ws = [WorkerView("spec", "http://s", "engine", SPEC),
          WorkerView("batch", "http://b", "engine", BATCH)]
    picks = {}
    for scaled in (True, False):
        p = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0, step_scaled_batch=scaled))
        feed_linear_steps(p.depth_policy, "spec", 0.0017, 0.0003)  # 2 ms x (1 + 0.15 (b - 1))
        feed_linear_steps(p.depth_policy, "batch", 0.0034, 0.00001)
        for i in range(200):
            b = 1 + i % 4
            spec = WorkerView("spec", "http://s", "engine", SPEC, outstanding_requests=b - 1)
            steps = 0.002 * (1 + 0.15 * (b - 1))
            for prompt, tpot in ((1200, steps + 0.006 * (b - 1)), (100, steps)):
                s = RequestShape("code" if prompt > 600 else "chat", prompt, None, 100,
                                 speculative_depth=0)
                p.choose(s, [spec])
                p.observe(RequestOutcome("spec", s, "ok", completion_tokens=100, ttft_s=0.02,
                                         tpot_s=tpot, e2e_s=0.02 + 99 * tpot))
            s = RequestShape("chat", 100, None, 100)
            p.choose(s, [ws[1]])
            p.observe(RequestOutcome("batch", s, "ok", completion_tokens=100, ttft_s=0.02,
                                     tpot_s=0.0034, e2e_s=0.02 + 99 * 0.0034))
        first = RequestShape("chat", 100, None, 100, slo_tpot_s=0.0032, speculative_depth=0)
        assert p.choose(first, ws).worker == "spec"  # alone there: both pricings agree
        loaded = [WorkerView("spec", "http://s", "engine", SPEC, outstanding_requests=1), ws[1]]
        second = RequestShape("chat", 100, None, 100, slo_tpot_s=0.0032, speculative_depth=0)
        picks[scaled] = p.choose(second, loaded).worker
    assert picks == {True: "spec", False: "batch"}
