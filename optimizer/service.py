"""The optimizer service: traffic in, better configs out, in the background.

Entry point for ``polyinfer serve --optimize`` (run in a cleanup_ctx task)
and for ``polyinfer optimize`` (standalone)::

    service = OptimizerService(OptimizerConfig(traces=("traces.jsonl",),
                                               worker_url="http://127.0.0.1:8101"))
    task = asyncio.create_task(service.run())   # until cancelled (or one campaign, once=True)
    service.observe(trace_record)                # optional: live records from the proxy
    stats["optimizer"] = service.snapshot()      # plain JSON-able dict

The host hands in implementations of the optimizer's interfaces
(:class:`optimizer.promote.ConfigSink`, :class:`optimizer.promote.WorkerSwitch`):
inside the proxy, ``proxy.optimize`` passes its pool's config sink so the
router's profiles follow promotions, and its blue-green switch for vLLM workers.

One loop: refresh the traffic profile (tail trace files + observed records);
when there is none yet or it shifted, start a campaign (new board scope,
replay samples, reference outputs); run the agents beside the screening;
confirm finalists in the slow tier; verify; promote to the live worker (hot
reload, rollback on live regression); then wait for the next shift.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from optimizer.agents.base import Agent, AgentRunner
from optimizer.agents.bayes import BayesAgent
from optimizer.agents.costagent import CostModelAgent
from optimizer.agents.evolution import EvolutionAgent
from optimizer.agents.llm import LlmAgent
from optimizer.board import Board
from optimizer.campaign import Campaign, Confirmed, SearchConfig
from optimizer.costmodel import CostModel, ForwardTimeModel, HardwareConstants, Workload
from optimizer.engine_proc import EngineProcess
from optimizer.errors import OptimizerError, PromotionError
from optimizer.measure import EngineClient, Measurer, Tier
from optimizer.pool import EnginePool
from optimizer.profile import (
    TraceTail,
    TrafficProfile,
    build_profile,
    checked_record,
    profile_distance,
    stratified_sample,
)
from optimizer.promote import ConfigSink, Promoter, PromotionConfig, WorkerSwitch
from optimizer.sample import DomainPromptSynthesizer, SampleConfig, build_replay
from optimizer.space import DEFAULT_KNOBS, Knob, ModelShape, SearchSpace
from optimizer.verify import (
    Reference,
    VerifyConfig,
    VerifyRequest,
    reference_outputs,
    verification_plan,
    verify_candidate,
)
from polyinfer.config import RESTART_FIELDS, TINY_DRAFT, CompiledConfig, needs_restart
from polyinfer.trace import TraceRecord

logger = logging.getLogger(__name__)

AGENT_NAMES = ("costmodel", "bayes", "evolution", "llm")


@dataclass(frozen=True)
class OptimizerConfig:
    base: CompiledConfig = field(default_factory=CompiledConfig)  # model + defaults
    traces: tuple[str, ...] = ()  # JSONL trace files, tailed
    board_path: str = "optimizer-board.sqlite"
    worker_url: str | None = None  # live worker to promote to; None = search only
    worker_name: str = ""  # the worker's name in the host (shown in snapshots)
    worker_backend: str = "engine"
    measure_url: str | None = None  # a persistent engine to measure on; None = start one
    # engines kept up at once for restart-only knobs (data_parallel_size), one per value
    # (only when this service starts its own; with measure_url such candidates are refused)
    max_measure_engines: int = 2
    agents: tuple[str, ...] = ("costmodel", "bayes", "evolution")
    llm_url: str | None = None  # OpenAI-compatible endpoint for the llm agent
    llm_model: str = ""
    fast: Tier = field(default_factory=lambda: Tier("fast", 2, 12, concurrency=8))
    slow: Tier = field(default_factory=lambda: Tier("slow", None, 24, repeats=3, concurrency=8))
    sample: SampleConfig = field(default_factory=SampleConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    promotion: PromotionConfig = field(default_factory=PromotionConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    memory_budget_bytes: int = 1 << 30  # for the KV cache
    knobs: tuple[Knob, ...] = DEFAULT_KNOBS  # the search space's dimensions
    # "auto": at low load (the traffic's mean concurrency below
    # `latency_bound_concurrency`) the mean per-request output tokens/s at the
    # replayed concurrency ("request": what a client sees; throughput only echoes
    # the offered load there); at higher load `throughput_objective`: "wall"
    # (output tokens per wall second of a closed-loop replay at the traffic's own
    # concurrency: the tokens/s the machine serves; it rewards using idle cores) or
    # "cpu" (tokens per engine CPU second: steadier on a box shared with other
    # tenants, but it can never pick a config that uses more cores; wall without a
    # CPU clock).
    objective: str = "auto"
    throughput_objective: str = "wall"
    latency_bound_concurrency: float = 2.0
    # Replay concurrency follows the traffic (Little's law on the traces) up to
    # each tier's concurrency; False = always the tier's concurrency.
    concurrency_from_traffic: bool = True
    min_records: int = 20  # traffic needed before a campaign starts
    window_records: int = 5000  # most recent records the profile is built from
    shift_threshold: float = 0.3  # profile_distance that starts a new campaign
    refresh_s: float = 5.0  # how often traffic is re-read when idle
    once: bool = False  # stop after one campaign (the standalone CLI)
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.agents) - set(AGENT_NAMES))
        if unknown:
            raise OptimizerError(f"agents: unknown {unknown}; expected some of {AGENT_NAMES}")
        if "llm" in self.agents and not self.llm_url:
            raise OptimizerError("agents: 'llm' needs llm_url (an OpenAI-compatible endpoint)")
        if self.worker_backend not in ("engine", "vllm", "external"):
            raise OptimizerError(f"worker_backend: unexpected {self.worker_backend!r}")
        if self.objective not in ("auto", "wall", "cpu", "request"):
            raise OptimizerError(f"objective: expected auto, wall, cpu or request, got "
                                 f"{self.objective!r}")
        if self.throughput_objective not in ("wall", "cpu"):
            raise OptimizerError(f"throughput_objective: expected wall or cpu, got "
                                 f"{self.throughput_objective!r}")
        if self.latency_bound_concurrency < 0:
            raise OptimizerError(f"latency_bound_concurrency: expected >= 0, got "
                                 f"{self.latency_bound_concurrency}")
        if self.max_measure_engines < 1:
            raise OptimizerError(f"max_measure_engines: expected >= 1, got "
                                 f"{self.max_measure_engines}")
        if self.min_records < 1 or self.window_records < self.min_records:
            raise OptimizerError("min_records >= 1 and window_records >= min_records")


class OptimizerService:
    def __init__(self, config: OptimizerConfig, sinks: tuple[ConfigSink, ...] = (),
                 session: aiohttp.ClientSession | None = None,
                 blue_green: WorkerSwitch | None = None) -> None:
        self.config = config
        self.sinks = sinks
        self.blue_green = blue_green
        self._session = session
        self._tails = [TraceTail(p) for p in config.traces]
        self._records: deque[TraceRecord] = deque(maxlen=config.window_records)
        self._num_bad_lines = 0
        self._num_observed = 0  # live records handed in by the host (the canary's input)
        self.state = "starting"
        self.profile: TrafficProfile | None = None
        self.campaign: Campaign | None = None
        self.measurer: Measurer | None = None
        self.history: list[dict[str, Any]] = []  # finished campaigns, newest last
        self.timings: dict[str, float] = {}
        self.last_error: str | None = None
        self.live_config: CompiledConfig | None = None
        self.last_canary: dict[str, Any] | None = None  # the last switch's live judgement
        # the live worker's URL: config.worker_url until a blue-green switch moves it
        self.worker_url = config.worker_url
        self.hardware: dict[str, float] = {}
        self._cpu_clock: Callable[[], float] | None = None
        self._pool: EnginePool | None = None  # set when this service starts its engines

    # -- the public surface -------------------------------------------------

    def observe(self, record: TraceRecord) -> None:
        """A live trace record from the proxy (cheap; bad records are counted and dropped)."""
        try:
            self._records.append(checked_record(record))
            self._num_observed += 1
        except ValueError:
            self._num_bad_lines += 1

    def live_records(self) -> list[TraceRecord]:
        """The live worker's recent records (a :class:`optimizer.promote.LiveRecords`)."""
        return list(self._records)

    async def run(self) -> None:
        own_session = self._session is None
        session = self._session or aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=600))
        engine_proc: EngineProcess | None = None
        try:
            engine_url = self.config.measure_url
            if engine_url is None:
                engine_proc = EngineProcess(self.config.base)
                self.state = "starting measurement engine"
                self.timings["cold_start_s"] = await engine_proc.start()
                engine_url = engine_proc.url
                self._pool = EnginePool(session, self.config.max_measure_engines)
                await self._pool.adopt(self.config.base, EngineClient(engine_url, session),
                                       engine_proc)
            self._cpu_clock = engine_proc.cpu_seconds if engine_proc is not None else None
            await self._run(session, engine_url)
        except asyncio.CancelledError:
            self.state = "stopped"
            raise
        except Exception as e:
            self.state, self.last_error = "failed", f"{type(e).__name__}: {e}"
            logger.exception("optimizer stopped")
            raise
        finally:
            if self._pool is not None:
                await asyncio.shield(self._pool.close())
            if engine_proc is not None:
                await asyncio.shield(engine_proc.stop())
            if own_session:
                await session.close()

    def snapshot(self) -> dict[str, Any]:
        m = self.measurer
        return {
            "worker": self.config.worker_name,
            "state": self.state,
            "records": len(self._records), "bad_records": self._num_bad_lines,
            "profile": _profile_summary(self.profile),
            "campaign": self.campaign.snapshot() if self.campaign else None,
            "objective": m.objective if m else None,
            "replay_concurrency": ({t.name: t.concurrency for t in m.tiers.values()} if m else {}),
            "experiments": dict(m.num_experiments) if m else {},
            "seconds_per_experiment": ({t: round(m.seconds[t] / n, 3) for t, n in
                                        m.num_experiments.items() if n} if m else {}),
            "experiments_per_hour": ({t: round(v, 1) for t, v in m.experiments_per_hour().items()}
                                     if m else {}),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "hardware": self.hardware,
            "live_config": self.live_config.to_dict()["engine"] if self.live_config else None,
            "history": self.history[-5:],
            "canary": self.last_canary,
            "board": self.config.board_path,
            "last_error": self.last_error,
        }

    # -- the loop -----------------------------------------------------------

    async def _run(self, session: aiohttp.ClientSession, engine_url: str) -> None:
        loop = asyncio.get_running_loop()
        engine = EngineClient(engine_url, session)
        await engine.wait_ready()
        board = await loop.run_in_executor(None, Board, self.config.board_path)
        # NOTE: the hardware is measured while the first traffic arrives, not before it
        models = loop.run_in_executor(None, self._build_models)
        self.live_config = await self._live_config(session)
        promoter = Promoter(session, self.config.promotion, self.sinks, self.blue_green)
        while True:
            profile = await self._wait_for_traffic()
            if not models.done():
                self.state = "measuring hardware"
            space, cost_model, synth = await models
            await self._campaign(profile, board, space, cost_model, synth, engine, promoter)
            if self.config.once:
                self.state = "done"
                return

    def _build_models(self) -> tuple[SearchSpace, CostModel, DomainPromptSynthesizer]:
        t0 = time.perf_counter()
        base = self.config.base
        draft = str(TINY_DRAFT) if (TINY_DRAFT / "config.json").exists() else ""
        knobs = self.config.knobs
        if self._pool is None:  # NOTE: an engine we did not start cannot be restarted
            knobs = tuple(k for k in knobs if k.name not in RESTART_FIELDS)
            if len(knobs) < len(self.config.knobs):
                logger.info("measure_url given: restart-only knobs %s left out of the search",
                            RESTART_FIELDS)
        space = SearchSpace.default(base, self.config.memory_budget_bytes, knobs,
                                    draft_model=draft)
        hw = HardwareConstants.measure()
        steps = ForwardTimeModel.fit(space.shape, hw)
        draft_shape = ModelShape.from_model_dir(draft) if draft else None
        self.timings["hardware_s"] = time.perf_counter() - t0
        self.hardware = {"mem_bandwidth_gbps": round(hw.mem_bandwidth_bps / 1e9, 2),
                         "matmul_gflops": round(hw.matmul_flops / 1e9, 2),
                         "step_overhead_ms": round(steps.overhead_s * 1e3, 3),
                         "roofline_scale": round(steps.scale, 2)}
        logger.info("hardware constants: %s", self.hardware)
        synth = DomainPromptSynthesizer(Path(base.model) / "tokenizer.json", seed=self.config.seed)
        return space, CostModel(space, steps, draft_shape), synth

    async def _live_config(self, session: aiohttp.ClientSession) -> CompiledConfig:
        if self.worker_url and self.config.worker_backend == "engine":
            try:
                return await EngineClient(self.worker_url, session).config()
            except (OptimizerError, aiohttp.ClientError, OSError) as e:
                logger.warning("cannot read the live worker's config (%s); using the base", e)
        return self.config.base

    async def _wait_for_traffic(self) -> TrafficProfile:
        """Block until there is enough traffic and no campaign has covered this profile."""
        self.state = "waiting for traffic"
        while True:
            await self._read_traces()
            if len(self._records) >= self.config.min_records:
                profile = build_profile(list(self._records))
                if self.profile is None or profile_distance(
                        profile, self.profile) >= self.config.shift_threshold:
                    if self.profile is not None:
                        logger.info("traffic shifted (distance %.2f): new campaign",
                                    profile_distance(profile, self.profile))
                    return profile
            await asyncio.sleep(self.config.refresh_s)

    async def _read_traces(self) -> None:
        loop = asyncio.get_running_loop()
        for tail in self._tails:
            read = await loop.run_in_executor(None, tail.read_new)
            self._records.extend(read.records)
            self._num_bad_lines += len(read.bad_lines)
            for bad in read.bad_lines[:5]:
                logger.warning("skipped bad trace line %s", bad)

    # -- one campaign -------------------------------------------------------

    async def _campaign(self, profile: TrafficProfile, board: Board, space: SearchSpace,
                        cost_model: CostModel, synth: DomainPromptSynthesizer, engine: EngineClient,
                        promoter: Promoter) -> None:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        self.profile = profile
        cid = _campaign_id(profile)
        self.state = "preparing campaign"
        samples, prompts = await loop.run_in_executor(None, self._samples, synth)
        fast, slow = (self._tier_for(t, profile) for t in (self.config.fast, self.config.slow))
        measurer = self.measurer = Measurer(engine, samples, (fast, slow), self._cpu_clock,
                                            self._objective(profile), self._pool)
        work = Workload(fast.concurrency, profile, self.config.sample.max_prompt_tokens,
                        self.config.sample.max_output_tokens)
        incumbent = self.live_config or self.config.base
        campaign = self.campaign = Campaign(cid, board, space, measurer, cost_model, work,
                                            incumbent, self.config.search)
        ref_engine = (await self._pool.get(incumbent))[0].client if self._pool else engine
        reference = await reference_outputs(ref_engine, incumbent, prompts)
        self.state = "screening"
        await campaign.measure_incumbent()
        stop = asyncio.Event()
        runners = [AgentRunner(a, board, space, cid, "fast")
                   for a in self._agents(space, campaign)]
        tasks = [asyncio.create_task(r.run(stop)) for r in runners]
        try:
            await campaign.screen()
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        self.state = "confirming"
        winner = await campaign.confirm()
        outcome = await self._finish(winner, engine, prompts, reference, promoter, board, cid)
        campaign.phase = "done"
        best = await campaign.best_fast()
        if best is not None:
            outcome["best_fast"] = {"key": json.loads(best[0]), "value": round(best[1], 2)}
        await loop.run_in_executor(None, board.note, cid, "service", "campaign_done", outcome)
        self._record_history(campaign, winner, outcome, runners, time.monotonic() - t0)

    async def _profile_drift(self) -> float | None:
        """How far the traffic moved from the campaign's profile, when beyond the threshold."""
        await self._read_traces()
        if self.profile is None or len(self._records) < self.config.min_records:
            return None
        distance = profile_distance(build_profile(list(self._records)), self.profile)
        return distance if distance >= self.config.shift_threshold else None

    def _tier_for(self, tier: Tier, profile: TrafficProfile) -> Tier:
        if not self.config.concurrency_from_traffic or profile.mean_concurrency <= 0:
            return tier
        wanted = max(1, min(tier.concurrency, round(profile.mean_concurrency)))
        return dataclasses.replace(tier, concurrency=wanted)

    def _objective(self, profile: TrafficProfile) -> str:
        if self.config.objective == "auto":
            if 0 < profile.mean_concurrency < self.config.latency_bound_concurrency:
                return "request"
            if self.config.throughput_objective == "cpu" and self._cpu_clock is not None:
                return "cpu"
            return "wall"
        if self.config.objective == "cpu" and self._cpu_clock is None:
            raise OptimizerError("objective 'cpu' needs a measurement engine started by the "
                                 "optimizer (no measure_url)")
        return self.config.objective

    def _samples(self, synth: DomainPromptSynthesizer
                 ) -> tuple[dict[str, list[Any]], list[VerifyRequest]]:
        records = list(self._records)
        samples = {}
        for i, tier in enumerate((self.config.fast, self.config.slow)):
            picked = stratified_sample(records, tier.num_requests, seed=self.config.seed + i)
            samples[tier.name] = build_replay(picked, synth, self.config.sample)
        return samples, verification_plan(synth, self.config.verify)

    def _agents(self, space: SearchSpace, campaign: Campaign) -> list[Agent]:
        seed = self.config.seed
        made: dict[str, Agent] = {
            "costmodel": CostModelAgent(space, campaign.predict_fast, seed=seed + 2),
            "bayes": BayesAgent(space, seed=seed),
            "evolution": EvolutionAgent(space, seed=seed + 1),
        }
        if self.config.llm_url:
            made["llm"] = LlmAgent(space, self.config.llm_url, self.config.llm_model)
        return [made[n] for n in self.config.agents]

    async def _finish(self, winner: Confirmed | None, engine: EngineClient,
                      prompts: list[VerifyRequest],
                      reference: Reference, promoter: Promoter, board: Board,
                      cid: str) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        if winner is None:
            return {"status": "no_candidate"}
        out: dict[str, Any] = {"key": json.loads(winner.key), **winner.gain.to_dict(),
                               "pairs_needed": winner.pairs_needed,
                               "detectable_effect": round(winner.detectable, 4),
                               "min_detectable_effect": self.config.search.min_detectable_effect,
                               "slow_tokens_per_s": round(winner.measurement.value, 2),
                               "incumbent_slow_tokens_per_s": round(winner.incumbent.value, 2)}
        if not winner.gain.significant:
            return {**out, "status": "within_noise"}
        drift = await self._profile_drift()
        if drift is not None:
            # NOTE: a winner tuned on traffic that has since moved is not promoted; the
            # loop's next look at the traffic sees the shift and starts a fresh campaign.
            return {**out, "status": "profile_stale", "profile_distance": round(drift, 3)}
        self.state = "verifying"
        if self._pool is not None:  # NOTE: a restart-only winner is verified on its own engine
            engine = (await self._pool.get(winner.config))[0].client
        report = await verify_candidate(engine, winner.config, prompts, reference,
                                        self.config.verify)
        await loop.run_in_executor(None, board.note, cid, "verifier", "verification",
                                   {"key": winner.key, "ok": report.ok, "batch": report.batch,
                                    "reason": report.reason, "coverage": report.coverage,
                                    "mismatches": {k: list(v) for k, v in
                                                   report.mismatches.items()},
                                    **report.details})
        if not report.ok:
            return {**out, "status": "verification_failed", "reason": report.reason,
                    "mismatches": list(report.bad)}
        return {**out, **await self._promote(winner, promoter, board, cid)}

    async def _promote(self, winner: Confirmed, promoter: Promoter, board: Board,
                       cid: str) -> dict[str, Any]:
        url, backend = self.worker_url, self.config.worker_backend
        if url is None:
            return {"status": "verified"}
        previous = self.live_config or self.config.base
        restart = backend == "engine" and needs_restart(previous, winner.config)
        if not self.config.promotion.worth_switching(winner.gain.gain, backend,
                                                     winner.measurement.reload_s, restart):
            return {"status": "not_worth_switching"}
        self.state = "promoting"
        # NOTE: the per-shape canary needs the worker's own live records; a service fed
        # only trace files (standalone) judges by the worker's /metrics instead
        records = self if self._num_observed else None
        try:
            outcome = await promoter.promote(url, backend, winner.config, previous,
                                             winner.measurement.value, records)
        except (PromotionError, OptimizerError, aiohttp.ClientError, OSError) as e:
            self.last_error = f"promotion: {e}"
            return {"status": "promotion_failed", "error": str(e)[:300]}
        if outcome.status == "promoted":
            self.live_config = winner.config
        self.worker_url = outcome.worker_url or url
        self.timings["last_switch_s"] = outcome.switch_s
        details = {"switch_s": outcome.switch_s, "tpot_before_s": outcome.tpot_before_s,
                   "tpot_after_s": outcome.tpot_after_s, "reason": outcome.reason,
                   "canary": outcome.canary}
        self.last_canary = {"campaign": cid, "status": outcome.status, "reason": outcome.reason,
                            **(outcome.canary or {})}
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, board.add_promotion, cid, url, winner.key,
                                   outcome.status, winner.gain.gain, details)
        await loop.run_in_executor(None, board.note, cid, "canary", outcome.status,
                                   self.last_canary)
        return {"status": outcome.status, **details}

    def _record_history(self, campaign: Campaign, winner: Confirmed | None,
                        outcome: dict[str, Any], runners: list[AgentRunner],
                        seconds: float) -> None:
        entry = {"campaign": campaign.id, "seconds": round(seconds, 1), **outcome,
                 "objective": campaign.measurer.objective,
                 "concurrency": campaign.measurer.tiers[campaign.fast].concurrency,
                 "fast_experiments": campaign.num_fast, "pruning": campaign.pruner.snapshot(),
                 "agents": {r.agent.name: r.num_posted for r in runners},
                 "rejected_proposals": {r.agent.name: r.num_rejected for r in runners
                                        if r.num_rejected}}
        logger.info("campaign finished: %s", entry)
        self.history.append(entry)
        del self.history[:-20]


def _campaign_id(profile: TrafficProfile) -> str:
    digest = hashlib.sha1(json.dumps(_profile_summary(profile), sort_keys=True).encode())
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{digest.hexdigest()[:8]}"


def _profile_summary(p: TrafficProfile | None) -> dict[str, Any] | None:
    if p is None:
        return None
    return {"requests": p.num_requests, "rate_rps": round(p.arrival_rate_rps, 3),
            "domain_mix": {d: round(v, 3) for d, v in p.domain_mix.items()},
            "prompt_tokens_mean": round(p.prompt_tokens.mean, 1),
            "output_tokens_mean": round(p.output_tokens.mean, 1),
            "acceptance": {d: round(v, 3) for d, v in p.acceptance_by_domain.items()}}
