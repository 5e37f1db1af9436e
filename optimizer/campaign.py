"""One campaign: the search for one traffic profile, from screening to a confirmed winner.

    screen   claim proposals from the board (any agent's), prune with the cost
             model, measure the rest in the fast tier, recalibrate the cost
             model, until the fast-tier budget is spent or the agents go quiet;
             an experiment that had to start an engine (a restart-only knob,
             see optimizer.pool) is charged its seconds over its seconds
             without the start: a 4 s cold start before a 1 s replay costs 5;
    confirm  measure the incumbent and the best few screened candidates in the
             slow tier (repeated), and return the best with its gain report.

Agents run beside it (``AgentRunner`` tasks owned by the service); the
campaign only reads and writes the board.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from optimizer.abtest import GainReport, detectable_effect, paired_gain, pairs_needed
from optimizer.board import Board, Proposal, best_by_key
from optimizer.costmodel import CostModel, Workload
from optimizer.errors import MeasurementError
from optimizer.measure import Measurement, Measurer
from optimizer.pruner import PruneConfig, Pruner
from optimizer.space import SearchSpace
from polyinfer.config import CompiledConfig

logger = logging.getLogger(__name__)

INCUMBENT_AGENT = "incumbent"
STALE_CLAIM_S = 900.0  # a claim older than this (no result) is taken to be abandoned


@dataclass(frozen=True)
class SearchConfig:
    fast_budget: int = 24  # fast-tier experiments per campaign (restarts priced in, see above)
    finalists: int = 2  # screened candidates confirmed in the slow tier
    # NOTE: the fast tier's truncated model writes different text, so it misjudges
    # speculation (acceptance depends on the full model's output). With this on,
    # the best screened config of every speculation method that beat the
    # incumbent's fast value less this margin also goes to the slow tier, beside
    # the top `finalists`. None = off.
    spec_method_margin: float | None = 0.15
    idle_timeout_s: float = 30.0  # screening ends when no proposal arrives for this long
    min_gain: float = 0.02  # the gain's 95% CI must lie above this
    # confirmation measures enough interleaved pairs to detect a gain this large with 80%
    # power (from the pilot's variance: the slow tier's repeats), at most max_pairs
    min_detectable_effect: float = 0.05
    max_pairs: int = 10
    prune: PruneConfig = field(default_factory=PruneConfig)

    def __post_init__(self) -> None:
        if self.fast_budget < 1 or self.finalists < 1 or self.idle_timeout_s <= 0:
            raise ValueError("search: fast_budget, finalists >= 1 and idle_timeout_s > 0")
        if not 0 < self.min_detectable_effect < 1 or self.max_pairs < 2:
            raise ValueError("search: min_detectable_effect in (0, 1) and max_pairs >= 2")


@dataclass(frozen=True)
class Confirmed:
    config: CompiledConfig
    key: str
    measurement: Measurement  # slow tier
    incumbent: Measurement  # slow tier, same run
    gain: GainReport
    pairs_needed: int = 0  # for min_detectable_effect, from the pilot's variance
    detectable: float = 0.0  # the effect the pairs measured could detect (80% power)


class Campaign:
    def __init__(self, campaign_id: str, board: Board, space: SearchSpace, measurer: Measurer,
                 cost_model: CostModel, work: Workload, incumbent: CompiledConfig,
                 config: SearchConfig, fast: str = "fast", slow: str = "slow",
                 claimer: str = "measurer") -> None:
        self.id = campaign_id
        self.board = board
        self.space = space
        self.measurer = measurer
        self.cost_model = cost_model
        self.work = work
        self.incumbent = space.canonical(incumbent)
        self.config = config
        self.fast = fast
        self.slow = slow
        self.claimer = claimer
        self.fast_layers = measurer.tiers[fast].num_layers
        self.pruner = Pruner(config.prune, self.predict_fast)
        self.phase = "screening"
        self.num_fast = 0
        self.budget_used = 0.0  # fast experiments, each priced by experiment_cost
        self.num_failed = 0
        self.started = time.monotonic()
        self.log: list[dict[str, Any]] = []  # last experiments, for /stats

    def predict_fast(self, cfg: CompiledConfig) -> float:
        return self.cost_model.predict(cfg, self.work, self.fast_layers)

    # -- screening ---------------------------------------------------------

    async def measure_incumbent(self) -> float:
        pid = await self._call(self.board.post, self.id, self.space.key(self.incumbent),
                               self.incumbent.to_dict(), INCUMBENT_AGENT, None, "live config")
        existing = await self._call(self.board.find, self.id, self.space.key(self.incumbent))
        assert existing is not None
        await self._call(self.board.note, self.id, "service", "incumbent",
                         {"key": existing.key})
        if pid is None:  # NOTE: another process already posted (and maybe measured) it
            measured = best_by_key(await self._call(self.board.results, self.id, self.fast))
            if existing.key in measured:
                return measured[existing.key]
        await self._call(self.board.set_status, existing.id, "claimed")
        m = await self._measure(existing, self.fast)
        return m.value if m else 0.0

    async def screen(self) -> None:
        # NOTE: claims left by a measurer process that died go back on the board.
        await self._call(self.board.requeue_stale, self.id, STALE_CLAIM_S)
        last_claim = time.monotonic()
        while self.budget_used < self.config.fast_budget:
            p = await self._call(self.board.claim, self.id, self.claimer)
            if p is None:
                if time.monotonic() - last_claim > self.config.idle_timeout_s:
                    logger.info("campaign %s: agents quiet, screening ends", self.id)
                    break
                await asyncio.sleep(0.1)
                continue
            last_claim = time.monotonic()
            await self._screen_one(p)

    async def _screen_one(self, p: Proposal) -> None:
        cfg = CompiledConfig.from_dict(p.config)
        measured = best_by_key(await self._call(self.board.results, self.id, self.fast))
        best = max(measured.values()) if measured else None
        decision = self.pruner.decide(cfg, best, self.cost_model.num_calibration_points)
        if decision.prune and not decision.audit:
            await self._call(self.board.set_status, p.id, "pruned")
            self._remember(p, "pruned", decision.predicted, None)
            return
        m = await self._measure(p, self.fast)
        if m is None:
            return
        if decision.prune:
            wrong = self.pruner.record_audit(decision, m.value)
            await self._call(self.board.set_status, p.id, "pruned")
            await self._call(self.board.note, self.id, "pruner", "prune_audit",
                             {"key": p.key, "predicted": decision.predicted,
                              "threshold": decision.threshold, "measured": m.value,
                              "wrong": wrong})
        self._remember(p, "audited" if decision.prune else "measured", decision.predicted,
                       m.value)
        await self._recalibrate()

    async def _measure(self, p: Proposal, tier: str,
                       repeats: int | None = None) -> Measurement | None:
        cfg = CompiledConfig.from_dict(p.config)
        try:
            m = await self.measurer.measure(cfg, tier, repeats)
        except MeasurementError as e:
            logger.warning("campaign %s: %s failed: %s", self.id, p.key, e)
            self.num_failed += 1
            await self._call(self.board.set_status, p.id, "failed")
            await self._call(self.board.note, self.id, self.claimer, "failed",
                             {"key": p.key, "error": str(e)[:300]})
            return None
        if tier == self.fast:
            self.num_fast += 1
            self.budget_used += experiment_cost(m)
        await self._call(self.board.add_result, p.id, tier, m.value, m.seconds,
                         {"values": m.values, "reload_s": m.reload_s, "errors": m.num_errors,
                          "restart_s": m.restart_s,
                          **m.details})
        await self._call(self.board.set_status, p.id, "measured")
        return m

    async def _recalibrate(self) -> None:
        results = await self._call(self.board.results, self.id, self.fast)
        pairs = [(self.space.from_key(k), v) for k, v in best_by_key(results).items()]
        await asyncio.get_running_loop().run_in_executor(
            None, self.cost_model.calibrate, pairs, self.work, self.fast_layers)

    def _remember(self, p: Proposal, what: str, predicted: float, value: float | None) -> None:
        self.log.append({"key": p.key, "agent": p.agent, "what": what,
                         "predicted": round(predicted, 2),
                         "value": None if value is None else round(value, 2)})
        del self.log[:-20]

    async def best_fast(self) -> tuple[str, float] | None:
        """The best screened candidate (key, fast-tier value), incumbent included."""
        measured = best_by_key(await self._call(self.board.results, self.id, self.fast))
        if not measured:
            return None
        key = max(measured, key=lambda k: measured[k])
        return key, measured[key]

    # -- confirmation ------------------------------------------------------

    async def confirm(self) -> Confirmed | None:
        """Interleaved slow-tier pairs (incumbent, finalist) for each finalist; the best."""
        self.phase = "confirming"
        measured = best_by_key(await self._call(self.board.results, self.id, self.fast))
        inc_key = self.space.key(self.incumbent)
        finalists = pick_finalists(measured, inc_key, self.config.finalists,
                                   self.config.spec_method_margin)
        best: Confirmed | None = None
        for key in finalists:
            confirmed = await self._confirm_one(inc_key, key)
            if confirmed is not None and (best is None or confirmed.gain.gain > best.gain.gain):
                best = confirmed
        return best

    async def _confirm_one(self, inc_key: str, key: str) -> Confirmed | None:
        """A pilot of interleaved pairs, then as many more as the MDE needs (max_pairs)."""
        inc_p = await self._call(self.board.find, self.id, inc_key)
        cand_p = await self._call(self.board.find, self.id, key)
        assert inc_p is not None and cand_p is not None
        inc_runs: list[Measurement] = []
        cand_runs: list[Measurement] = []
        pilot = max(2, self.measurer.tiers[self.slow].repeats)
        wanted = pilot
        while len(cand_runs) < wanted:
            inc = await self._measure(inc_p, self.slow, repeats=1)
            cand = await self._measure(cand_p, self.slow, repeats=1)
            if inc is None or cand is None:
                return None
            inc_runs.append(inc)
            cand_runs.append(cand)
            if len(cand_runs) == pilot:
                sd = paired_gain(_merge(cand_runs).values, _merge(inc_runs).values).sd
                needed = pairs_needed(sd, self.config.min_detectable_effect,
                                      self.config.max_pairs)
                wanted = max(pilot, needed)
        cand_m, inc_m = _merge(cand_runs), _merge(inc_runs)
        gain = paired_gain(cand_m.values, inc_m.values, self.config.min_gain)
        return Confirmed(self.space.from_key(key), key, cand_m, inc_m, gain, wanted,
                         detectable_effect(gain.sd, gain.num_pairs))

    async def _call(self, fn: Any, *args: Any) -> Any:
        """Board calls are blocking SQLite I/O: keep them off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def snapshot(self) -> dict[str, Any]:
        return {"id": self.id, "phase": self.phase, "fast_experiments": self.num_fast,
                "fast_budget": self.config.fast_budget,
                "budget_used": round(self.budget_used, 2), "failed": self.num_failed,
                "pruning": self.pruner.snapshot(),
                "elapsed_s": round(time.monotonic() - self.started, 1),
                "recent": list(self.log[-10:])}


