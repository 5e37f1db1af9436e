"""Depth policy: expected answers on small inputs, worked out by hand in the comments."""

from __future__ import annotations

import random

import orjson
import pytest

from specdec.errors import ProposerConfigError
from specdec.policy import (
    AcceptanceEstimate,
    DepthPolicy,
    PolicyConfig,
    batch_tokens_per_step,
    choose_depth,
    expected_tokens_per_step,
    solve_acceptance,
)
from specdec.step_model import StepTimeModel, longest_proposal, token_cost, token_costs


def _model(w0: float, wb: float, wbk: float, wk: float) -> StepTimeModel:
    return StepTimeModel.from_coefficients((w0, wb, wbk, wk))


def test_expected_tokens_per_step() -> None:
    assert expected_tokens_per_step(0.5, 3) == pytest.approx(1.875)  # 1 + .5 + .25 + .125
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.9, 0) == pytest.approx(1.0)


def test_free_speculation_goes_to_the_cap() -> None:
    flat = _model(0.01, 0.0, 0.0, 0.0)  # k costs nothing: deeper is always better
    assert choose_depth(0.3, batch=1, step_time=flat, max_depth=5) == 5
    assert choose_depth(0.3, batch=1, step_time=flat, max_depth=0) == 0


def test_interior_optimum() -> None:
    # t(1, k) = 0.010 + 0.002 k, a = 0.8; E/t for k = 0..5:
    # 100, 1.8/.012 = 150, 2.44/.014 = 174.3, 2.952/.016 = 184.5, 3.3616/.018 = 186.8,
    # 3.6893/.020 = 184.5  -> k = 4
    model = _model(0.010, 0.0, 0.0, 0.002)
    assert choose_depth(0.8, batch=1, step_time=model, max_depth=8) == 4
    # a = 0.6 with t = 0.010 + 0.005 k: 100, 1.6/.015 = 106.7, 1.96/.020 = 98 -> k = 1
    assert choose_depth(0.6, 1, _model(0.010, 0.0, 0.0, 0.005), 8) == 1


def test_high_load_and_low_acceptance_turn_speculation_off() -> None:
    # t(b, k) = 0.010 + 0.001 b + 0.0005 b k, a = 0.4
    model = _model(0.010, 0.001, 0.0005, 0.0)
    # b = 1: t = .011 + .0005k; E/t: 90.9, 1.4/.0115 = 121.7, 1.56/.012 = 130.0,
    # 1.624/.0125 = 129.9 -> k = 2
    assert choose_depth(0.4, batch=1, step_time=model, max_depth=6) == 2
    # b = 64: t = .074 + .032k; E/t: 13.51, 1.4/.106 = 13.21 -> no k pays -> 0
    assert choose_depth(0.4, batch=64, step_time=model, max_depth=6) == 0
    # same load, a = 0.7: 1.7/.106 = 16.04, 2.19/.138 = 15.87 -> k = 1
    assert choose_depth(0.7, batch=64, step_time=model, max_depth=6) == 1


def test_min_gain_requires_a_margin() -> None:
    flat = _model(0.01, 0.0, 0.0, 0.0)
    # a = 0.01: k = 6 gives E = 1.0101 -> 1% better than k = 0
    assert choose_depth(0.01, 1, flat, 6, min_gain=1.0) == 6
    assert choose_depth(0.01, 1, flat, 6, min_gain=1.03) == 0


def test_prompt_tokens_in_a_step_are_not_spread_over_speculated_tokens() -> None:
    # t(1, k) = 0.010 + 0.008 k + 0.0005 x prompt tokens in the step; E(1) = 1.5.
    model = StepTimeModel.from_coefficients((0.010, 0.0, 0.0, 0.008, 0.0, 0.0005))
    tokens = [1.0, 1.5]
    # No prefill: 1 / .010 = 100 against 1.5 / .018 = 83.3 -> 0
    assert choose_depth(0.5, 1, model, 1, tokens_per_step=tokens) == 0
    # 100 prompt tokens per step on average: .050 s of every step
    model.prefill_tokens, model.prefill_steps = 100.0, 1.0
    assert model.prefill_part(1) == pytest.approx(0.050)
    # Per token, k=0: .060; k=1: (.068 - .050) / 1.5 + .050 = .062 -> still 0.
    # (Spread over E with the rest, 1.5 / .068 = 22.1 beat 1 / .060 = 16.7: k=1.)
    assert choose_depth(0.5, 1, model, 1, tokens_per_step=tokens) == 0
    # A cheaper draft: t(1, 1) = .0636, (.0136) / 1.5 + .050 = .0591 < .060 -> k=1
    cheap = StepTimeModel.from_coefficients((0.010, 0.0, 0.0, 0.0036, 0.0, 0.0005))
    cheap.prefill_tokens, cheap.prefill_steps = 100.0, 1.0
    assert choose_depth(0.5, 1, cheap, 1, tokens_per_step=tokens) == 1


