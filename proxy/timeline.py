"""What the optimizer did, on the dashboard's time axis.

Two sources:

- the live service in this proxy (``polyinfer serve --optimize``): its state
  (starting, waiting for traffic, screening, confirming, verifying, promoting...),
  sampled once a second by the history sampler, kept as the times it changed;
- its board, the SQLite file every agent and measurer writes: campaign starts (the
  ``incumbent`` note) and ends (``campaign_done``), each experiment (a result row),
  the current campaign's candidates, promotions and rollbacks, all with their times.
  That includes other measurer processes sharing the board (``polyinfer optimize
  join``) and what happened before this proxy started.

The board is read in an executor, at most once every ``BOARD_TTL_S`` and never on
the request path; a read covers the longest window the page can ask for, and each
answer cuts its own window out of it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sqlite3
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxy.history import MAX_WINDOW_S

if TYPE_CHECKING:
    from optimizer.board import Board

logger = logging.getLogger(__name__)

MAX_STATES = 512  # state changes kept (a campaign makes about six)
BOARD_TTL_S = 5.0
MAX_CANDIDATES = 10
MAX_BOARD_ROWS = 500  # notes and promotions read per kind: far more than an hour holds


class OptimizerTimeline:
    """The optimizer's activity for ``GET /stats/history``; ``board_path`` None: no optimizer."""

    def __init__(self, board_path: Path | None) -> None:
        self.board_path = board_path
        self.states: deque[tuple[float, str]] = deque(maxlen=MAX_STATES)  # (unix s, state)
        self.live: dict[str, Any] | None = None  # the service's latest snapshot, in short
        self._board: Board | None = None
        self._read_at = -math.inf  # monotonic
        self._board_doc: dict[str, Any] = {}
        self._lock = asyncio.Lock()

    def observe(self, now_s: float, snapshot: Mapping[str, Any]) -> None:
        """One sample of :meth:`optimizer.service.OptimizerService.snapshot` (sampler, 1 Hz)."""
        state = str(snapshot.get("state"))
        if not self.states or self.states[-1][1] != state:
            self.states.append((now_s, state))
        campaign = snapshot.get("campaign") or {}
        self.live = {"state": state, "campaign": campaign.get("id"),
                     "phase": campaign.get("phase"),
                     "fast_experiments": campaign.get("fast_experiments"),
                     "fast_budget": campaign.get("fast_budget"),
                     "experiments_per_hour": snapshot.get("experiments_per_hour") or {},
                     "last_error": snapshot.get("last_error")}

    async def doc(self, t: Sequence[float], step_s: float, end_s: float) -> dict[str, Any]:
        """The window ``[t[0], end_s)``: states, board events, and experiments counted on the
        points ``t`` (each ``step_s`` long), JSON-able."""
        if self.board_path is None:
            return {"enabled": False}
        board = await self._read_board()
        since = t[0] if t else end_s
        return {
            "enabled": True, "live": self.live, "states": self.states_since(since),
            "events": [e for e in board.get("events", ()) if e["ts"] >= since],
            "experiments": _count_on(board.get("experiments", ()), t, step_s),
            "candidates": board.get("candidates"), "board_error": board.get("error"),
        }

    def states_since(self, since_s: float) -> list[list[Any]]:
        """The state changes in the window, led by the state in force at its start."""
        out: list[list[Any]] = []
        for ts, state in self.states:
            if ts < since_s:
                out = [[since_s, state]]
            else:
                out.append([ts, state])
        return out

    async def _read_board(self) -> dict[str, Any]:
        async with self._lock:
            if time.monotonic() - self._read_at >= BOARD_TTL_S:
                loop = asyncio.get_running_loop()
                campaign = (self.live or {}).get("campaign")
                self._board_doc = await loop.run_in_executor(
                    None, self._board_doc_now, time.time() - MAX_WINDOW_S, campaign)
                self._read_at = time.monotonic()
            return self._board_doc

    def _board_doc_now(self, since_s: float, campaign: str | None) -> dict[str, Any]:
        """Blocking (SQLite): the board's events since ``since_s`` and the candidates of
        ``campaign`` (else of the board's latest campaign)."""
        from optimizer.errors import BoardError
        assert self.board_path is not None
        if not self.board_path.exists():  # NOTE: never create the optimizer's file for it
            return {}
        try:
            if self._board is None:
                from optimizer.board import Board
                self._board = Board(self.board_path)
            return read_board(self._board, since_s, campaign)
        except (BoardError, sqlite3.Error, OSError, ValueError) as e:  # ValueError: bad JSON
            logger.warning("dashboard: cannot read the optimizer board %s: %s",
                           self.board_path, e)
            return {"error": f"{type(e).__name__}: {e}"}


def read_board(board: Board, since_s: float, campaign: str | None) -> dict[str, Any]:
    """Campaign starts and ends, promotions and rollbacks (``events``, oldest first),
    experiment times, and the candidates of ``campaign`` or of the latest one."""
    starts = board.notes(kind="incumbent", limit=MAX_BOARD_ROWS)
    events: list[dict[str, Any]] = [
        {"ts": n.created_at, "kind": "campaign", "campaign": n.campaign}
        for n in starts if n.created_at >= since_s]
    events += [{"ts": n.created_at, "kind": "campaign_done", "campaign": n.campaign,
                "status": n.body.get("status"), "gain": n.body.get("gain")}
               for n in board.notes(kind="campaign_done", limit=MAX_BOARD_ROWS)
               if n.created_at >= since_s]
    events += [{"ts": p["created_at"], "kind": p["status"], "campaign": p["campaign"],
                "gain": p["gain"], "reason": p["details"].get("reason", "")}
               for p in board.promotions(limit=MAX_BOARD_ROWS) if p["created_at"] >= since_s]
    events.sort(key=lambda e: e["ts"])
    current = campaign or (starts[-1].campaign if starts else None)
    return {"events": events,
            "experiments": [(ts, tier) for _, tier, ts in board.experiment_times(since_s)],
            "candidates": None if current is None else candidates(board, current)}


def candidates(board: Board, campaign: str) -> dict[str, Any]:
    """The campaign's best candidates: measured ones by their fast-tier value, then the
    others by what their agent predicted; and how many proposals are in each status."""
    from optimizer.board import best_by_key

    results = board.results(campaign)
    by_tier = {tier: best_by_key([r for r in results if r.tier == tier])
               for tier in sorted({r.tier for r in results})}
    rows = [{"key": _knobs(p.key), "agent": p.agent, "status": p.status,
             "predicted": p.predicted,
             "values": {tier: round(v[p.key], 2) for tier, v in by_tier.items() if p.key in v}}
            for p in board.proposals(campaign)]
    rows.sort(key=lambda r: (-r["values"].get("fast", -math.inf), -(r["predicted"] or 0.0)))
    return {"campaign": campaign, "counts": board.status_counts(campaign),
            "tiers": list(by_tier), "top": rows[:MAX_CANDIDATES]}


def _knobs(key: str) -> Any:
    """A candidate's key (the search space's canonical knob values, JSON) as an object."""
    try:
        return json.loads(key)
    except ValueError:
        return key


def _count_on(times: Sequence[tuple[float, str]], t: Sequence[float], step_s: float
              ) -> dict[str, list[int]]:
    """Experiments per tier counted on the points ``t``."""
    out: dict[str, list[int]] = {}
    if not t:
        return out
    for ts, tier in times:
        i = math.floor((ts - t[0]) / step_s)
        if 0 <= i < len(t):
            out.setdefault(tier, [0] * len(t))[i] += 1
    return out
