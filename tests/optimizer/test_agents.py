from __future__ import annotations

import asyncio
import math
from pathlib import Path

from optimizer.agents.base import AgentRunner, BoardView, read_view
from optimizer.agents.bayes import BayesAgent, expected_improvement
from optimizer.agents.evolution import EvolutionAgent
from optimizer.board import Board
from optimizer.space import Knob, ModelShape, SearchSpace
from polyinfer.config import CompiledConfig

SHAPE = ModelShape(2, 64, 128, 2, 1, 32, 100)


def small_space() -> SearchSpace:
    base = CompiledConfig().with_engine(max_model_len=512, kv_cache_tokens=4096)
    return SearchSpace(base, (Knob("max_num_seqs", (1, 2, 4, 8, 16, 32)),
                              Knob("max_num_batched_tokens", (256, 512, 1024, 2048)),
                              Knob("spec_method", ("none", "ngram")),
                              Knob("spec_max_depth", (0, 1, 2, 3, 4, 6, 8)),
                              Knob("spec_default_depth", (0, 1, 2, 3, 4, 6, 8))), SHAPE, 1 << 30)


def known_objective(cfg: CompiledConfig) -> float:
    """Peak at 8 seqs, 1024 tokens, ngram depth 3; smooth in log space."""
    e = cfg.engine
    v = 100.0 - 12 * (math.log2(e.max_num_seqs) - 3) ** 2
    v -= 6 * (math.log2(e.max_num_batched_tokens) - 10) ** 2
    v += 20.0 if e.spec_method == "ngram" else 0.0
    v -= 4 * (e.spec_default_depth - 3) ** 2 if e.spec_method == "ngram" else 0.0
    v -= 1.5 * abs(e.spec_max_depth - e.spec_default_depth)
    return max(1.0, v)


def optimise(agent: object, space: SearchSpace, budget: int) -> tuple[float, int]:
    measured: dict[str, float] = {}
    for _ in range(budget):
        view = BoardView("c", dict(measured), frozenset(measured))
        (cand,) = agent.propose(view, 1)  # type: ignore[attr-defined]
        measured[space.key(cand.config)] = known_objective(cand.config)
    return max(measured.values()), len(measured)


def test_expected_improvement_prefers_mean_then_uncertainty() -> None:
    import numpy as np

    ei = expected_improvement(np.array([1.0, 2.0, 1.0]), np.array([0.1, 0.1, 1.0]), best=1.5)
    assert ei[1] > ei[2] > ei[0] > 0
    assert expected_improvement(np.array([0.0]), np.array([0.0]), best=1.0)[0] == 0.0


def test_bayes_agent_finds_the_optimum_of_a_known_function() -> None:
    space = small_space()
    grid = list(space.grid())
    best = max(known_objective(c) for c in grid)
    found, used = optimise(BayesAgent(space, seed=0), space, budget=25)
    assert best == 120.0
    assert found >= 0.95 * best
    assert used <= len(grid) / 4


def test_evolution_agent_climbs_from_the_base() -> None:
    space = small_space()
    start = known_objective(space.canonical(space.base))
    found, _ = optimise(EvolutionAgent(space, seed=0), space, budget=40)
    assert found > start + 20


async def test_runner_keeps_open_proposals_topped_up(tmp_path: Path) -> None:
    space = small_space()
    board = Board(tmp_path / "b.sqlite")
    runner = AgentRunner(EvolutionAgent(space), board, space, "c", tier="fast", target_open=3)
    assert await runner.step() == 3
    assert await runner.step() == 0
    p = board.claim("c", "m")
    assert p is not None
    board.add_result(p.id, "fast", 50.0, 1.0)
    board.set_status(p.id, "measured")
    assert await runner.step() == 1
    view = read_view(board, "c", "fast")
    assert view.measured == {p.key: 50.0} and len(view.posted) == 4
    stop = asyncio.Event()
    stop.set()
    await runner.run(stop)
