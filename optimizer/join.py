"""Extra agents in another process: join the board's open campaign through the file alone.

    polyinfer optimize --join --board opt.sqlite     # beside a running optimizer

The board is the only channel: this process reads measured results, posts
proposals, and stops when the campaign's ``campaign_done`` note appears.
"""

from __future__ import annotations

import asyncio
import logging

from optimizer.agents.base import Agent, AgentRunner
from optimizer.agents.bayes import BayesAgent
from optimizer.agents.evolution import EvolutionAgent
from optimizer.board import Board
from optimizer.space import DEFAULT_KNOBS, Knob, SearchSpace
from polyinfer.config import CompiledConfig

logger = logging.getLogger(__name__)


async def join_campaign(board_path: str, base: CompiledConfig,
                        knobs: tuple[Knob, ...] = DEFAULT_KNOBS,
                        agents: tuple[str, ...] = ("bayes", "evolution"), seed: int = 100,
                        poll_s: float = 1.0, memory_budget_bytes: int = 1 << 30) -> str | None:
    """Run extra agents in this process on the board's open campaign until it is done.

    The campaign is the newest one with an ``incumbent`` note and no
    ``campaign_done`` note; returns its id, or None when there is none.
    """
    loop = asyncio.get_running_loop()
    board = await loop.run_in_executor(None, Board, board_path)
    cid = await loop.run_in_executor(None, open_campaign, board)
    if cid is None:
        return None
    space = SearchSpace.default(base, memory_budget_bytes, knobs)
    made: dict[str, Agent] = {"bayes": BayesAgent(space, seed=seed),
                              "evolution": EvolutionAgent(space, seed=seed + 1)}
    stop = asyncio.Event()
    runners = [AgentRunner(made[a], board, space, cid, "fast") for a in agents]
    tasks = [asyncio.create_task(r.run(stop)) for r in runners]
    try:
        while not await loop.run_in_executor(None, board.notes, cid, "campaign_done", 1):
            await asyncio.sleep(poll_s)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    logger.info("joined campaign %s: posted %s", cid,
                {r.agent.name: r.num_posted for r in runners})
    return cid


def open_campaign(board: Board) -> str | None:
    started = board.notes(kind="incumbent", limit=50)
    done = {n.campaign for n in board.notes(kind="campaign_done", limit=200)}
    for note in reversed(started):
        if note.campaign not in done:
            return note.campaign
    return None