def test_measured_cost_per_token_moves_a_depth_only_by_how_it_differs_between_depths() -> None:
    # A flat 10-ms step: a token costs .010 / E(k); E = 1, 1.5, 1.8 -> k=2 (180 vs 150, 100)
    tokens = [1.0, 1.5, 1.8]
    model = _model(0.010, 0.0, 0.0, 0.0)
    assert choose_depth(0.5, 1, model, 2, tokens_per_step=tokens) == 2
    # Clients measure the same 3x over the model at every depth: nothing changes
    for k in (0, 1, 2):
        for _ in range(20):
            model.observe_token_cost(1, k, 3 * 0.010 / tokens[k], tokens[k], float(k) or None)
    assert model.calibration(1, 0) == pytest.approx(3.0)
    assert choose_depth(0.5, 1, model, 2, tokens_per_step=tokens) == 2
    # k=0 as the model says, k=2 2x over it, k=1 never measured (20 samples each): log means
    # over all depths (0 + ln 2) / 2 = .3466; over the speculating ones, shrunk toward that by
    # the prior's 8 samples, (ln 2 x 20 + .3466 x 8) / 28 = .5941; k=0 (0 x 20 + .3466 x 8) / 28
    # = .0990 -> x1.104, k=2 (ln 2 x 20 + .5941 x 8) / 28 = .6649 -> x1.944, k=1 the
    # speculating depths' x1.811
    model = _model(0.010, 0.0, 0.0, 0.0)
    for _ in range(20):
        model.observe_token_cost(1, 0, 0.010, 1.0)
        model.observe_token_cost(1, 2, 2 * 0.010 / 1.8, 1.8, 2.0)
    assert model.calibration(1, 0) == pytest.approx(1.1041, abs=1e-3)
    assert model.calibration(1, 2) == pytest.approx(1.9442, abs=1e-3)
    assert model.calibration(1, 1) == pytest.approx(1.8114, abs=1e-3)
    assert model.calibration(2, 2) == model.calibration(1, 2)  # the nearest measured bucket
    # tokens per cost: k=0 1 / 1.104 = .906, k=1 1.5 / 1.811 = .828, k=2 1.8 / 1.944 = .926
    assert choose_depth(0.5, 1, model, 2, tokens_per_step=tokens) == 2
    # k=1 measured as the model says (20 samples): the bucket's mean ln 2 / 3 = .2310, the
    # speculating depths' (ln 2 x 20 + .2310 x 8) / 48 = .3273; k=1 .3273 x 8 / 28 -> x1.098,
    # k=2 (ln 2 x 20 + .3273 x 8) / 28 -> x1.801, k=0 -> x1.068: 1.5 / 1.098 = 1.37 -> 1
    for _ in range(20):
        model.observe_token_cost(1, 1, 0.010 / 1.5, 1.5, 1.0)
    assert model.calibration(1, 1) == pytest.approx(1.0979, abs=1e-3)
    assert model.calibration(1, 2) == pytest.approx(1.8010, abs=1e-3)
    assert choose_depth(0.5, 1, model, 2, tokens_per_step=tokens) == 1


def test_few_stalled_speculating_requests_do_not_price_every_depth() -> None:
    """The spec worker's 2-sequence bucket on the device: two short requests at
    k=6 that shared prefill chunks measured 6x the model's cost a token, beside many k=0
    requests as modelled; every k > 0 there came out at the clamp (x4) and the policy sent
    k=0. Weighted by their tokens and shrunk toward the bucket's mean, they move it little."""
    model = _model(0.010, 0.0, 0.0, 0.0)
    for _ in range(50):
        model.observe_token_cost(2, 0, 0.010, 1.0, tokens=40)
    for _ in range(2):
        model.observe_token_cost(2, 6, 6 * 0.010 / 2.5, 2.5, 6.0, tokens=7)
    factors = model.calibrations(2, 6)
    assert factors[0] == pytest.approx(1.0, abs=0.05)
    assert all(f < 1.5 for f in factors[1:])
    # k=6 at E = 2.5 is 2.5x k=0's tokens a step: still chosen
    assert choose_depth(0.6, 2, model, 6, tokens_per_step=[1.0, 1.6, 1.9, 2.1, 2.3, 2.4, 2.5]) > 0
    # a long speculating request that measured the same weighs as much as many short ones
    short, long = _model(0.010, 0.0, 0.0, 0.0), _model(0.010, 0.0, 0.0, 0.0)
    for m, samples in ((short, [(0.004, 7)] * 9 + [(0.012, 63)]),
                       (long, [(0.004, 63)] + [(0.012, 7)] * 9)):
        for seconds, tokens in samples:
            m.observe_token_cost(1, 2, seconds, 2.0, 2.0, tokens=tokens)
    assert short.token_costs[(1, 2)][0] == pytest.approx((9 * 7 * 0.004 + 63 * 0.012) / 126)
    assert long.token_costs[(1, 2)][0] == pytest.approx((63 * 0.004 + 9 * 7 * 0.012) / 126)
    assert short.token_costs[(1, 2)][4] == long.token_costs[(1, 2)][4] == 10


