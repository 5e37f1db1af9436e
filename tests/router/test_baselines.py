"""Baseline routing policies on hand-built worker views, expected answers written out."""

from __future__ import annotations

from polyinfer.config import CompiledConfig
from router.base import RequestShape, RoutingPolicy, WorkerView
from router.baselines import LeastOutstandingPolicy, RandomPolicy, RoundRobinPolicy

SHAPE = RequestShape(domain="chat", prompt_tokens=10, max_tokens=8, predicted_output_tokens=8)


def views(*outstanding: int, running: tuple[int, ...] = ()) -> list[WorkerView]:
    return [WorkerView(name=f"w{i}", url=f"http://w{i}", backend="engine",
                       config=CompiledConfig(), outstanding_requests=n,
                       running=running[i] if running else 0)
            for i, n in enumerate(outstanding)]


def test_all_implement_the_protocol() -> None:
    for policy in (RoundRobinPolicy(), LeastOutstandingPolicy(), RandomPolicy()):
        assert isinstance(policy, RoutingPolicy)


def test_round_robin_cycles_and_adapts_to_fewer_workers() -> None:
    p = RoundRobinPolicy()
    assert [p.choose(SHAPE, views(0, 0, 0)).worker for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    assert p.choose(SHAPE, views(0, 0)).worker == "w1"
    assert p.choose(SHAPE, views(0)).worker == "w0"
    assert p.choose(SHAPE, views(0, 0)).spec_depth is None


def test_least_outstanding_picks_fewest_then_fewest_running() -> None:
    p = LeastOutstandingPolicy()
    assert p.choose(SHAPE, views(3, 1, 2)).worker == "w1"
    assert p.choose(SHAPE, views(1, 1, 2, running=(5, 0, 0))).worker == "w1"


def test_least_outstanding_rotates_among_equals() -> None:
    p = LeastOutstandingPolicy()
    picks = {p.choose(SHAPE, views(0, 0, 0)).worker for _ in range(3)}
    assert picks == {"w0", "w1", "w2"}


def test_random_is_seeded_and_covers_workers() -> None:
    a = [RandomPolicy(seed=7).choose(SHAPE, views(0, 0, 0)).worker for _ in range(1)]
    b = [RandomPolicy(seed=7).choose(SHAPE, views(0, 0, 0)).worker for _ in range(1)]
    assert a == b
    p = RandomPolicy(seed=1)
    assert {p.choose(SHAPE, views(0, 0, 0)).worker for _ in range(60)} == {"w0", "w1", "w2"}
