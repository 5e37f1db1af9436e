"""Closed loop on a simulated worker: the policy learns to pick (nearly) the best depth.

A worker whose step time and per-domain acceptance are known exactly is driven
with requests at random depths (the traffic the proxy sees while exploring);
the policy learns only from what a client observes (usage counts and decode
time). Then its choice at each (domain, batch) must reach within 3% of the
best fixed depth's goodput, the issue's target, with the noise a real
measurement has (mean over three simulated histories: a near-tie between two
depths can go either way on one noisy history).

Two workers: step time linear in k ("flat"), and one with a fixed cost for any
verifying step ("verify_jump"), which is what the engine measures on the CPU
(``bench/spec_depth.py --step-costs``: a 2-token step ~1.35x a 1-token one).

NOTE: the choices are read with ``peek``, which records no domain mix, so each is
for the request's own domain alone: this simulated step costs t(batch, k) for each
request's own k, with no padding to the deepest query, so the per-request optimum
is the right answer.
"""

from __future__ import annotations

import random

import pytest

from specdec.policy import DepthPolicy, PolicyConfig, expected_tokens_per_step

# seconds: [1, batch, batch*k, k, k > 0]
WORLDS = {"flat": (0.012, 0.0015, 0.0004, 0.0012, 0.0),
          "verify_jump": (0.014, 0.0004, 0.0003, 0.0006, 0.005)}
ACCEPTANCE = {"code": 0.85, "chat": 0.55, "rag": 0.2}
MAX_DEPTH = 6
SEEDS = (0, 1, 2)


def _step_s(batch: int, k: int, world: str = "flat") -> float:
    w0, wb, wbk, wk, w_spec = WORLDS[world]
    return w0 + wb * batch + wbk * batch * k + wk * k + (w_spec if k > 0 else 0.0)


def _goodput(domain: str, batch: int, k: int, world: str = "flat") -> float:
    return expected_tokens_per_step(ACCEPTANCE[domain], k) / _step_s(batch, k, world)


def _simulate(policy: DepthPolicy, rng: random.Random, num_requests: int,
              world: str = "flat") -> None:
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
        decode_s = steps * _step_s(batch, k, world) * rng.uniform(0.9, 1.1)  # measurement noise
        policy.observe_request("w", domain, batch, k, drafted, accepted, tokens, decode_s)


@pytest.fixture(scope="module", params=sorted(WORLDS))
def learned(request: pytest.FixtureRequest) -> tuple[str, list[DepthPolicy]]:
    world = request.param
    policies = []
    for seed in SEEDS:
        policy = DepthPolicy(PolicyConfig(max_depth=MAX_DEPTH))
        _simulate(policy, random.Random(seed), 600, world)
        policies.append(policy)
    return world, policies


@pytest.mark.parametrize("batch", [1, 4, 16, 32])
@pytest.mark.parametrize("domain", sorted(ACCEPTANCE))
def test_learned_choice_is_within_3_percent_of_the_best_depth(
        learned: tuple[str, list[DepthPolicy]], domain: str, batch: int) -> None:
    world, policies = learned
    best = max(_goodput(domain, batch, k, world) for k in range(MAX_DEPTH + 1))
    chosen = [p.peek("w", domain, batch) for p in policies]
    ratios = [_goodput(domain, batch, k, world) / best for k in chosen]
    assert sum(ratios) / len(ratios) >= 0.97, (chosen, ratios)


def test_the_prior_alone_is_not_enough() -> None:
    """Sanity check of the setup: before learning, the choice is off for some shape."""
    policy = DepthPolicy(PolicyConfig(max_depth=MAX_DEPTH))
    ratios = []
    for domain in ACCEPTANCE:
        for batch in (1, 4, 16, 32):
            best = max(_goodput(domain, batch, k) for k in range(MAX_DEPTH + 1))
            ratios.append(_goodput(domain, batch, policy.peek("w", domain, batch)) / best)
    assert min(ratios) < 0.97