def test_calibration_is_read_against_the_model_as_it_is_now() -> None:
    # Measured 5 ms a token at k=2 (E = 2) when the model said a 10-ms step: x1 then.
    model = _model(0.010, 0.0, 0.0, 0.0)
    for _ in range(10):
        model.observe_token_cost(1, 2, 0.005, 2.0, 2.0)
    assert model.calibration(1, 2) == pytest.approx(1.0)
    # The fit has since moved to a 20-ms step: the same measurement now reads x0.5
    model.prior_xty = model.prior_xty * 2.0
    model._solve()
    assert model.predict(1, 2) == pytest.approx(0.020)
    assert model.calibration(1, 2) == pytest.approx(0.5)


def test_observe_request_calibrates_by_the_requests_own_tokens_per_step() -> None:
    policy = DepthPolicy(PolicyConfig(step_prior_s=(0.010, 0.0, 0.0, 0.0),
                                      step_prior_weight=1e12))
    model = policy.step_time("w")
    model.residuals[1] = [0.004, 10.0]  # clients have waited 4 ms per step beyond the engine
    assert token_cost(model, 1, 2, 2.0) == pytest.approx(0.007)  # (.010 + .004) / 2
    assert token_cost(model, 1, 2, 2.0, overhead=False) == pytest.approx(0.005)
    # 41 tokens at depth 2: 20 accepted -> 20 steps of 2 tokens; the engine's step says
    # .010 / 2 = 5 ms a token, the client saw .30 s / 40 = 7.5 ms: a ratio of 1.5
    policy.observe_request("w", "code", 1, 2, 40, 20, 41, 0.30)
    assert model.token_costs[(1, 2)] == pytest.approx([0.0075, 1.0, 0.5, 2.0, 1.0, 40.0])
    assert model.calibration(1, 2) == pytest.approx(1.5)
    # once calibrated the factors replace the wait: depth 2 costs 5 ms x 1.5 a token, and
    # depth 0, never measured, takes the bucket's factor too: 10 ms x 1.5 -> k=2
    assert model.calibration(1, 0) == pytest.approx(1.5)
    assert choose_depth(0.5, 1, model, 2, tokens_per_step=[1.0, 1.5, 2.0]) == 2


def test_k0_is_probed_while_unmeasured_then_refreshed_rarely() -> None:
    # speculation is free here (a flat step), so every decision would speculate
    policy = DepthPolicy(PolicyConfig(max_depth=4, step_prior_s=(0.010, 0.0, 0.0, 0.0),
                                      step_prior_weight=1e12))
    picks = [policy.decide("w", "code", batch=1) for _ in range(30)]
    # no k=0 measured at batch 1: every 10th decision goes at k=0
    assert [i + 1 for i, k in enumerate(picks) if k == 0] == [10, 20, 30]
    assert all(k == 4 for i, k in enumerate(picks) if (i + 1) % 10)
    for _ in range(8):  # 8 requests measured at k=0 (the calibration's prior weight)
        policy.observe_request("w", "code", 1, 0, 0, 0, 41, 0.40)
    picks = [policy.decide("w", "code", batch=1) for _ in range(470)]
    # decisions 31..500: k=0 only at 250 and 500
    assert [i + 31 for i, k in enumerate(picks) if k == 0] == [250, 500]
    # batch 16 reads the nearest measured bucket's k=0 (measured): no probe in its first
    # 10 decisions
    assert [policy.decide("w", "code", batch=16) for _ in range(10)][-1] == 4


def test_speculation_priced_out_is_probed_and_measured_again() -> None:
    # speculation is free here (a flat step): the step model alone goes to k=4
    policy = DepthPolicy(PolicyConfig(max_depth=4, step_prior_s=(0.010, 0.0, 0.0, 0.0),
                                      step_prior_weight=1e12))
    model = policy.step_time("w")
    # 41 tokens each: at k=0 in 40 steps as modelled (10 ms a token); at k=4, 20 accepted in 20
    # steps of 2 tokens, 4x over the model's 5 ms a token (stalled requests)
    for _ in range(10):
        policy.observe_request("w", "code", 1, 0, 0, 0, 41, 0.40)
        policy.observe_request("w", "code", 1, 4, 80, 20, 41, 4 * 0.20)
    assert model.calibration(1, 4) > 2.5 * model.calibration(1, 0)
    assert policy.peek("w", "code", 1) == 0 and policy.peek("w", "code", 1, calibrated=False) == 4
    picks = [policy.decide("w", "code", batch=1) for _ in range(60)]
    # every 20th decision sent at k=0 goes at the model's depth instead
    assert [i + 1 for i, k in enumerate(picks) if k] == [20, 40, 60] and set(picks) == {0, 4}
    # the probes measure k=4 as modelled: once enough have, the policy speculates again
    for _ in range(30):
        policy.observe_request("w", "code", 1, 4, 80, 20, 41, 0.20)
    assert policy.peek("w", "code", 1) == 4
    # no probes with the probe off, or where the worker cannot speculate
    for config, max_depth in ((PolicyConfig(max_depth=4, probe_speculation_every=0), None),
                              (PolicyConfig(max_depth=4), 0)):
        other = DepthPolicy(config)
        assert all(other.commit("w", "code", 1, 0, max_depth) == 0 for _ in range(60))
    with pytest.raises(ProposerConfigError, match="probe_speculation_every"):
        PolicyConfig(probe_speculation_every=-1)


