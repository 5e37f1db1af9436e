"""Closed loop on a simulated worker: the policy learns to pick (nearly) the best depth.

A worker whose step time and per-domain acceptance are known exactly is driven
with requests at random depths (the traffic the proxy sees while exploring);
the policy learns only from what a client observes (usage counts and decode
time). Then its choice at each (domain, batch) must reach within 3% of the
best fixed depth's goodput, the issue's target, with the noise a real
measurement has.

NOTE: ``share_depth_under_load`` is off here: this simulated step costs
t(batch, k) for each request's own k, with no padding to the deepest query,
so the per-request optimum is the right answer.
"""

from __future__ import annotations

import random

import pytest

from specdec.policy import DepthPolicy, PolicyConfig, expected_tokens_per_step

TRUE_STEP = (0.012, 0.0015, 0.0004, 0.0012)  # seconds: [1, batch, batch*k, k]
ACCEPTANCE = {"code": 0.85, "chat": 0.55, "rag": 0.2}
MAX_DEPTH = 6


def _step_s(batch: int, k: int) -> float:
    w0, wb, wbk, wk = TRUE_STEP
    return w0 + wb * batch + wbk * batch * k + wk * k


def _goodput(domain: str, batch: int, k: int) -> float:
    return expected_tokens_per_step(ACCEPTANCE[domain], k) / _step_s(batch, k)


def _simulate(policy: DepthPolicy, rng: random.Random, num_requests: int) -> None:
    for _ in range(num_requests):
        domain = rng.choice(sorted(ACCEPTANCE))
        batch = rng.choice([1, 2, 4, 8, 16, 32])
        k = rng.randint(0, MAX_DEPTH)
        a = ACCEPTANCE[domain]
        tokens, steps, drafted, accepted = 1, 0, 0, 0  # the first token comes from prefill
        while tokens < 64:
            run = 0
            while run < k and rng.random() < a:
                run += 1
            steps += 1
            drafted += k
            accepted += run
            tokens += run + 1
        decode_s = steps * _step_s(batch, k) * rng.uniform(0.9, 1.1)  # measurement noise
        policy.observe_request("w", domain, batch, k, drafted, accepted, tokens, decode_s)


@pytest.mark.parametrize("batch", [1, 4, 16, 32])
@pytest.mark.parametrize("domain", sorted(ACCEPTANCE))
def test_learned_choice_is_within_3_percent_of_the_best_depth(domain: str, batch: int) -> None:
    policy = DepthPolicy(PolicyConfig(max_depth=MAX_DEPTH, share_depth_under_load=False))
    _simulate(policy, random.Random(0), 600)
    best = max(_goodput(domain, batch, k) for k in range(MAX_DEPTH + 1))
    chosen = policy.decide("w", domain, batch)
    assert _goodput(domain, batch, chosen) >= 0.97 * best, (chosen, [
        round(_goodput(domain, batch, k), 1) for k in range(MAX_DEPTH + 1)])


def test_the_prior_alone_is_not_enough() -> None:
    """Sanity check of the setup: before learning, the choice is off for some shape."""
    policy = DepthPolicy(PolicyConfig(max_depth=MAX_DEPTH, share_depth_under_load=False))
    ratios = []
    for domain in ACCEPTANCE:
        for batch in (1, 4, 16, 32):
            best = max(_goodput(domain, batch, k) for k in range(MAX_DEPTH + 1))
            ratios.append(_goodput(domain, batch, policy.decide("w", domain, batch)) / best)
    assert min(ratios) < 0.97
