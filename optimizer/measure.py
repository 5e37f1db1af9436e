"""Measurement on a persistent engine: hot-reload a candidate, replay the sample, score it.

The engine is started once (model loaded once); every candidate is swapped
in with ``POST /admin/reload`` and scored by a replay of the sample through
loadgen's runner, greedy, streaming: closed loop (all requests due at t=0,
``concurrency`` in flight) or, with ``Tier.open_loop``, open loop at the
sample's own arrival offsets (the traffic's pattern; ``concurrency`` is then
only a cap). Requests that fail count zero tokens and are reported.

Objectives (higher is better), see :class:`Measurer`:
  - ``wall``: output tokens per wall second of the replay (throughput);
  - ``cpu``: output tokens per engine CPU second (throughput, robust to
    other tenants on a shared box);
  - ``request``: mean over requests of each request's output tokens per
    second, from arrival to last byte (open loop: queueing included; closed
    loop: from send, the slot wait being the replay's own): the decode speed a
    client sees at the replayed load. At low load this is what a config
    changes (speculation trades CPU for latency), while throughput is capped
    by the offered load.

Restart-only knobs (``polyinfer.config.RESTART_FIELDS``, e.g. ``data_parallel_size``)
cannot be hot-reloaded: with an :class:`optimizer.pool.EnginePool` the measurer
runs such a candidate on an engine started with it, and the cold start it
paid is part of the experiment's seconds (``Measurement.restart_s``); without
a pool the engine's reload refuses such a candidate (ReloadRejected) instead of
it being measured as something it is not.

Two tiers: the fast tier reloads with ``engine.measure_num_layers`` set (the
first N layers only: wrong outputs, step times that track the full model)
and a short sample; the slow tier runs the full model on a longer sample,
repeated to measure noise.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from loadgen.client import StreamingClient
from loadgen.config import ClientConfig
from loadgen.request import PreparedRequest
from loadgen.runner import Runner
from optimizer.errors import EngineUnavailable, MeasurementError, ReloadRejected
from optimizer.sample import ReplayRequest
from polyinfer.config import CompiledConfig

if TYPE_CHECKING:
    from optimizer.pool import EnginePool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tier:
    name: str  # "fast" | "slow"
    num_layers: int | None  # engine.measure_num_layers; None = the full model
    num_requests: int  # replay sample size
    repeats: int = 1  # replays per experiment (noise estimate when > 1)
    concurrency: int = 8  # closed-loop requests in flight
    warmup_requests: int = 2  # sent after a reload, not measured
    open_loop: bool = False  # True: send at the sample's arrival offsets (concurrency = a cap)

    def __post_init__(self) -> None:
        if self.num_layers is not None and self.num_layers < 1:
            raise MeasurementError(f"tier {self.name}: num_layers must be >= 1 or None")
        if self.num_requests < 1 or self.repeats < 1 or self.concurrency < 1:
            raise MeasurementError(f"tier {self.name}: num_requests, repeats and concurrency "
                                   "must be >= 1")

    def apply(self, cfg: CompiledConfig) -> CompiledConfig:
        return cfg.with_engine(measure_num_layers=self.num_layers)


@dataclass(frozen=True)
class ReplayStats:
    tokens_per_s: float  # output tokens / wall seconds of the replay
    num_tokens: int
    wall_s: float
    num_errors: int
    ttft_p50_s: float | None
    tpot_p50_s: float | None
    errors: tuple[str, ...] = ()  # the first few error messages
    # mean of per-request output tokens / seconds from arrival to last byte (open loop: a
    # wait for a concurrency slot counts; closed loop: that wait is the replay's, not the
    # traffic's, so only send -> last byte counts)
    request_tokens_per_s: float = 0.0
    in_flight: float = 0.0  # mean requests in flight (summed latency / wall, Little's law)


@dataclass(frozen=True)
class Measurement:
    tier: str
    value: float  # mean tokens/s over repeats
    values: tuple[float, ...]  # one per repeat
    seconds: float  # experiment wall time, reload included
    reload_s: float  # what the engine reported for the hot reload
    num_errors: int
    details: dict[str, Any] = field(default_factory=dict)
    restart_s: float = 0.0  # cold start paid for a restart-only knob (part of seconds)

    @property
    def stdev(self) -> float:
        return statistics.stdev(self.values) if len(self.values) > 1 else 0.0


class EngineClient:
    """The engine's admin + OpenAI API, on one aiohttp session (base URL set on the session)."""

    def __init__(self, base_url: str, session: aiohttp.ClientSession, model: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        self.session = session
        self.model = model

    def _url(self, path: str) -> str:
        return self.base_url + path

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                async with self.session.get(self._url("/v1/models")) as resp:
                    if resp.status == 200:
                        body = await resp.json()
                        if not self.model and body.get("data"):
                            self.model = body["data"][0]["id"]
                        return
            except (aiohttp.ClientError, OSError) as e:
                last = e
            await asyncio.sleep(0.25)
        raise EngineUnavailable(f"{self.base_url} not ready after {timeout_s:.0f} s ({last})")

    async def config(self) -> CompiledConfig:
        async with self.session.get(self._url("/admin/config")) as resp:
            if resp.status != 200:
                raise EngineUnavailable(f"GET /admin/config: HTTP {resp.status}")
            body = await resp.json()
        return CompiledConfig.from_dict(body.get("config", body))

    async def reload(self, cfg: CompiledConfig) -> float:
        """Apply ``cfg`` without reloading weights; returns the seconds the engine reports."""
        t0 = time.perf_counter()
        try:
            async with self.session.post(self._url("/admin/reload"), json=cfg.to_dict()) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, OSError) as e:
            raise EngineUnavailable(f"{self.base_url}: reload failed ({e})") from e
        wall = time.perf_counter() - t0
        if 400 <= resp.status < 500:
            raise ReloadRejected(f"reload rejected (HTTP {resp.status}): {text[:300]}")
        if resp.status != 200:
            raise MeasurementError(f"reload failed (HTTP {resp.status}): {text[:300]}")
        return _reported_seconds(text, wall)

    async def complete(self, prompt: str, max_tokens: int) -> str:
        """Greedy completion text (verification)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "stream": False}
        async with self.session.post(self._url("/v1/completions"), json=body) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise MeasurementError(f"completion failed (HTTP {resp.status}): {text[:300]}")
        return str(orjson.loads(text)["choices"][0]["text"])

    async def generate(self, body: dict[str, Any]) -> str:
        """The text of one non-streamed completion with ``body`` as sent (verification)."""
        async with self.session.post(self._url("/v1/completions"), json=body) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise MeasurementError(f"completion failed (HTTP {resp.status}): {text[:300]}")
        return str(orjson.loads(text)["choices"][0]["text"])

    async def counter(self, name: str) -> float:
        """A counter of the engine's /metrics, summed over its labels (0 when absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        async with self.session.get(self._url("/metrics")) as resp:
            if resp.status != 200:
                raise EngineUnavailable(f"GET /metrics: HTTP {resp.status}")
            text = await resp.text()
        return sum(float(s.value) for family in text_string_to_metric_families(text)
                   for s in family.samples if s.name == name)

    async def replay(self, requests: Sequence[ReplayRequest], concurrency: int,
                     open_loop: bool = False) -> ReplayStats:
        client_cfg = ClientConfig(target=self.base_url, endpoint="completions", model=self.model,
                                  stream=True, max_concurrency=concurrency)
        t0 = requests[0].offset_s if requests and open_loop else 0.0
        prepared = [self._prepared(i, r, r.offset_s - t0 if open_loop else 0.0)
                    for i, r in enumerate(requests)]
        # NOTE: loadgen's client posts raw bytes; the engine wants them declared as JSON
        # (loadgen's own sessions carry the header, a caller's session need not).
        async with aiohttp.ClientSession(headers={"Content-Type": "application/json"},
                                         timeout=self.session.timeout) as session:
            runner = Runner(StreamingClient(client_cfg, session), max_concurrency=concurrency,
                            quiet=True)
            run = await runner.run(prepared)
        return _stats(run.results, run.duration_s, open_loop)

    def _prepared(self, index: int, r: ReplayRequest, arrival_s: float) -> PreparedRequest:
        body = {"model": self.model, "prompt": r.prompt, "max_tokens": r.max_tokens,
                "temperature": 0.0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        # NOTE: closed loop (arrival_s 0): everything is due at t=0 and the runner's
        # semaphore keeps `concurrency` in flight, so the engine is never idle for lack of work.
        return PreparedRequest(index=index, line=index + 1, arrival_s=arrival_s,
                               path=self._url("/v1/completions"), body=orjson.dumps(body),
                               prompt_tokens=r.prompt_tokens, max_tokens=r.max_tokens,
                               domain=r.domain)


def _reported_seconds(text: str, wall_s: float) -> float:
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError:
        return wall_s
    if isinstance(body, dict):
        for key in ("reload_s", "seconds", "elapsed_s", "took_s"):
            if isinstance(body.get(key), (int, float)):
                return float(body[key])
    return wall_s


def _stats(results: Sequence[Any], wall_s: float, open_loop: bool = False) -> ReplayStats:
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens or 0 for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    errors = tuple(str(r.error) for r in results if not r.ok)[:3]
    # NOTE: a failed request is a request served at 0 tokens/s, not one left out.
    queued = [r.queue_s if open_loop else 0.0 for r in results]
    per_request = [(r.completion_tokens or 0) / (q + r.e2e_s) if r.ok and r.e2e_s else 0.0
                   for r, q in zip(results, queued, strict=True)]
    latency = sum(q + (r.e2e_s or 0.0) for r, q in zip(results, queued, strict=True))
    return ReplayStats(tokens / wall_s if wall_s > 0 else 0.0, tokens, wall_s,
                       len(results) - len(ok), statistics.median(ttft) if ttft else None,
                       statistics.median(tpot) if tpot else None, errors,
                       statistics.fmean(per_request) if per_request else 0.0,
                       latency / wall_s if wall_s > 0 else 0.0)


OBJECTIVES = ("wall", "cpu", "request")


class Measurer:
    """Scores configs on one persistent engine; one experiment at a time.

    ``objective="wall"`` scores output tokens per wall second (what a client
    sees on a dedicated machine). ``"cpu"`` scores output tokens per CPU
    second of the engine process: NOTE: on a box shared with other tenants,
    wall time swings with their load while the engine's own CPU time barely
    does, so it ranks configs far more repeatably; it needs the engine's PID
    (a measurement engine this process started). Both are throughput
    objectives: right when the traffic keeps the engine busy. ``"request"``
    scores the mean per-request output tokens/s at the replayed load: right
    when the traffic leaves the engine mostly idle (low concurrency), where
    throughput only echoes the offered load.
    """

    def __init__(self, engine: EngineClient, samples: dict[str, list[ReplayRequest]],
                 tiers: Sequence[Tier], cpu_seconds: Callable[[], float] | None = None,
                 objective: str = "wall", pool: EnginePool | None = None) -> None:
        missing = [t.name for t in tiers if not samples.get(t.name)]
        if missing:
            raise MeasurementError(f"no replay sample for tier(s) {missing}")
        if objective not in OBJECTIVES or (objective == "cpu" and cpu_seconds is None
                                           and pool is None):
            raise MeasurementError(f"objective: expected one of {OBJECTIVES} ('cpu' needs the "
                                   f"engine's CPU clock or a pool of engines with one), got "
                                   f"{objective!r}")
        self.engine = engine
        self.pool = pool  # engines for candidates a hot reload cannot reach
        self.samples = samples
        self.cpu_seconds = cpu_seconds
        self.objective = objective
        self.tiers = {t.name: t for t in tiers}
        self._lock = asyncio.Lock()  # NOTE: two replays at once would measure each other
        self.num_experiments: dict[str, int] = {t.name: 0 for t in tiers}
        self.seconds: dict[str, float] = {t.name: 0.0 for t in tiers}

    def set_samples(self, samples: dict[str, list[ReplayRequest]]) -> None:
        self.samples = samples

    async def measure(self, cfg: CompiledConfig, tier_name: str,
                      repeats: int | None = None) -> Measurement:
        tier = self.tiers[tier_name]
        async with self._lock:
            t0 = time.perf_counter()
            engine, clock, restart_s = await self._engine_for(cfg)
            reload_s = await engine.reload(tier.apply(cfg))
            sample = self.samples[tier_name][: tier.num_requests]
            if tier.warmup_requests:
                await engine.replay(sample[: tier.warmup_requests], tier.concurrency)
            runs, cpu = [], []
            for _ in range(repeats or tier.repeats):
                cpu0 = clock() if clock else 0.0
                runs.append(await engine.replay(sample, tier.concurrency, tier.open_loop))
                cpu.append(clock() - cpu0 if clock else 0.0)
            seconds = time.perf_counter() - t0
        self.num_experiments[tier_name] += 1
        self.seconds[tier_name] += seconds
        wall = tuple(r.tokens_per_s for r in runs)
        if self.objective == "cpu" and clock is None:
            raise MeasurementError("objective 'cpu': the engine that measured this candidate "
                                   "has no CPU clock")
        per_cpu = tuple(r.num_tokens / c if c > 0 else 0.0 for r, c in zip(runs, cpu, strict=True))
        per_request = tuple(r.request_tokens_per_s for r in runs)
        values = {"cpu": per_cpu, "wall": wall, "request": per_request}[self.objective]
        errors = sum(r.num_errors for r in runs)
        if errors:
            logger.warning("%s tier: %d failed requests (%s)", tier_name, errors,
                           runs[0].errors or runs[-1].errors)
        return Measurement(tier_name, statistics.fmean(values), values, seconds, reload_s, errors,
                           {"ttft_p50_s": runs[-1].ttft_p50_s, "tpot_p50_s": runs[-1].tpot_p50_s,
                            "num_tokens": runs[-1].num_tokens, "wall_s": runs[-1].wall_s,
                            "wall_tokens_per_s": statistics.fmean(wall),
                            "request_tokens_per_s": statistics.fmean(per_request),
                            "in_flight": statistics.fmean(r.in_flight for r in runs),
                            "cpu_tokens_per_s": statistics.fmean(per_cpu) if clock
                            else None}, restart_s)

    async def _engine_for(self, cfg: CompiledConfig
                          ) -> tuple[EngineClient, Callable[[], float] | None, float]:
        """The engine to measure ``cfg`` on, its CPU clock, and the cold start paid for it."""
        if self.pool is not None:
            handle, start_s = await self.pool.get(cfg)
            clock = handle.process.cpu_seconds if handle.process is not None else None
            return handle.client, clock, start_s
        # NOTE: without a pool a restart-only change goes to the engine's reload, which
        # refuses it (HTTP 400 -> ReloadRejected) before touching what it serves.
        return self.engine, self.cpu_seconds, 0.0

    def experiments_per_hour(self) -> dict[str, float]:
        return {t: 3600.0 * n / self.seconds[t] for t, n in self.num_experiments.items()
                if n and self.seconds[t] > 0}