def test_peek_records_nothing_commit_records_the_request() -> None:
    """A router prices every candidate worker with peek; only the pick is committed."""
    def fresh() -> DepthPolicy:
        return DepthPolicy(PolicyConfig(max_depth=6, probe_depth0_every=0,
                                        probe_speculation_every=0,
                                        domain_priors=(("rag", 0.1), ("translation", 0.9))))

    policy = fresh()
    assert policy.peek("w", "rag", 8) == 0 and policy.peek("w", "translation", 8) == 6
    # 50 translation requests priced on w that went elsewhere: w's mix is unchanged
    for _ in range(50):
        policy.peek("w", "translation", 8)
    assert policy.peek("w", "rag", 8) == 0
    # 50 that joined w: under load rag now shares their steps (the worker's mix) and goes
    # deep with them; alone (batch 1) it keeps its own E
    for _ in range(50):
        assert policy.commit("w", "translation", 8, 6) == 6
    assert policy.peek("w", "rag", 8) == 6 and policy.peek("w", "rag", 1) == 1
    # decide is peek then commit
    twin = fresh()
    for _ in range(50):
        twin.decide("w", "translation", 8)
    assert twin.peek("w", "rag", 8) == 6


def test_the_k0_probe_counts_committed_requests_not_peeks() -> None:
    policy = DepthPolicy(PolicyConfig(max_depth=4, step_prior_s=(0.010, 0.0, 0.0, 0.0),
                                      step_prior_weight=1e12))
    assert [policy.peek("w", "code", batch=1) for _ in range(30)] == [4] * 30  # never probes
    picks = [policy.commit("w", "code", 1, policy.peek("w", "code", batch=1)) for _ in range(20)]
    assert [i + 1 for i, k in enumerate(picks) if k == 0] == [10, 20]  # as decide's
    assert policy.commit("w", "code", 1, 0) == 0  # a k=0 pick stays 0 (and counts)


