"""The shared message board: one SQLite file that every agent and measurer talks through.

Tables: ``proposals`` (a candidate config posted by an agent, with its
status: proposed -> claimed -> measured | pruned | failed), ``results``
(one measurement of a candidate in a tier), ``notes`` (free-form JSON
messages: pruning audits, verifications, traffic shifts) and ``promotions``.
Everything is scoped by a *campaign*: one traffic profile; a traffic shift
starts a new campaign so old results don't steer the new search.

The file is opened in WAL mode with a busy timeout, and every call uses its
own short-lived connection, so any number of threads and processes may share
one board. A claim is a single ``UPDATE ... WHERE status = 'proposed'`` inside
``BEGIN IMMEDIATE``: two measurers never get the same proposal.

Example::

    board = Board("/tmp/opt.sqlite")
    pid = board.post("c1", key, config.to_dict(), agent="bayes", predicted=41.0)
    p = board.claim("c1", claimer="measurer-1")      # Proposal or None
    board.add_result(p.id, "fast", value=40.2, seconds=3.1)
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optimizer.errors import BoardError

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS proposals (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    campaign TEXT NOT NULL,
    key TEXT NOT NULL,
    config TEXT NOT NULL,
    agent TEXT NOT NULL,
    predicted REAL,
    reason TEXT NOT NULL DEFAULT '',
    status TEXT NOT NULL DEFAULT 'proposed',
    claimed_by TEXT,
    claimed_at REAL,
    created_at REAL NOT NULL,
    UNIQUE (campaign, key)
);
CREATE INDEX IF NOT EXISTS proposals_status ON proposals (campaign, status, id);
CREATE TABLE IF NOT EXISTS results (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    proposal_id INTEGER NOT NULL REFERENCES proposals (id),
    tier TEXT NOT NULL,
    value REAL NOT NULL,
    seconds REAL NOT NULL,
    details TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS results_proposal ON results (proposal_id, tier);
CREATE TABLE IF NOT EXISTS notes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    campaign TEXT NOT NULL,
    author TEXT NOT NULL,
    kind TEXT NOT NULL,
    body TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS promotions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    campaign TEXT NOT NULL,
    worker TEXT NOT NULL,
    key TEXT NOT NULL,
    status TEXT NOT NULL,
    gain REAL,
    details TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL
);
"""

STATUSES = ("proposed", "claimed", "measured", "pruned", "failed")


@dataclass(frozen=True)
class Proposal:
    id: int
    campaign: str
    key: str  # SearchSpace.key: canonical knob values
    config: dict[str, Any]  # CompiledConfig.to_dict()
    agent: str
    predicted: float | None  # the agent's (or cost model's) tokens/s guess
    reason: str
    status: str
    claimed_by: str | None


@dataclass(frozen=True)
class Result:
    proposal_id: int
    key: str
    agent: str
    tier: str  # "fast" | "slow" | a custom tier name
    value: float  # objective, higher is better (tokens/s)
    seconds: float  # wall time of the experiment
    details: dict[str, Any]


@dataclass(frozen=True)
class Note:
    campaign: str
    author: str
    kind: str
    body: dict[str, Any]
    created_at: float  # unix seconds


