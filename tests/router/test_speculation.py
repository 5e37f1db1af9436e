"""DepthChooser: the speculation settings pin the depth the router prices, records and sends."""

from __future__ import annotations

import pytest

from polyinfer.config import CompiledConfig, ConfigError
from router.adaptive import AdaptiveConfig, AdaptivePolicy
from router.base import RequestOutcome, RequestShape, RouteDecision, WorkerView
from router.baselines import LeastOutstandingPolicy
from router.speculation import DepthChooser, SpeculationConfig
from specdec.policy import DepthPolicy, PolicyConfig

NGRAM = CompiledConfig().with_engine(spec_method="ngram", spec_max_depth=4)
PLAIN = CompiledConfig().with_engine(spec_method="none")
# speculation pays under this acceptance prior: the depth policy picks k > 0 when asked
EAGER = PolicyConfig(prior_acceptance=0.9)


def spec_view(name: str = "spec") -> WorkerView:
    return WorkerView(name, f"http://{name}", "engine", NGRAM)


def shape(**kw: object) -> RequestShape:
    return RequestShape("code", 100, None, 100, **kw)  # type: ignore[arg-type]


def test_pin_writes_the_settings_depth_into_the_shape_and_the_client_wins() -> None:
    assert DepthChooser(SpeculationConfig(mode="off")).pin(shape()).speculative_depth == 0
    fixed = DepthChooser(SpeculationConfig(mode="fixed", fixed_depth=2))
    assert fixed.pin(shape()).speculative_depth == 2
    assert fixed.pin(shape(speculative_depth=5)).speculative_depth == 5
    for mode in ("adaptive", "policy"):
        s = shape()
        assert DepthChooser(SpeculationConfig(mode=mode)).pin(s) is s  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["off", "fixed"])
def test_adaptive_router_prices_and_records_the_pinned_depth(mode: str) -> None:
    """The bug: with mode off the relay sent 0 while the router priced and recorded its
    depth policy's k (3 on the n-gram worker for 9 of 10 requests)."""
    chooser = DepthChooser(SpeculationConfig(mode=mode, fixed_depth=2))  # type: ignore[arg-type]
    policy = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0, confidence=None),
                            depth_policy=DepthPolicy(EAGER))
    view = spec_view()
    assert policy.candidate(shape(), view).depth > 0  # unpinned, it would speculate
    want = 0 if mode == "off" else 2
    for _ in range(10):
        s = chooser.pin(shape())
        assert policy.candidate(s, view).depth == want
        decision = chooser.complete(policy.choose(s, [view]), s, view)
        assert decision.spec_depth == want
    assert policy.stats()["depths"] == {str(want): 10}


def test_complete_fills_the_depth_for_a_policy_that_picks_none() -> None:
    dp = DepthPolicy(EAGER)
    view, plain = spec_view(), WorkerView("plain", "http://p", "engine", PLAIN)
    vllm = WorkerView("v", "http://v", "vllm", CompiledConfig(backend="vllm"))
    baseline = LeastOutstandingPolicy()
    adaptive = DepthChooser(SpeculationConfig(mode="adaptive"), dp)
    decision = adaptive.complete(baseline.choose(shape(), [view]), shape(), view)
    assert decision.spec_depth == dp.decide("spec", "code", 1, 4) > 0
    assert adaptive.complete(RouteDecision("plain"), shape(), plain).spec_depth is None
    assert adaptive.complete(RouteDecision("spec", 3), shape(), view).spec_depth == 3
    assert adaptive.complete(RouteDecision("v", 3), shape(), vllm).spec_depth is None
    policy_mode = DepthChooser(SpeculationConfig(mode="policy"), dp)
    assert policy_mode.complete(RouteDecision("spec"), shape(), view).spec_depth is None
    assert policy_mode.complete(RouteDecision("spec", 1), shape(), view).spec_depth == 1
    # a pinned depth is sent as it is (the engine caps it at its spec_max_depth)
    pinned = shape(speculative_depth=7)
    assert adaptive.complete(RouteDecision("spec", 4), pinned, view).spec_depth == 7


def test_observe_learns_only_from_requests_sent_at_a_known_depth() -> None:
    chooser = DepthChooser(SpeculationConfig(), DepthPolicy())
    before = chooser.depth_policy.acceptance("spec", "code").mean
    done = RequestOutcome("spec", shape(), "ok", completion_tokens=200, ttft_s=0.05,
                          tpot_s=0.01, e2e_s=1.0, spec_depth=4, spec_draft_tokens=120,
                          spec_accepted_tokens=90)
    chooser.observe(RequestOutcome("spec", shape(), "ok", completion_tokens=200, ttft_s=0.05,
                                   e2e_s=1.0, spec_draft_tokens=120, spec_accepted_tokens=90))
    assert chooser.depth_policy.acceptance("spec", "code").mean == before  # depth unknown
    chooser.observe(done)
    assert chooser.depth_policy.acceptance("spec", "code").mean != before


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="speculation.mode"):
        SpeculationConfig(mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="speculation.fixed_depth"):
        SpeculationConfig(mode="fixed", fixed_depth=17)
    assert DepthChooser(SpeculationConfig(max_depth=3)).depth_policy.config.max_depth == 3