def test_snapshot_shows_what_was_learned_per_worker() -> None:
    policy = DepthPolicy(PolicyConfig(max_depth=2, step_prior_s=(0.010, 0.0, 0.0, 0.0),
                                      step_prior_weight=1e12))
    assert policy.snapshot() == {}
    policy.observe_request("w", "code", 1, 2, 40, 20, 41, 0.30)  # the request above
    doc = orjson.loads(orjson.dumps(policy.snapshot(), option=orjson.OPT_NON_STR_KEYS))["w"]
    assert doc["step_ms"] == [10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert doc["calibration"] == {"1": [1.5, 1.5, 1.5]}
    domains = doc["domains"]
    assert isinstance(domains, dict) and list(domains) == ["code"]
    assert len(domains["code"]["tokens_per_step"]) == 3


def test_solve_acceptance() -> None:
    assert solve_acceptance(0.75, 2) == pytest.approx(0.5, abs=1e-9)  # .5 + .25
    assert solve_acceptance(0.0, 3) == 0.0
    assert solve_acceptance(3.0, 3) == 1.0


def test_acceptance_update_with_depth_undoes_the_truncation_bias() -> None:
    est = AcceptanceEstimate(4.0, 4.0)  # prior mean 0.5, weight 8
    # k = 2, a = 0.5: 0.75 accepted per step; 100 steps -> 200 drafts, 75 accepted.
    # failures = 100 * (1 - .5^2) = 75 -> Beta(79, 79), mean 0.5 (75/200 would say 0.375)
    est.observe(200, 75, depth=2, max_evidence=1e9)
    assert (est.alpha, est.beta) == pytest.approx((79.0, 79.0))
    # k = 1 is a plain Bernoulli: 100 drafts, 80 accepted -> Beta(159, 99)
    est.observe(100, 80, depth=1, max_evidence=1e9)
    assert (est.alpha, est.beta) == pytest.approx((159.0, 99.0))


def test_acceptance_update_with_measured_steps() -> None:
    """Steps where the proposer found nothing count: a is the effective per-token acceptance."""
    est = AcceptanceEstimate(4.0, 4.0)
    # k = 4, 20 decode steps but only 10 proposed (40 drafts), 30 accepted:
    # 1.5 accepted per step = a + a^2 + a^3 + a^4 -> a = 0.6445; failures = 20 (1 - a^4) = 16.55
    # (from the drafts alone: 3 per proposing step -> a = 0.888)
    assert solve_acceptance(1.5, 4) == pytest.approx(0.6445, abs=1e-4)
    est.observe(40, 30, depth=4, max_evidence=1e9, num_steps=20)
    assert (est.alpha, est.beta) == pytest.approx((34.0, 4.0 + 16.55), abs=0.01)


def test_acceptance_update_without_depth_and_evidence_cap() -> None:
    est = AcceptanceEstimate(4.0, 4.0)
    est.observe(200, 75, depth=0, max_evidence=1e9)  # every unaccepted draft is a failure
    assert (est.alpha, est.beta) == pytest.approx((79.0, 129.0))
    est.observe(0, 0, depth=4, max_evidence=1e9)  # nothing proposed: no change
    assert (est.alpha, est.beta) == pytest.approx((79.0, 129.0))
    est.observe(10, 99, depth=0, max_evidence=104.0)  # accepted clipped to drafts; then capped
    assert est.alpha + est.beta == pytest.approx(104.0)
    assert est.mean == pytest.approx(89.0 / 218.0)


def test_step_model_prior_alone_predicts_the_prior() -> None:
    model = StepTimeModel.from_prior((0.01, 0.002, 0.0003, 0.001), weight=4.0)
    # t(8, 2) = .01 + .016 + .0048 + .002
    assert model.predict(8, 2) == pytest.approx(0.0328)


def test_step_model_learns_from_samples() -> None:
    true = (0.020, 0.001, 0.0004, 0.002)
    # NOTE: the prior's pseudo-samples reach batch 64 x depth 8, so even a small weight
    # has leverage where these samples (batch <= 16) have none; keep it tiny here.
    model = StepTimeModel.from_prior((0.01, 0.0005, 0.0003, 0.0005), weight=0.01, decay=1.0)
    for _ in range(20):
        for batch in (1, 2, 8, 16):
            for k in (0, 2, 4):
                model.observe(batch, k, true[0] + true[1] * batch + true[2] * batch * k
                              + true[3] * k)
    assert model.num_samples == 240
    assert model.coef.tolist() == pytest.approx([*true, 0.0, 0.0, 0.0], rel=0.02, abs=2e-5)
    # ignores garbage samples
    model.observe(4, 2, float("nan"))
    model.observe(0, 2, 0.1)
    model.observe(4, 2, -1.0)
    assert model.num_samples == 240


def test_step_model_learns_the_fixed_cost_of_verifying() -> None:
    """A jump from k = 0 to k = 1, then a small slope: the k > 0 feature takes the jump."""
    model = StepTimeModel.from_prior((0.01, 0.0005, 0.0003, 0.0005), weight=0.01, decay=1.0)
    for _ in range(10):
        for batch in (1, 4):
            for k in (0, 1, 2, 4, 8):
                model.observe(batch, k, 0.010 + 0.001 * batch + 0.0002 * k
                              + (0.004 if k else 0.0))
    assert model.coef[4] == pytest.approx(0.004, rel=0.02)
    assert model.predict(1, 0) == pytest.approx(0.011, rel=0.01)
    assert model.predict(1, 6) == pytest.approx(0.0162, rel=0.01)
    # with the jump paid, going deeper is cheap: a = .6 picks a deep k at batch 1
    assert choose_depth(0.6, 1, model, 8) >= 6


def test_step_model_never_fits_a_negative_cost() -> None:
    """Noisy samples where deeper steps happened to run faster: the fit must not
    turn that into a negative per-token cost (it would favour ever deeper k)."""
    model = StepTimeModel.from_prior((0.01, 0.0005, 0.0003, 0.0005), weight=0.01, decay=1.0)
    for _ in range(10):
        for k in (0, 2, 4, 8):
            model.observe(1, k, 0.020 - 0.001 * k)
    assert model.coef.min() >= 0.0
    assert [model.predict(1, k) for k in (2, 4, 8)] == sorted(
        model.predict(1, k) for k in (2, 4, 8))


def test_policy_learns_per_worker_and_domain() -> None:
    policy = DepthPolicy(PolicyConfig(step_prior_s=(0.010, 0.001, 0.0005, 0.0),
                                      step_prior_weight=1e9))
    for _ in range(20):
        policy.observe_acceptance("w1", "code", 40, 36, depth=4)  # very repetitive
        policy.observe_acceptance("w1", "chat", 40, 0, depth=4)  # nothing accepted
    assert policy.acceptance("w1", "code").mean > 0.9
    assert policy.acceptance("w1", "chat").mean == pytest.approx(4 / (8 + 20 * 10))
    assert policy.acceptance("w2", "code").mean == pytest.approx(0.5)  # prior
    assert policy.decide("w1", "code", batch=1) == 6  # config cap
    assert policy.decide("w1", "code", batch=1, max_depth=3) == 3  # worker cap
    assert policy.decide("w1", "chat", batch=1) == 0
    assert policy.decide("w1", "code", batch=0) == policy.decide("w1", "code", batch=1)


def test_observe_request_feeds_both_models() -> None:
    policy = DepthPolicy(PolicyConfig(step_decay=1.0))
    # 41 tokens out at depth 4 with 30 accepted: 40 - 30 = 10 steps in 0.5 s -> 0.05 s/step
    policy.observe_request("w", "code", batch=2, depth=4, num_draft=40, num_accepted=30,
                           num_output_tokens=41, decode_s=0.5)
    assert policy.step_time("w").num_samples == 1
    # 3 accepted per step at k = 4 -> a = 0.8882; failures = 10 (1 - a^4) = 3.777
    est = policy.acceptance("w", "code")
    assert (est.alpha, est.beta) == pytest.approx((4.0 + 30, 4.0 + 3.777), abs=0.01)
    # depth 0: a step-time sample, no acceptance evidence
    policy.observe_request("w", "chat", batch=2, depth=0, num_draft=0, num_accepted=0,
                           num_output_tokens=41, decode_s=0.4)
    assert policy.step_time("w").num_samples == 2
    assert policy.acceptance("w", "chat").mean == pytest.approx(0.5)


@pytest.mark.parametrize("kwargs", [
    {"max_depth": 17}, {"min_gain": 0.9}, {"prior_acceptance": 1.0}, {"prior_strength": 0.0},
    {"max_evidence": 1.0}, {"step_prior_s": (0.0, 0.0, 0.0, 0.0)}, {"mix_decay": 0.0},
    {"prior_steps_per_depth": 0.0}, {"domain_priors": (("code", 1.0),)},
    {"step_prior_s": (0.01, -1.0, 0.0, 0.0)}, {"step_prior_weight": 0.0}, {"step_decay": 0.0},
])
def test_config_rejects_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ProposerConfigError):
        PolicyConfig(**kwargs)  # type: ignore[arg-type]