def experiment_cost(m: Measurement) -> float:
    """Budget units one experiment used: 1, times the share an engine cold start added."""
    replay_s = m.seconds - m.restart_s
    return 1.0 if m.restart_s <= 0 or replay_s <= 0 else m.seconds / replay_s


def pick_finalists(measured: dict[str, float], incumbent_key: str, num: int,
                   spec_method_margin: float | None) -> list[str]:
    """Top ``num`` keys that beat the incumbent in the fast tier, then the best key of
    each other speculation method within ``spec_method_margin`` below the incumbent."""
    floor = measured.get(incumbent_key, 0.0)
    ranked = [k for k, _ in sorted(measured.items(), key=lambda kv: -kv[1])
              if k != incumbent_key]
    picked = [k for k in ranked if measured[k] > floor][:num]
    if spec_method_margin is None:
        return picked
    methods = {json.loads(k).get("spec_method") for k in picked}
    for k in ranked:
        method = json.loads(k).get("spec_method")
        if method not in methods and measured[k] > floor * (1.0 - spec_method_margin):
            methods.add(method)
            picked.append(k)
    return picked


def _merge(runs: list[Measurement]) -> Measurement:
    values = tuple(v for m in runs for v in m.values)
    return Measurement(runs[0].tier, statistics.fmean(values), values,
                       sum(m.seconds for m in runs), statistics.fmean(m.reload_s for m in runs),
                       sum(m.num_errors for m in runs), runs[-1].details)
