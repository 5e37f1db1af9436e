"""Promotion: apply a verified winner to a live worker, watch it, roll back if it regresses.

Engine workers take the winner by hot reload (``POST /admin/reload``: the
engine swaps configs between steps, requests in flight continue), unless the
winner changes a restart-only field (``polyinfer.config.RESTART_FIELDS``, e.g.
``data_parallel_size``). vLLM workers, and engine workers in that case, need a
blue-green replacement (a new server, then drain the old), which costs a cold
start: ``switch_cost_s`` prices that, and a candidate is
only worth switching to when the time its gain saves over the payback
horizon exceeds the switch cost. The optimizer defines the two interfaces it
acts through, :class:`ConfigSink` and :class:`WorkerSwitch`, and the host (the
proxy, ``proxy.optimize``) hands it implementations; until a switch is handed
in, vLLM promotions are refused with a PromotionError that says so.

After a switch the live traffic judges it. Given the worker's trace records (a
:class:`LiveRecords`: the proxy's requests routed to it), the judge is the
per-shape canary of :mod:`optimizer.canary`: each shape's TTFT, TPOT and errors
on the new config against that shape's on the incumbent, rolled back by itself
on a regression beyond noise, with the shape, metric and numbers as the
reason. A host without trace records (a bare engine worker) gets the
whole-worker judge: mean TPOT and TTFT scraped from the worker's vLLM-style
/metrics in a window before and after.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from optimizer.canary import CanaryConfig, ShapeCanary, Verdict, baseline
from optimizer.errors import PromotionError
from optimizer.measure import EngineClient
from polyinfer.config import RESTART_FIELDS, CompiledConfig, needs_restart
from polyinfer.trace import TraceRecord

logger = logging.getLogger(__name__)

TPOT_METRIC = "vllm:time_per_output_token_seconds"
TTFT_METRIC = "vllm:time_to_first_token_seconds"
E2E_METRIC = "vllm:e2e_request_latency_seconds"


@dataclass(frozen=True)
class PromotionConfig:
    watch_s: float = 10.0  # window after a switch before judging it, seconds
    min_requests: int = 3  # finished requests needed in a window to judge
    max_tpot_regression: float = 0.15  # roll back above +15% live TPOT
    max_ttft_regression: float = 0.5  # roll back above +50% live TTFT
    # the watch after a switch is extended (watch_s at a time) until min_requests finished,
    # up to this long; a switch never judged is reported as such
    max_watch_s: float = 120.0
    hot_reload_cost_s: float = 1.0  # what a hot reload costs (measured reload_s replaces it)
    restart_cost_s: float = 120.0  # what a cold restart / blue-green switch costs
    payback_horizon_s: float = 1800.0  # how long a promoted config is expected to live
    canary: CanaryConfig = field(default_factory=CanaryConfig)  # the per-shape judge

    def __post_init__(self) -> None:
        if self.watch_s <= 0 or self.min_requests < 1 or self.max_tpot_regression <= 0:
            raise PromotionError("watch_s, min_requests and max_tpot_regression must be > 0")

    def switch_cost_s(self, backend: str, measured_reload_s: float | None = None,
                      restart: bool = False) -> float:
        if backend == "engine" and not restart:
            return measured_reload_s if measured_reload_s is not None else self.hot_reload_cost_s
        return self.restart_cost_s

    def worth_switching(self, gain: float, backend: str,
                        measured_reload_s: float | None = None, restart: bool = False) -> bool:
        """Time the gain saves over the horizon (as served work) beats the switch cost."""
        saved_s = self.payback_horizon_s * gain / (1.0 + gain) if gain > 0 else 0.0
        return saved_s > self.switch_cost_s(backend, measured_reload_s, restart)


class ConfigSink(Protocol):
    """Who else must learn about a promotion (the router's worker profiles)."""

    def config_promoted(self, worker_url: str, config: CompiledConfig,
                        tokens_per_s: float) -> None:
        ...


class LiveRecords(Protocol):
    """The worker's recently finished requests, as the proxy recorded them (any order)."""

    def live_records(self) -> list[TraceRecord]:
        ...


class WorkerSwitch(Protocol):
    """Replaces a worker with one running ``config`` (blue-green); says how long it took.

    Used for vLLM workers, and for engine workers whose new config changes a
    restart-only field.
    """

    async def replace(self, worker_url: str, config: CompiledConfig) -> Switched:
        ...


@dataclass(frozen=True)
class LiveSample:
    t: float  # monotonic seconds
    tpot_sum_s: float
    tpot_count: float
    e2e_count: float
    ttft_sum_s: float = 0.0
    ttft_count: float = 0.0


async def scrape(session: aiohttp.ClientSession, worker_url: str) -> LiveSample:
    async with session.get(worker_url.rstrip("/") + "/metrics") as resp:
        if resp.status != 200:
            raise PromotionError(f"{worker_url}/metrics: HTTP {resp.status}")
        text = await resp.text()
    sums = {TPOT_METRIC + "_sum": 0.0, TPOT_METRIC + "_count": 0.0, E2E_METRIC + "_count": 0.0,
            TTFT_METRIC + "_sum": 0.0, TTFT_METRIC + "_count": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in sums:
                sums[s.name] += float(s.value)
    return LiveSample(time.monotonic(), sums[TPOT_METRIC + "_sum"],
                      sums[TPOT_METRIC + "_count"], sums[E2E_METRIC + "_count"],
                      sums[TTFT_METRIC + "_sum"], sums[TTFT_METRIC + "_count"])


def window_tpot(a: LiveSample, b: LiveSample) -> tuple[float | None, int]:
    """Mean TPOT (seconds) and finished requests between two scrapes."""
    count = b.tpot_count - a.tpot_count
    finished = int(b.e2e_count - a.e2e_count)
    if count <= 0:
        return None, finished
    return (b.tpot_sum_s - a.tpot_sum_s) / count, finished


def window_ttft(a: LiveSample, b: LiveSample) -> float | None:
    """Mean TTFT (seconds) between two scrapes."""
    count = b.ttft_count - a.ttft_count
    return (b.ttft_sum_s - a.ttft_sum_s) / count if count > 0 else None


@dataclass(frozen=True)
class Switched:
    """A config switch: seconds it took, and the URL that serves the worker afterwards."""

    seconds: float
    worker_url: str


@dataclass(frozen=True)
class PromotionOutcome:
    status: str  # "promoted" | "rolled_back" | "refused"
    switch_s: float  # reload (or replacement) seconds
    tpot_before_s: float | None
    tpot_after_s: float | None
    reason: str = ""
    worker_url: str = ""  # the live worker's URL afterwards (a blue-green switch moves it)
    canary: dict[str, Any] | None = None  # the per-shape comparison, when records judged it


class Promoter:
    def __init__(self, session: aiohttp.ClientSession, config: PromotionConfig,
                 sinks: tuple[ConfigSink, ...] = (), blue_green: WorkerSwitch | None = None) -> None:
        self.session = session
        self.config = config
        self.sinks = sinks
        self.blue_green = blue_green

    async def switch(self, worker_url: str, backend: str, cfg: CompiledConfig,
                     restart: bool = False) -> Switched:
        if backend == "engine" and not restart:
            seconds = await EngineClient(worker_url, self.session).reload(
                cfg.with_engine(measure_num_layers=None))
            return Switched(seconds, worker_url)
        if self.blue_green is None:
            what = "an engine worker changing a restart-only field" if restart else \
                f"a {backend} worker"
            raise PromotionError(f"{worker_url}: {what} needs a blue-green replacement, "
                                 "and none is configured")
        return await self.blue_green.replace(worker_url, cfg)

    async def promote(self, worker_url: str, backend: str, winner: CompiledConfig,
                      previous: CompiledConfig, tokens_per_s: float,
                      records: LiveRecords | None = None) -> PromotionOutcome:
        """Switch, watch, roll back on regression; sinks hear only of kept configs.

        With ``records`` the per-shape canary judges; without, the whole worker's /metrics.
        """
        restart = backend == "engine" and needs_restart(previous, winner)
        if restart and self.blue_green is None:
            raise PromotionError(f"{worker_url}: the winner changes a restart-only field of "
                                 f"{RESTART_FIELDS}; that needs a blue-green replacement, and "
                                 "none is configured")
        if records is not None:
            return await self._promote_by_shape(worker_url, backend, winner, previous,
                                                tokens_per_s, restart, records)
        before_a = await scrape(self.session, worker_url)
        await asyncio.sleep(self.config.watch_s)
        before_b = await scrape(self.session, worker_url)
        switched = await self.switch(worker_url, backend, winner, restart)
        live = switched.worker_url  # NOTE: a blue-green switch serves from a new server
        after_a = await scrape(self.session, live)
        after_b = await self._watch(live, after_a)
        tpot_before, n_before = window_tpot(before_a, before_b)
        tpot_after, n_after = window_tpot(after_a, after_b)
        why = self._regression(before_a, before_b, after_a, after_b)
        if why:
            back = await self.switch(live, backend, previous, restart)
            return PromotionOutcome("rolled_back", switched.seconds, tpot_before, tpot_after,
                                    why, back.worker_url)
        for sink in self.sinks:
            sink.config_promoted(live, winner, tokens_per_s)
        judged = n_before >= self.config.min_requests and n_after >= self.config.min_requests
        return PromotionOutcome("promoted", switched.seconds, tpot_before, tpot_after,
                                "" if judged else "too little live traffic to judge", live)

    async def _promote_by_shape(self, worker_url: str, backend: str, winner: CompiledConfig,
                                previous: CompiledConfig, tokens_per_s: float, restart: bool,
                                records: LiveRecords) -> PromotionOutcome:
        cfg = self.config
        before = baseline(records.live_records(), time.time(), cfg.canary)
        looks = max(1, math.ceil(cfg.max_watch_s / cfg.watch_s))
        canary = ShapeCanary(cfg.canary, before, {"ttft_s": cfg.max_ttft_regression,
                                                  "tpot_s": cfg.max_tpot_regression}, looks)
        switched = await self.switch(worker_url, backend, winner, restart)
        live = switched.worker_url  # NOTE: a blue-green switch serves from a new server
        verdict = await self._canary_watch(canary, records, time.time())
        before_tpot, after_tpot = _tpot_means(verdict)
        if verdict.regressed is not None:
            why = verdict.regressed.reason()
            logger.warning("canary: rolling back %s: %s", live, why)
            back = await self.switch(live, backend, previous, restart)
            return PromotionOutcome("rolled_back", switched.seconds, before_tpot, after_tpot,
                                    why, back.worker_url, _canary_doc(verdict))
        for sink in self.sinks:
            sink.config_promoted(live, winner, tokens_per_s)
        reason = "" if verdict.num_judged else "too little live traffic to judge any shape"
        return PromotionOutcome("promoted", switched.seconds, before_tpot, after_tpot, reason,
                                live, _canary_doc(verdict))

    async def _canary_watch(self, canary: ShapeCanary, records: LiveRecords,
                            switched_unix: float) -> Verdict:
        """Judge every watch_s until a shape regresses, every shape has its samples, or
        max_watch_s; only requests that arrived after the switch count for the new config."""
        deadline = time.monotonic() + self.config.max_watch_s
        while True:
            await asyncio.sleep(self.config.watch_s)
            after = [r for r in records.live_records() if r.ts >= switched_unix]
            verdict = canary.judge(after)
            if (verdict.regressed is not None or canary.ready(after)
                    or time.monotonic() >= deadline):
                return verdict

    async def _watch(self, live: str, start: LiveSample) -> LiveSample:
        """Scrapes every watch_s until min_requests finished after the switch (max_watch_s)."""
        deadline = time.monotonic() + self.config.max_watch_s
        while True:
            await asyncio.sleep(self.config.watch_s)
            now = await scrape(self.session, live)
            finished = now.e2e_count - start.e2e_count
            if finished >= self.config.min_requests or time.monotonic() >= deadline:
                return now

    def _regression(self, before_a: LiveSample, before_b: LiveSample, after_a: LiveSample,
                    after_b: LiveSample) -> str:
        """Why the live windows say the switch regressed ("" = it did not, or cannot tell)."""
        tpot_before, n_before = window_tpot(before_a, before_b)
        tpot_after, n_after = window_tpot(after_a, after_b)
        if self._regressed(tpot_before, n_before, tpot_after, n_after):
            return f"live TPOT {tpot_after:.4f}s vs {tpot_before:.4f}s before"
        ttft_before, ttft_after = window_ttft(before_a, before_b), window_ttft(after_a, after_b)
        enough = min(n_before, n_after) >= self.config.min_requests
        if (enough and ttft_before and ttft_after
                and ttft_after > ttft_before * (1.0 + self.config.max_ttft_regression)):
            return f"live TTFT {ttft_after:.4f}s vs {ttft_before:.4f}s before"
        return ""

    def _regressed(self, before: float | None, n_before: int, after: float | None,
                   n_after: int) -> bool:
        if before is None or after is None:
            return False
        if n_before < self.config.min_requests or n_after < self.config.min_requests:
            return False
        return after > before * (1.0 + self.config.max_tpot_regression)


def _tpot_means(verdict: Verdict) -> tuple[float | None, float | None]:
    """The TPOT of the shape judged on the most requests (for the outcome's summary)."""
    rows = [r["tpot_s"] for r in verdict.shapes.values() if "tpot_s" in r]
    if not rows:
        return None, None
    top = max(rows, key=lambda r: r["num_after"] + r["num_before"])
    return top["before"], top["after"]


def _canary_doc(verdict: Verdict) -> dict[str, Any]:
    return {"shapes": verdict.shapes, "judged": verdict.num_judged,
            "alpha_per_test": verdict.alpha_per_test,
            "regressed": verdict.regressed.to_dict() if verdict.regressed else None}