def test_measured_tokens_per_step_take_over_from_the_geometric_prior() -> None:
    est = AcceptanceEstimate(4.0, 4.0)
    assert est.tokens_per_step(2, prior_steps=50.0) == pytest.approx([1.0, 1.5, 1.75])  # a = .5
    # 20 steps at k = 4 produced 20 + 30 = 50 tokens (2.5 per step); a moves to 34 / 54.55 = .6233
    # whose geometric E(4) = 2.4048; shrunk: (50 + 50 * 2.4048) / (20 + 50) = 2.4320
    est.observe(40, 30, depth=4, max_evidence=1e9, num_steps=20)
    out = est.tokens_per_step(4, prior_steps=50.0)
    assert out[4] == pytest.approx(2.4320, abs=1e-3)
    assert out[1] == pytest.approx(1.6233, abs=1e-3)  # not measured: geometric 1 + a


def test_unmeasured_depths_stay_between_the_measured_ones() -> None:
    est = AcceptanceEstimate(5.0, 5.0)  # a = .5: geometric E saturates near 2
    est.observe(0, 0, depth=2, max_evidence=1e9)  # no counts: nothing changes
    # measured: k = 2 at 1.5 tokens per step, k = 4 at 3.0 (whole runs accepted)
    est.steps_at, est.tokens_at = {2: 1000.0, 4: 1000.0}, {2: 1500.0, 4: 3000.0}
    out = est.tokens_per_step(6, prior_steps=1.0)
    geo = [expected_tokens_per_step(0.5, k) for k in range(7)]
    assert out[0] == pytest.approx(1.0) and out[1] == pytest.approx(1.5)  # at most k = 2's
    assert out[2] == pytest.approx((1500 + geo[2]) / 1001)  # measured: kept
    assert out[3] == pytest.approx(geo[3])  # geometric 1.875 lies between 1.5 and 3.0
    assert out[4] == pytest.approx((3000 + geo[4]) / 1001)
    assert out[5] == pytest.approx(out[4]) and out[6] == pytest.approx(out[4])  # >= k = 4's


def test_bursty_acceptance_favours_a_deeper_measured_k() -> None:
    model = _model(0.010, 0.0, 0.0, 0.002)
    # geometric a = 0.4: 1.4/.012 = 116.7, 1.56/.014 = 111.4 ... -> k = 1
    assert choose_depth(0.4, 1, model, 4) == 1
    # but k = 4 was measured at 3 tokens per step (whole matches accepted): 3/.018 = 166.7
    assert choose_depth(0.4, 1, model, 4, tokens_per_step=[1.0, 1.4, 1.56, 1.62, 3.0]) == 4


def test_batch_tokens_per_step_blends_the_domain_mix() -> None:
    own = [1.0, 2.0, 3.0]
    mix = [(1.0, [1.0, 1.2, 1.3]), (3.0, [1.0, 1.6, 2.0])]
    assert batch_tokens_per_step(own, mix, batch=1) == own
    assert batch_tokens_per_step(own, [], batch=8) == own
    # mix average [1, 1.5, 1.825]; batch 4 -> 1/4 own + 3/4 mix
    assert batch_tokens_per_step(own, mix, batch=4) == pytest.approx([1.0, 1.625, 2.11875])


def test_under_load_a_request_follows_the_workers_depth() -> None:
    policy = DepthPolicy(PolicyConfig(step_prior_s=(0.010, 0.0, 0.0, 0.0005),
                                      step_prior_weight=1e9))
    for _ in range(20):
        policy.observe_acceptance("w", "code", 40, 36, depth=4)
        policy.observe_acceptance("w", "chat", 40, 0, depth=4)
    assert policy.decide("w", "chat", batch=1) == 0  # alone, chat does not pay
    first = policy.decide("w", "code", batch=16)  # the mix so far is the one chat request
    for _ in range(20):
        last = policy.decide("w", "code", batch=16)
    assert 0 < first < last == 6
    # in a batch of code requests the step runs at depth 6 anyway: chat speculates too
    assert policy.decide("w", "chat", batch=16) > 0


