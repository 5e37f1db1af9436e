"""Evolutionary / local search around the best measured configs.

Parents are drawn by tournament from the top measured configs; a child is a
uniform crossover of two parents (repaired to be valid) or a parent moved by
one or two neighbour steps. With nothing measured yet it starts from the
incumbent's neighbours (or the base config's).
"""

from __future__ import annotations

import random

from optimizer.agents.base import BoardView, Candidate, fresh
from optimizer.errors import SpaceError
from optimizer.space import SearchSpace
from polyinfer.config import CompiledConfig


class EvolutionAgent:
    name = "evolution"

    def __init__(self, space: SearchSpace, seed: int = 1, elite: int = 5,
                 crossover_prob: float = 0.3) -> None:
        self.space = space
        self.rng = random.Random(seed)
        self.elite = elite
        self.crossover_prob = crossover_prob

    def propose(self, view: BoardView, num: int) -> list[Candidate]:
        parents = [self.space.from_key(k) for k, _ in view.top(self.elite)]
        if not parents:
            parents = [self._start(view)]
        children: list[CompiledConfig] = []
        for _ in range(30 * num):
            child = self._child(parents)
            if child is not None:
                children.append(child)
            if len(fresh(self.space, view, children)) >= num:
                break
        return [Candidate(c, reason="local search around the best")
                for c in fresh(self.space, view, children)[:num]]

    def _start(self, view: BoardView) -> CompiledConfig:
        if view.incumbent_key:
            try:
                return self.space.from_key(view.incumbent_key)
            except (SpaceError, ValueError, TypeError):
                pass  # NOTE: an incumbent from another space (other knobs): start from the base
        return self.space.canonical(self.space.base)

    def _child(self, parents: list[CompiledConfig]) -> CompiledConfig | None:
        if len(parents) >= 2 and self.rng.random() < self.crossover_prob:
            a, b = self.rng.sample(parents, 2)
            pa, pb = self.space.point_of(a), self.space.point_of(b)
            mixed = {k: (pa if self.rng.random() < 0.5 else pb)[k] for k in pa}
            return self.space.repair(mixed)
        # NOTE: tournament of two: the better-ranked (earlier) parent wins.
        i, j = self.rng.randrange(len(parents)), self.rng.randrange(len(parents))
        child = parents[min(i, j)]
        for _ in range(1 + (self.rng.random() < 0.3)):
            moves = self.space.neighbors(child)
            if not moves:
                return None
            child = self.rng.choice(moves)
        return child