class Board:
    def __init__(self, path: str | Path, busy_timeout_s: float = 30.0) -> None:
        self.path = str(path)
        self.busy_timeout_s = busy_timeout_s
        try:
            with self._connect() as conn:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.executescript(_SCHEMA)
        except sqlite3.Error as e:
            raise BoardError(f"{self.path}: cannot open the board ({e})") from e

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None)
        try:
            conn.execute("PRAGMA synchronous=NORMAL")
            yield conn
        finally:
            conn.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._connect() as conn:
            try:
                conn.execute("BEGIN IMMEDIATE")
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    # -- proposals ----------------------------------------------------------

    def post(self, campaign: str, key: str, config: dict[str, Any], agent: str,
             predicted: float | None = None, reason: str = "") -> int | None:
        """Post a candidate; None when the campaign already has it (from any agent)."""
        with self._write() as conn:
            cur = conn.execute(
                "INSERT OR IGNORE INTO proposals (campaign, key, config, agent, predicted, reason,"
                " created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (campaign, key, json.dumps(config), agent, predicted, reason, time.time()))
            return cur.lastrowid if cur.rowcount else None

    def claim(self, campaign: str, claimer: str) -> Proposal | None:
        """Atomically take the oldest open proposal of the campaign, or None."""
        with self._write() as conn:
            row = conn.execute(
                "SELECT id FROM proposals WHERE campaign = ? AND status = 'proposed' "
                "ORDER BY id LIMIT 1", (campaign,)).fetchone()
            if row is None:
                return None
            conn.execute("UPDATE proposals SET status = 'claimed', claimed_by = ?, claimed_at = ?"
                         " WHERE id = ? AND status = 'proposed'", (claimer, time.time(), row[0]))
            return self._proposal(conn, row[0])

    def set_status(self, proposal_id: int, status: str) -> None:
        if status not in STATUSES:
            raise BoardError(f"status: expected one of {STATUSES}, got {status!r}")
        with self._write() as conn:
            conn.execute("UPDATE proposals SET status = ? WHERE id = ?", (status, proposal_id))

    def requeue_stale(self, campaign: str, older_than_s: float) -> int:
        """Give claims of crashed measurers back; returns how many."""
        with self._write() as conn:
            cur = conn.execute(
                "UPDATE proposals SET status = 'proposed', claimed_by = NULL WHERE campaign = ?"
                " AND status = 'claimed' AND claimed_at < ?", (campaign, time.time() - older_than_s))
            return cur.rowcount

    def proposals(self, campaign: str, status: str | None = None) -> list[Proposal]:
        sql = "SELECT id FROM proposals WHERE campaign = ?"
        args: tuple[Any, ...] = (campaign,)
        if status is not None:
            sql, args = sql + " AND status = ?", (campaign, status)
        with self._connect() as conn:
            ids = [r[0] for r in conn.execute(sql + " ORDER BY id", args)]
            return [self._proposal(conn, i) for i in ids]

    def proposal(self, proposal_id: int) -> Proposal:
        with self._connect() as conn:
            return self._proposal(conn, proposal_id)

    def keys(self, campaign: str) -> set[str]:
        with self._connect() as conn:
            return {r[0] for r in conn.execute("SELECT key FROM proposals WHERE campaign = ?",
                                               (campaign,))}

    def status_counts(self, campaign: str) -> dict[str, int]:
        with self._connect() as conn:
            rows = conn.execute("SELECT status, COUNT(*) FROM proposals WHERE campaign = ? "
                                "GROUP BY status", (campaign,))
            return {s: n for s, n in rows}

    def find(self, campaign: str, key: str) -> Proposal | None:
        with self._connect() as conn:
            row = conn.execute("SELECT id FROM proposals WHERE campaign = ? AND key = ?",
                               (campaign, key)).fetchone()
            return self._proposal(conn, row[0]) if row else None

    @staticmethod
    def _proposal(conn: sqlite3.Connection, proposal_id: int) -> Proposal:
        r = conn.execute("SELECT id, campaign, key, config, agent, predicted, reason, status, "
                         "claimed_by FROM proposals WHERE id = ?", (proposal_id,)).fetchone()
        if r is None:
            raise BoardError(f"no proposal {proposal_id}")
        return Proposal(r[0], r[1], r[2], json.loads(r[3]), r[4], r[5], r[6], r[7], r[8])

    # -- results ------------------------------------------------------------

    def add_result(self, proposal_id: int, tier: str, value: float, seconds: float,
                   details: dict[str, Any] | None = None) -> None:
        with self._write() as conn:
            conn.execute("INSERT INTO results (proposal_id, tier, value, seconds, details, "
                         "created_at) VALUES (?, ?, ?, ?, ?, ?)",
                         (proposal_id, tier, value, seconds, json.dumps(details or {}), time.time()))

    def results(self, campaign: str, tier: str | None = None) -> list[Result]:
        sql = ("SELECT r.proposal_id, p.key, p.agent, r.tier, r.value, r.seconds, r.details "
               "FROM results r JOIN proposals p ON p.id = r.proposal_id WHERE p.campaign = ?")
        args: tuple[Any, ...] = (campaign,)
        if tier is not None:
            sql, args = sql + " AND r.tier = ?", (campaign, tier)
        with self._connect() as conn:
            return [Result(r[0], r[1], r[2], r[3], r[4], r[5], json.loads(r[6]))
                    for r in conn.execute(sql + " ORDER BY r.id", args)]

    def experiment_times(self, since_s: float) -> list[tuple[str, str, float]]:
        """(campaign, tier, unix seconds) of each measurement made since ``since_s``, oldest
        first: the experiments on a time axis (the proxy's dashboard)."""
        with self._connect() as conn:
            return [(r[0], r[1], r[2]) for r in conn.execute(
                "SELECT p.campaign, r.tier, r.created_at FROM results r JOIN proposals p "
                "ON p.id = r.proposal_id WHERE r.created_at >= ? ORDER BY r.id", (since_s,))]

    # -- notes and promotions -----------------------------------------------

    def note(self, campaign: str, author: str, kind: str, body: dict[str, Any]) -> None:
        with self._write() as conn:
            conn.execute("INSERT INTO notes (campaign, author, kind, body, created_at) "
                         "VALUES (?, ?, ?, ?, ?)",
                         (campaign, author, kind, json.dumps(body), time.time()))

    def notes(self, campaign: str | None = None, kind: str | None = None,
              limit: int = 100) -> list[Note]:
        where, args = [], []
        for col, val in (("campaign", campaign), ("kind", kind)):
            if val is not None:
                where.append(f"{col} = ?")
                args.append(val)
        sql = "SELECT campaign, author, kind, body, created_at FROM notes"
        sql += (" WHERE " + " AND ".join(where)) if where else ""
        with self._connect() as conn:
            rows = conn.execute(sql + " ORDER BY id DESC LIMIT ?", (*args, limit)).fetchall()
        return [Note(r[0], r[1], r[2], json.loads(r[3]), r[4]) for r in reversed(rows)]

    def add_promotion(self, campaign: str, worker: str, key: str, status: str,
                      gain: float | None, details: dict[str, Any] | None = None) -> None:
        with self._write() as conn:
            conn.execute("INSERT INTO promotions (campaign, worker, key, status, gain, details, "
                         "created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (campaign, worker, key, status, gain, json.dumps(details or {}),
                          time.time()))

    def promotions(self, limit: int = 20) -> list[dict[str, Any]]:
        with self._connect() as conn:
            rows = conn.execute("SELECT campaign, worker, key, status, gain, details, created_at "
                                "FROM promotions ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [{"campaign": r[0], "worker": r[1], "key": json.loads(r[2]), "status": r[3],
                 "gain": r[4], "details": json.loads(r[5]), "created_at": r[6]}
                for r in reversed(rows)]


def best_by_key(results: Sequence[Result]) -> dict[str, float]:
    """Mean value per candidate key."""
    acc: dict[str, list[float]] = {}
    for r in results:
        acc.setdefault(r.key, []).append(r.value)
    return {k: sum(v) / len(v) for k, v in acc.items()}