def test_domain_priors_replace_the_global_prior_for_unseen_domains() -> None:
    from specdec.policy import NGRAM_DOMAIN_PRIORS

    policy = DepthPolicy(PolicyConfig(domain_priors=NGRAM_DOMAIN_PRIORS, prior_strength=8.0))
    assert policy.acceptance("w", "translation").mean == pytest.approx(0.69)
    assert policy.acceptance("w", "rag").alpha == pytest.approx(0.17 * 8.0)
    assert policy.acceptance("w", "unknown-domain").mean == pytest.approx(0.5)
    # with the default step-time prior, a = .69 speculates deeper than a = .17, before any data
    assert policy.decide("w", "translation", 1, 6) > policy.decide("w", "rag", 1, 6)


def test_short_proposals_make_a_deep_k_cheap() -> None:
    # t(1, k) = 0.010 + 0.002 * draft tokens verified; measured tokens per step (bursty)
    model = _model(0.010, 0.0, 0.002, 0.0)
    tokens = [1.0, 1.4, 1.8, 1.9, 2.0, 2.1, 2.2, 2.3, 2.5]
    # full proposals: k=2 1.8/.014 = 128.6, k=4 2.0/.018 = 111.1, k=8 2.5/.026 = 96.2 -> 2
    assert choose_depth(0.5, 1, model, 8, tokens_per_step=tokens) == 2
    # proposals run short: k=2 1.8/.013 = 138.5, k=7 2.3/.015 = 153.3, k=8 2.5/.0152 = 164.5
    drafts = [0.0, 1.0, 1.5, 1.8, 2.0, 2.2, 2.4, 2.5, 2.6]
    assert choose_depth(0.5, 1, model, 8, tokens_per_step=tokens, drafts_per_step=drafts) == 8


def test_drafts_per_step_are_learned_per_depth_and_stay_monotone() -> None:
    est = AcceptanceEstimate(4.0, 4.0)
    # 10 requests at depth 8, 40 steps each, 2 draft tokens verified per step
    for _ in range(10):
        est.observe(80, 20, depth=8, max_evidence=1e6, num_steps=40)
    drafts = est.drafts_per_step(8, prior_steps=50.0)
    assert drafts[0] == 0.0
    assert drafts[8] == pytest.approx((800 + 50 * 8) / (400 + 50))  # 2.667
    # unmeasured depths: full proposals (k) as a prior, but never above the measured k=8
    assert drafts[1] == 1.0 and drafts[2] == 2.0
    assert drafts[4] == pytest.approx(drafts[8])
    assert drafts == sorted(drafts)
    # cached until the next observation, which the next read then reflects
    assert est.drafts_per_step(8, prior_steps=50.0) is drafts
    est.observe(400, 20, depth=8, max_evidence=1e6, num_steps=40)  # 10 drafts a step
    assert est.drafts_per_step(8, prior_steps=50.0)[8] == pytest.approx(
        (1200 + 50 * 8) / (440 + 50))


def test_observe_request_prices_client_samples_by_draft_tokens() -> None:
    # Two requests at batch 1: depth 8 verifying 1 draft token a step takes what depth 1 does.
    policy = DepthPolicy(PolicyConfig(step_prior_weight=1e-6))
    for _ in range(30):
        policy.observe_request("w", "code", 1, 0, 0, 0, 41, 0.40)  # 40 steps of 10 ms
        policy.observe_request("w", "code", 1, 8, 40, 20, 61, 0.48)  # 40 steps, 1 drafted each
        policy.observe_request("w", "code", 1, 2, 80, 20, 61, 0.56)  # 40 steps, 2 drafted each
    model = policy.step_time("w")
    assert model.predict(1, 8, drafted=1.0) == pytest.approx(0.012, rel=0.02)
    assert model.predict(1, 2, drafted=2.0) == pytest.approx(0.014, rel=0.02)


def test_a_depth_measured_high_on_few_steps_is_pooled_with_better_measured_ones() -> None:
    est = AcceptanceEstimate(6.0, 4.0)  # a = .6
    # k = 8: 2,000 steps at 2.64 tokens; k = 5: one lucky request, 50 steps at 3.07
    est.steps_at, est.tokens_at = {5: 50.0, 8: 2000.0}, {5: 153.5, 8: 5280.0}
    out = est.tokens_per_step(8, prior_steps=50.0)
    geo = [expected_tokens_per_step(0.6, k) for k in range(9)]
    shrunk5 = (153.5 + 50 * geo[5]) / 100  # 2.7267
    shrunk8 = (5280.0 + 50 * geo[8]) / 2050  # 2.6360
    pooled = (100 * shrunk5 + 2050 * shrunk8) / 2150  # 2.6402: weighted by evidence
    assert shrunk5 > shrunk8
    assert out[5] == pytest.approx(pooled) and out[8] == pytest.approx(pooled)
    assert out[6] == pytest.approx(pooled) and out[7] == pytest.approx(pooled)  # in between
    assert out[4] == pytest.approx(min(geo[4], pooled))  # unmeasured: at most k = 5's
    assert out == sorted(out)


