"""The cost-model agent: proposes the configs its analytic + calibrated model ranks highest."""

from __future__ import annotations

import random
from collections.abc import Callable

from optimizer.agents.base import BoardView, Candidate, fresh
from optimizer.space import SearchSpace
from polyinfer.config import CompiledConfig


class CostModelAgent:
    name = "costmodel"

    def __init__(self, space: SearchSpace, predict: Callable[[CompiledConfig], float],
                 seed: int = 2, pool_size: int = 1500) -> None:
        self.space = space
        self.predict_fn = predict  # config -> tokens/s in the screening tier
        self.rng = random.Random(seed)
        self.pool_size = pool_size

    def propose(self, view: BoardView, num: int) -> list[Candidate]:
        pool = fresh(self.space, view, [self.space.sample(self.rng)
                                        for _ in range(self.pool_size)])
        scored = sorted(((self.predict_fn(c), c) for c in pool), key=lambda t: t[0],
                        reverse=True)
        return [Candidate(c, predicted=p, reason=f"cost model predicts {p:.1f} tok/s")
                for p, c in scored[:num]]
