"""Baseline routing policies: round-robin, least-outstanding-requests, random.

They ignore the request's shape and never choose a speculative depth (the
worker's default applies). They are the reference the adaptive policy is
measured against, so they stay as simple as their names.

Example::

    policy = LeastOutstandingPolicy()
    decision = policy.choose(shape, views)   # views: routable WorkerViews, never empty
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.base import RequestOutcome, RequestShape, RouteDecision, WorkerView


class RoundRobinPolicy:
    """Cycles through the routable workers in order."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, shape: RequestShape, workers: Sequence[WorkerView]) -> RouteDecision:
        index = self._next % len(workers)
        self._next = index + 1
        return RouteDecision(worker=workers[index].name, reason="round_robin")

    def observe(self, outcome: RequestOutcome) -> None:
        return None


class LeastOutstandingPolicy:
    """Picks the worker with the fewest requests in flight from this proxy.

    Ties go to the worker with the fewest scraped running+waiting requests, then
    rotate, so idle equal workers share the load instead of the first one
    taking everything.
    """

    name = "least_outstanding"

    def __init__(self) -> None:
        self._tie = 0

    def choose(self, shape: RequestShape, workers: Sequence[WorkerView]) -> RouteDecision:
        return RouteDecision(worker=workers[self.pick(workers)].name, reason="least_outstanding")

    def pick(self, workers: Sequence[WorkerView]) -> int:
        """The index :meth:`choose` picks (and advances the tie rotation as it does): for
        a policy that falls back to this one's pick (router.adaptive)."""
        self._tie += 1
        n = len(workers)
        return min(range(n), key=lambda i: (workers[i].outstanding_requests,
                                            workers[i].running + workers[i].waiting,
                                            (i - self._tie) % n))

    def observe(self, outcome: RequestOutcome) -> None:
        return None


class RandomPolicy:
    """Picks a routable worker uniformly at random (seeded, for reproducible runs)."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, shape: RequestShape, workers: Sequence[WorkerView]) -> RouteDecision:
        return RouteDecision(worker=self._rng.choice(workers).name, reason="random")

    def observe(self, outcome: RequestOutcome) -> None:
        return None