def test_the_longest_proposal_is_priced_by_the_drafts_a_step_verifies_not_by_k() -> None:
    # t = 5 ms + 0.3 ms per draft token + 0.15 ms per token of the longest proposal
    #     + 0.3 ms once anything is proposed
    model = StepTimeModel.from_coefficients((0.005, 0.0, 0.0003, 0.00015, 0.0003))
    assert longest_proposal(1, 16, 2.6) == 2.6 and longest_proposal(4, 16, 2.6) == 10.4
    assert longest_proposal(16, 8, 2.6) == 8  # never above k
    # batch 1: k=4 verifying 2 tokens: 5 + 0.6 + 0.3 + 0.3 = 6.2 ms; k=16 verifying 2.6:
    # 5 + 0.78 + 0.39 + 0.3 = 6.47 ms (charged for k = 16 it was 8.48)
    assert model.predict(1, 4, 2.0) == pytest.approx(0.0062)
    assert model.predict(1, 16, 2.6) == pytest.approx(0.00647)
    # batch 4: 5 + 4 x 0.78 + 0.15 x 10.4 + 0.3 = 9.98 ms
    assert model.predict(4, 16, 2.6) == pytest.approx(0.00998)
    tokens = [1.0, 1.4, 1.55, 1.67, 1.72] + [1.72 + 0.13 * (k - 4) / 12 for k in range(5, 17)]
    drafts = [0.0, 1.0, 1.4, 1.7, 2.0] + [2.0 + 0.6 * (k - 4) / 12 for k in range(5, 17)]
    # E / t: k=4 1.72 / 6.2 ms = 277.4 per s, k=16 1.85 / 6.47 ms = 285.9 (was 218.2: k=4)
    assert choose_depth(0.5, 1, model, 16, tokens_per_step=tokens, drafts_per_step=drafts) == 16


def test_token_times_are_the_requests_own_by_its_domain_not_the_workers_mix() -> None:
    """Seconds per token of one request at each depth, by its own domain's acceptance: what
    a router holds against the request's TPOT SLO, where ``peek`` picks one depth for the
    worker's whole mix. Pricing records nothing."""
    dp = DepthPolicy(PolicyConfig(max_depth=4, step_prior_s=(0.010, 0.0005, 0.0003, 0.0005),
                                  step_prior_weight=1e12,
                                  domain_priors=(("translation", 0.9), ("rag", 0.05))))
    for _ in range(50):
        dp.commit("w", "rag", 8, 0)
    assert dp.peek("w", "translation", 8, 4) == 0  # the rag-heavy mix: speculation does not pay
    own = dp.token_times("w", "translation", 8, 4)
    rag = dp.token_times("w", "rag", 8, 4)
    assert len(own) == len(rag) == 5
    # k=0 emits one token a step whatever the domain: t(8, 0) = 0.010 + 8 x 0.0005 = 14 ms
    assert own[0] == pytest.approx(rag[0]) == pytest.approx(token_cost(dp.step_time("w"), 8, 0, 1.0))
    assert own[0] == pytest.approx(0.014)
    best = min(range(5), key=own.__getitem__)
    assert best > 0 and own[best] < 0.8 * own[0]  # translation alone would speculate
    assert min(range(5), key=rag.__getitem__) == 0
    assert dp.token_times("w", "translation", 8, 2) == pytest.approx(own[:3])  # capped
    assert dp.peek("w", "translation", 8, 4) == 0  # nothing was recorded


def test_token_costs_are_token_cost_at_each_depth_bit_for_bit() -> None:
    """The written-out loop against :func:`token_cost` per k (and shared_prefill against
    its plain formula): client samples, the engine's steps (prefill in them), the client's
    wait, batches below 1 and fractional ones."""
    rng = random.Random(7)
    for trial in range(60):
        model = StepTimeModel.from_prior((0.010, 0.0005, 0.0003, 0.0005, 0.002, 0.0002), 4.0,
                                         0.99, 0.999)
        for _ in range(rng.randint(0, 30)):
            batch, k = rng.randint(1, 40), rng.randint(0, 8)
            model.observe(batch, k, rng.uniform(0.005, 0.2), rng.choice((None, k / 2)))
        if rng.random() < 0.5:
            n = len(model.xty)
            xtx = [[rng.uniform(0, 1) * (i == j) + 0.01 for j in range(n)] for i in range(n)]
            model.observe_sums(xtx, [rng.uniform(0, 1) for _ in range(n)], 8,
                               rng.choice((0.0, 256.0)))
            model.observe(4, 2, 0.02)  # a client residual over the engine's steps
        for _ in range(5):
            batch = rng.choice((0, 0.5, 1, 1.0, 3, 7.5, 64))
            depth = rng.randint(0, 16)
            expected = [1.0] + [rng.choice((0.5, 1.0, rng.uniform(1, 6))) for _ in range(depth)]
            drafted = [None] + [rng.choice((None, 0.0, rng.uniform(0, k)))
                                for k in range(1, depth + 1)]
            for overhead in (True, False):
                step = model.predict(batch, 0) if overhead else model.engine_step(batch, 0)
                assert model.shared_prefill(batch, overhead) \
                    == min(model.prefill_part(batch), 0.99 * step)
                prefill = rng.choice((None, 0.0, rng.uniform(0, 0.01)))
                want = [token_cost(model, batch, k, e, d, overhead, prefill)
                        for k, (e, d) in enumerate(zip(expected, drafted, strict=True))]
                assert token_costs(model, batch, expected, drafted, overhead, prefill) \
                    == want, trial
