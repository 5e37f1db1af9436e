"""The agent contract: a board snapshot in, candidate configs out.

Agents never talk to each other or to the engine: :class:`AgentRunner` reads
the board into a :class:`BoardView`, calls ``propose`` (synchronous, may be
CPU-heavy: the runner calls it in a thread) and posts what comes back. Any
process that can open the board file can run agents.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from optimizer.board import Board, best_by_key
from optimizer.space import SearchSpace
from polyinfer.config import CompiledConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    config: CompiledConfig
    predicted: float | None = None  # tokens/s the agent expects, if it has a model
    reason: str = ""


@dataclass(frozen=True)
class BoardView:
    """What an agent may know: measured values (screening tier) and what is already posted."""

    campaign: str
    measured: dict[str, float]  # key -> mean tokens/s in the screening tier
    posted: frozenset[str]  # every key on the board for this campaign (any status)
    incumbent_key: str | None = None
    incumbent_value: float | None = None  # screening-tier tokens/s of the incumbent
    pruned: frozenset[str] = field(default_factory=frozenset)

    def best(self) -> tuple[str, float] | None:
        if not self.measured:
            return None
        key = max(self.measured, key=lambda k: self.measured[k])
        return key, self.measured[key]

    def top(self, n: int) -> list[tuple[str, float]]:
        return sorted(self.measured.items(), key=lambda kv: kv[1], reverse=True)[:n]


def read_view(board: Board, campaign: str, tier: str) -> BoardView:
    measured = best_by_key(board.results(campaign, tier))
    proposals = board.proposals(campaign)
    incumbent = [n for n in board.notes(campaign, kind="incumbent", limit=1)]
    inc_key = incumbent[-1].body.get("key") if incumbent else None
    return BoardView(
        campaign=campaign, measured=measured, posted=frozenset(p.key for p in proposals),
        incumbent_key=inc_key, incumbent_value=measured.get(inc_key) if inc_key else None,
        pruned=frozenset(p.key for p in proposals if p.status == "pruned"))


class Agent(Protocol):
    """Proposes up to ``num`` new candidates (keys not in ``view.posted``)."""

    name: str

    def propose(self, view: BoardView, num: int) -> list[Candidate]:
        ...


@runtime_checkable
class RejectsProposals(Protocol):
    """An agent whose raw proposals can be unusable (an LLM's): it says why, once each."""

    def take_rejections(self) -> list[str]:
        ...


def fresh(space: SearchSpace, view: BoardView, configs: Sequence[CompiledConfig]) -> list[
        CompiledConfig]:
    """Configs whose key is not on the board yet, first occurrence only."""
    seen = set(view.posted)
    out = []
    for cfg in configs:
        key = space.key(cfg)
        if key not in seen:
            seen.add(key)
            out.append(cfg)
    return out


class AgentRunner:
    """Keeps ``target_open`` open proposals of one agent on the board, until stopped."""

    def __init__(self, agent: Agent, board: Board, space: SearchSpace, campaign: str,
                 tier: str, target_open: int = 2, poll_s: float = 0.2) -> None:
        self.agent = agent
        self.board = board
        self.space = space
        self.campaign = campaign
        self.tier = tier
        self.target_open = target_open
        self.poll_s = poll_s
        self.num_posted = 0
        self.num_rejected = 0  # proposals the agent itself found unusable (RejectsProposals)
        self.num_failed_rounds = 0

    async def step(self) -> int:
        """One round: top up this agent's open proposals; returns how many were posted."""
        loop = asyncio.get_running_loop()
        open_mine = await loop.run_in_executor(None, self._open_count)
        if open_mine >= self.target_open:
            return 0
        view = await loop.run_in_executor(None, read_view, self.board, self.campaign, self.tier)
        try:
            cands = await loop.run_in_executor(None, self.agent.propose, view,
                                               self.target_open - open_mine)
        except Exception:
            # NOTE: one agent's bug must not stop the search; it is logged and retried.
            self.num_failed_rounds += 1
            logger.exception("agent %s failed to propose", self.agent.name)
            return 0
        finally:
            if isinstance(self.agent, RejectsProposals):
                await loop.run_in_executor(None, self._note_rejections,
                                           self.agent.take_rejections())
        return await loop.run_in_executor(None, self._post, cands)

    def _note_rejections(self, reasons: Sequence[str]) -> None:
        for why in reasons:
            self.board.note(self.campaign, self.agent.name, "rejected_proposal", {"reason": why})
        self.num_rejected += len(reasons)

    def _open_count(self) -> int:
        return sum(p.agent == self.agent.name for p in
                   self.board.proposals(self.campaign, status="proposed"))

    def _post(self, cands: Sequence[Candidate]) -> int:
        n = 0
        for c in cands:
            pid = self.board.post(self.campaign, self.space.key(c.config), c.config.to_dict(),
                                  self.agent.name, c.predicted, c.reason)
            n += pid is not None
        self.num_posted += n
        return n

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            posted = await self.step()
            try:
                await asyncio.wait_for(stop.wait(), self.poll_s if posted else 4 * self.poll_s)
            except TimeoutError:
                pass
