"""The optimizer on replayed traffic: search efficiency, gain, reload vs restart, traffic shift.

Two traffic shapes are built from the Azure LLM inference traces
(data/traces) as proxy trace records: consecutive rows, their
prompt/output lengths, and their real inter-arrival gaps (burstiness kept)
scaled to a mean rate this CPU box can serve:

  A "conv, busy":  the conversation trace, chat/qa/summarization/translation
                   domains, 4 req/s x 2.5 s recorded e2e (~10 in flight);
  B "code, quiet": the code-completion trace, domain code, 0.5 req/s x 2 s
                   recorded e2e (~1 in flight).
  (``--quiet conv`` swaps the traces: A is code at the busy load, B is
  conversation at the quiet load.)

The traces carry lengths only; each record gets real prompt text as if the
proxy recorded prompts: Spec-Bench questions of its domain (coding for code;
data/prompts), joined to the record's prompt length (capped).
``--prompts ''`` replays synthetic prompts instead (standard-library source,
which the tiny model does not continue by copying: speculation then gains
nothing, whatever the config).

What "tokens/s on the replayed traffic" means here (fixed before measuring, the
same for the default and the found config): traffic is served at its own load,
not blasted. For B (quiet, ~1 request in flight) aggregate tokens/s equals the
offered rate for any config that keeps up, so the objective is the mean
per-request output tokens/s ("request", send to last byte, queueing included)
-- the decode speed a client sees -- replayed open loop at B's arrivals. For
A (busy) it is throughput: output tokens per wall second of a closed-loop
replay at the traffic's own concurrency (capped at 8) -- the tokens/s the
machine serves. (``--a-objective cpu`` scores A in tokens per engine CPU second
instead, which is steadier on this shared box but can never pick a config that
uses a second core.) The service picks the same by itself
(OptimizerConfig.objective="auto", throughput_objective="wall": Little's-law
concurrency below 2 -> "request").

The service's space has the restart-only knob ``data_parallel_size`` (0, 2):
its candidates run on a second measurement engine (optimizer.pool), the cold
start is charged to the campaign's budget, and promoting one to a live engine
worker needs a blue-green replacement (the bare live engine here has none, so
such a winner is reported as found and measured, not promoted).

Steps (all on real engines on the bundled model, loopback HTTP):

  1. grid     every config of a small space (the knobs that matter at B's
              load: speculation method and depths, chunked-prefill budget,
              threads) measured on traffic B, full model, at B's concurrency;
              the default config is re-measured every few points as an anchor
              and values are divided by the interpolated anchor (drift);
  2. search   the three agents (cost model, GP-EI, evolution) on the measured
              grid table, budget = a quarter of the grid, 10 seeds, plus a
              random-search baseline: gap to the grid's best;
  3. service  ``OptimizerService`` with a live worker: traffic A is written to
              the trace file (campaign 1), then traffic B is appended (a shift:
              campaign 2); time from the shift to the promotion, and gains;
  4. gain     found configs vs the DEFAULT config (EngineConfig() as shipped),
              paired replays interleaved a, b, a, b (drift hits both alike),
              each on its own traffic: B open loop at its arrival pattern
              (per-request tok/s, TPOT), A closed loop at c=8 (tok/cpu-s);
  5. reload   hot-reload seconds (from every experiment) vs cold engine starts;
              experiments per hour per tier.

    python bench/optimizer_replay.py                 # ~10-15 minutes on a busy 2-core box
    python bench/optimizer_replay.py --quick         # smaller grid and samples, a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime as dt
import itertools
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp  # noqa: E402

from optimizer.abtest import paired_gain  # noqa: E402
from optimizer.agents.base import Agent, BoardView  # noqa: E402
from optimizer.agents.bayes import BayesAgent  # noqa: E402
from optimizer.agents.costagent import CostModelAgent  # noqa: E402
from optimizer.agents.evolution import EvolutionAgent  # noqa: E402
from optimizer.campaign import SearchConfig  # noqa: E402
from optimizer.costmodel import CostModel, ForwardTimeModel, HardwareConstants, Workload  # noqa: E402
from optimizer.engine_proc import EngineProcess  # noqa: E402
from optimizer.measure import EngineClient, Measurer, Tier  # noqa: E402
from optimizer.pool import EnginePool  # noqa: E402
from optimizer.profile import build_profile, read_trace_files, stratified_sample  # noqa: E402
from optimizer.promote import PromotionConfig  # noqa: E402
from optimizer.sample import DomainPromptSynthesizer, SampleConfig, build_replay  # noqa: E402
from optimizer.service import OptimizerConfig, OptimizerService  # noqa: E402
from optimizer.space import Knob, SearchSpace  # noqa: E402
from optimizer.verify import VerifyConfig  # noqa: E402
from polyinfer.config import TINY_TARGET, CompiledConfig  # noqa: E402

logger = logging.getLogger("bench.optimizer_replay")

DATA = Path(__file__).resolve().parents[1] / "data" / "traces"
PROMPTS = DATA.parent / "prompts" / "spec_bench_questions.jsonl"
# Spec-Bench categories whose prompts stand in for each domain's recorded prompt text
CATEGORIES = {"code": ("coding",), "math": ("math_reasoning", "math"), "qa": ("qa",),
              "chat": ("writing", "roleplay", "humanities", "stem", "reasoning"),
              "summarization": ("summarization",), "translation": ("translation",),
              "rag": ("rag",), "extraction": ("extraction",)}
CONV_DOMAINS = ("chat", "qa", "summarization", "translation")
TRACES = (("azure_llm_2023_code.csv", ("code",)), ("azure_llm_2023_conv.csv", CONV_DOMAINS))
SMALL_KNOBS = (
    Knob("max_num_seqs", (8, 32)),
    Knob("max_num_batched_tokens", (128, 1024)),
    Knob("spec_method", ("none", "ngram")),
    Knob("spec_max_depth", (0, 2, 4, 8)),
    Knob("spec_default_depth", (0, 2, 4, 8)),
    Knob("num_threads", (0, 2)),  # 0 = the engine's auto choice (1 thread on 2 cores)
)
# The service also searches the restart-only knob: engine-core processes (0 = the step loop
# in the HTTP process). Its candidates run on a second measurement engine (optimizer.pool);
# the grid (B, quiet, concurrency 1) leaves it out.
SERVICE_KNOBS = (*SMALL_KNOBS, Knob("data_parallel_size", (0, 2)))
# NOTE: the default config is EngineConfig() as shipped (max_num_seqs 32, 1024
# batched tokens, no speculation, auto threads); only the KV cache and the
# context are sized for the replay's capped lengths.
BASE = CompiledConfig(model=str(TINY_TARGET)).with_engine(kv_cache_tokens=16384,
                                                          max_model_len=1024)
ANCHOR_EVERY = 6  # grid points between re-measurements of the default


def azure_records(path: Path, n: int, seed: int, domains: tuple[str, ...], rate_rps: float,
                  e2e_s: float, t0: float) -> list[dict[str, Any]]:
    """``n`` consecutive rows from a random start, as proxy trace records.

    Arrival times keep the trace's own gaps, scaled so the mean rate is ``rate_rps``.
    """
    with open(path) as f:
        rows = list(csv.DictReader(f))
    rng = random.Random(seed)
    start = rng.randrange(len(rows) - n)
    window = rows[start: start + n]
    stamps = [dt.datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp() for r in window]
    span = stamps[-1] - stamps[0]
    scale = (n - 1) / rate_rps / span if span > 0 else 0.0
    out = []
    for i, row in enumerate(window):
        ts = t0 + ((stamps[i] - stamps[0]) * scale if span > 0 else i / rate_rps)
        out.append({"ts": ts, "request_id": f"{path.stem}-{start + i}",
                    "domain": rng.choice(domains), "prompt_tokens": int(row["ContextTokens"]),
                    "max_tokens": int(row["GeneratedTokens"]),
                    "completion_tokens": int(row["GeneratedTokens"]), "status": "ok",
                    "e2e_s": e2e_s, "stream": True})
    return out


def attach_prompts(records: list[dict[str, Any]], path: Path, synth: DomainPromptSynthesizer,
                   max_tokens: int, seed: int) -> None:
    """Give each record real prompt text, as a proxy with prompt recording on would store.

    The text is distinct Spec-Bench prompts of the record's domain, joined until the
    record's prompt length (capped at ``max_tokens``) and cut there. NOTE: the
    Azure traces carry lengths only, and the synthetic fallback (standard-library
    source) is text the tiny model never continues by copying, so it hides what
    n-gram speculation does on real prompts.
    """
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_cat: dict[str, list[str]] = {}
    for row in rows:
        by_cat.setdefault(row["category"], []).append(row["turns"][0])
    rng = random.Random(seed)
    for rec in records:
        pool = [t for c in CATEGORIES[rec["domain"]] for t in by_cat.get(c, [])]
        want = max(8, min(rec["prompt_tokens"], max_tokens))
        parts: list[str] = []
        for text in rng.sample(pool, len(pool)):
            parts.append(text)
            if synth.count_tokens("\n\n".join(parts)) >= want:
                break
        rec["prompt"] = synth.truncate("\n\n".join(parts), want)


def write_jsonl(path: Path, records: list[dict[str, Any]], mode: str = "w") -> None:
    with open(path, mode) as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


# ------------------------------------------------------------------ grid + tabular search


async def measure_grid(measurer: Measurer, space: SearchSpace
                       ) -> tuple[dict[str, dict[str, float]], list[float]]:
    """Every grid point once, the default re-measured every ANCHOR_EVERY points.

    NOTE: a grid pass takes minutes on a shared box whose speed drifts; each
    value is divided by the default's value interpolated at its position, so
    the table ranks configs against the default measured at about the same time.
    """
    raw: list[tuple[str, float, Any]] = []
    anchors: list[tuple[int, float]] = []
    for i, cfg in enumerate(space.grid()):
        if i % ANCHOR_EVERY == 0:
            anchors.append((i, (await measurer.measure(BASE, "fast")).value))
        m = await measurer.measure(cfg, "fast")
        raw.append((space.key(cfg), m.value, m))
        logger.info("grid %d: %s -> %.1f", i, space.key(cfg), m.value)
    anchors.append((len(raw), (await measurer.measure(BASE, "fast")).value))
    table = {}
    for i, (key, value, m) in enumerate(raw):
        ref = _interpolate(anchors, i)
        table[key] = {"value": value / ref * anchors[0][1], "raw": value,
                      "wall": m.details["wall_tokens_per_s"], "seconds": m.seconds,
                      "reload_s": m.reload_s}
    return table, [v for _, v in anchors]


def _interpolate(anchors: list[tuple[int, float]], i: int) -> float:
    for (i0, v0), (i1, v1) in itertools.pairwise(anchors):
        if i0 <= i <= i1:
            w = (i - i0) / (i1 - i0) if i1 > i0 else 0.0
            return v0 + w * (v1 - v0)
    return anchors[-1][1]


def tabular_search(space: SearchSpace, table: dict[str, float], budget: int, seed: int,
                   predict: Any, strategy: str) -> str:
    """Replay a search on the measured grid: agents take turns, every proposal is looked up."""
    if strategy == "random":
        keys = sorted(table)
        return max(random.Random(seed).sample(keys, budget), key=lambda k: table[k])
    agents: list[Agent] = [CostModelAgent(space, predict, seed=seed + 2, pool_size=300),
                           BayesAgent(space, seed=seed), EvolutionAgent(space, seed=seed + 1)]
    measured: dict[str, float] = {}
    turn = 0
    while len(measured) < budget:
        view = BoardView("tab", dict(measured), frozenset(measured))
        cands = agents[turn % len(agents)].propose(view, 1)
        turn += 1
        if cands:
            key = space.key(cands[0].config)
            measured[key] = table.get(key, 0.0)
        if turn > 10 * budget:
            break
    return max(measured, key=lambda k: measured[k])


# ------------------------------------------------------------------ paired gain


METRICS = {"request": "request_tokens_per_s", "cpu": "cpu_tokens_per_s",
           "wall": "wall_tokens_per_s"}


async def paired(measurer: Measurer, a: CompiledConfig, b: CompiledConfig, tier: str,
                 pairs: int, objective: str) -> dict[str, Any]:
    """b vs a, interleaved a, b, a, b...: the objective's gain (with noise) and the other ratios."""
    runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    for _ in range(pairs):
        for name, cfg in (("a", a), ("b", b)):
            runs[name].append((await measurer.measure(cfg, tier, repeats=1)).details)

    def series(name: str, key: str) -> list[float]:
        return [float(d[key] or 0.0) for d in runs[name]]

    main = METRICS[objective]
    g = paired_gain(series("b", main), series("a", main), min_gain=0.0)
    out: dict[str, Any] = {"objective": objective, "ratio": 1 + g.gain, "noise": g.noise,
                           "significant": g.significant,
                           "a": statistics.fmean(series("a", main)),
                           "b": statistics.fmean(series("b", main)),
                           "pair_ratios": [b / a if a > 0 else 0.0 for a, b in
                                           zip(series("a", main), series("b", main), strict=True)]}
    for name, key in METRICS.items():
        out[f"{name}_ratio"] = statistics.fmean(series("b", key)) / max(
            1e-9, statistics.fmean(series("a", key)))
    tpot_a, tpot_b = series("a", "tpot_p50_s"), series("b", "tpot_p50_s")
    out["tpot_p50_ratio"] = statistics.fmean(tpot_b) / max(1e-9, statistics.fmean(tpot_a))
    # Little's law on the replay: mean requests in flight = summed latency / wall
    out["in_flight_a"] = statistics.fmean(d["in_flight"] for d in runs["a"])
    return out


# ------------------------------------------------------------------ the service run


async def run_service(args: argparse.Namespace, work: Path, recs_a: list[dict[str, Any]],
                      recs_b: list[dict[str, Any]], live_url: str) -> dict[str, Any]:
    trace = work / "live-trace.jsonl"
    trace.write_text("")
    cfg = OptimizerConfig(
        base=BASE, traces=(str(trace),), board_path=str(work / "board.sqlite"),
        worker_url=live_url, knobs=SERVICE_KNOBS, throughput_objective=args.a_objective,
        fast=Tier("fast", args.fast_layers or None, args.fast_requests, concurrency=8,
                  warmup_requests=1),
        slow=Tier("slow", None, args.slow_requests, repeats=args.pairs, concurrency=8),
        sample=SampleConfig(args.max_prompt_tokens, args.max_output_tokens),
        search=SearchConfig(fast_budget=args.budget, finalists=2, idle_timeout_s=60),
        promotion=PromotionConfig(watch_s=args.watch_s),
        verify=VerifyConfig(max_batch=8, max_tokens=(8, 16)),
        min_records=len(recs_a) // 2, window_records=len(recs_b), refresh_s=1.0, seed=args.seed)
    service = OptimizerService(cfg)
    task = asyncio.create_task(service.run())
    stop = asyncio.Event()
    load = asyncio.create_task(live_load(live_url, stop))
    try:
        write_jsonl(trace, recs_a)
        t_a = time.monotonic()
        await _wait_history(service, task, 1, args.campaign_timeout_s)
        first_s = time.monotonic() - t_a
        write_jsonl(trace, recs_b, mode="a")
        t_shift = time.monotonic()
        await _wait_history(service, task, 2, args.campaign_timeout_s)
        shift_s = time.monotonic() - t_shift
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    ok, failed = await load
    snap = service.snapshot()
    return {"snapshot": snap, "first_campaign_s": first_s, "shift_to_done_s": shift_s,
            "live_config": service.live_config, "live_ok": ok, "live_failed": failed}


async def live_load(url: str, stop: asyncio.Event, concurrency: int = 2) -> tuple[int, int]:
    """Light traffic on the live worker while it is promoted to: (finished, failed) requests.

    It gives the rollback watch live TPOT to judge and shows whether a hot
    reload drops requests.
    """
    counts = [0, 0]
    prompt = "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n"

    async def one_client(session: aiohttp.ClientSession) -> None:
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0.0, "stream": True,
                "ignore_eos": True}
        while not stop.is_set():
            try:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    await resp.read()
                    counts[resp.status != 200] += 1
            except (aiohttp.ClientError, OSError):
                counts[1] += 1
            await asyncio.sleep(0.2)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one_client(session) for _ in range(concurrency)))
    return counts[0], counts[1]


async def _wait_history(service: OptimizerService, task: asyncio.Task[None], n: int,
                        timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while len(service.history) < n:
        if task.done():
            task.result()
            raise RuntimeError("optimizer service stopped early")
        if time.monotonic() > deadline:
            raise TimeoutError(f"campaign {n} did not finish in {timeout_s} s")
        await asyncio.sleep(0.5)


async def _grid_step(args: argparse.Namespace, out: dict[str, Any], grid_engine: EngineProcess,
                     samples: dict[str, list[Any]], tiers: list[Tier], space: SearchSpace) -> None:
    out["cold_start_s"].append(await grid_engine.start())
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        engine = EngineClient(grid_engine.url, session)
        await engine.wait_ready()
        measurer = Measurer(engine, {**samples, "fast": samples["fast_b"]},
                            [*tiers, Tier("fast", args.fast_layers or None, args.fast_requests,
                                          concurrency=1, warmup_requests=1)],
                            grid_engine.cpu_seconds, "request")
        t0 = time.perf_counter()
        out["grid"], anchors = await measure_grid(measurer, space)
        out["grid_s"] = time.perf_counter() - t0
        out["grid_anchors"] = anchors
        out["fast_tier_noise"] = statistics.stdev(anchors) / statistics.fmean(anchors)


# ------------------------------------------------------------------ main


async def main(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-optimizer-"))
    busy, quiet = TRACES[args.quiet == "code"], TRACES[args.quiet == "conv"]
    recs_a = azure_records(DATA / busy[0], args.records, args.seed, busy[1],
                           rate_rps=4.0, e2e_s=2.5, t0=1.7e9)
    recs_b = azure_records(DATA / quiet[0], args.records, args.seed + 1,
                           quiet[1], rate_rps=0.5, e2e_s=2.0, t0=1.7e9 + 3600)
    synth = DomainPromptSynthesizer(TINY_TARGET / "tokenizer.json", seed=args.seed)
    if args.prompts:
        for i, recs in enumerate((recs_a, recs_b)):
            attach_prompts(recs, Path(args.prompts), synth, args.max_prompt_tokens, args.seed + i)
    write_jsonl(work / "a.jsonl", recs_a)
    write_jsonl(work / "b.jsonl", recs_b)
    prof_b = build_profile(read_trace_files([work / "b.jsonl"]).records)
    sample_cfg = SampleConfig(args.max_prompt_tokens, args.max_output_tokens)

    def replay(path: Path, n: int, seed: int) -> list[Any]:
        return build_replay(stratified_sample(read_trace_files([path]).records, n, seed), synth,
                            sample_cfg)

    # B's open-loop sample: consecutive records, so its offsets are B's arrival pattern
    # (gaps divided by --b-time-scale; the replay prints the in-flight count it produced)
    window_b = read_trace_files([work / "b.jsonl"]).records[: args.open_requests]
    open_cfg = SampleConfig(args.max_prompt_tokens, args.max_output_tokens,
                            time_scale=args.b_time_scale)
    samples = {"fast_b": replay(work / "b.jsonl", args.fast_requests, 0),
               "slow_a": replay(work / "a.jsonl", args.slow_requests, 1),
               "open_b": build_replay(window_b, synth, open_cfg)}
    tiers = [Tier("fast_b", args.fast_layers or None, args.fast_requests, concurrency=1),
             Tier("slow_a", None, args.slow_requests, concurrency=8),
             Tier("open_b", None, args.open_requests, concurrency=8, open_loop=True,
                  warmup_requests=1)]
    space = SearchSpace.default(BASE, 1 << 30, SMALL_KNOBS)
    out: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                           "args": vars(args), "cold_start_s": [], "reload_s": [],
                           "traffic": {"a": f"{busy[0]} busy", "b": f"{quiet[0]} quiet"}}

    # 1. grid on traffic B, fast tier; 5. reload seconds
    grid_engine = EngineProcess(BASE, log_path=work / "grid-engine.log")
    try:
        await _grid_step(args, out, grid_engine, samples, tiers, space)
    finally:
        await grid_engine.stop()
    out["cold_start_s"].append(await grid_engine.start())  # a cold restart, for the ratio
    await grid_engine.stop()
    table = out["grid"]

    # 2. tabular search vs the grid
    values = {k: v["value"] for k, v in table.items()}
    best = max(values.values())
    hw = HardwareConstants.measure()
    cost = CostModel(space, ForwardTimeModel.fit(space.shape, hw))
    work_b = Workload(1, prof_b, args.max_prompt_tokens, args.max_output_tokens)
    budget = max(1, len(values) // 4)
    out["search"] = {}
    for strategy in ("agents", "random"):
        gaps = []
        for seed in range(args.search_seeds):
            pick = tabular_search(space, values, budget, seed,
                                   lambda c: cost.predict(c, work_b, args.fast_layers or None),
                                   strategy)
            gaps.append(1 - values[pick] / best)
        out["search"][strategy] = {"budget": budget, "grid": len(values), "gaps": gaps}

    # 3. the service: traffic A, then a shift to B, promoted to a live worker
    live = EngineProcess(BASE, log_path=work / "live-engine.log")
    out["cold_start_s"].append(await live.start())
    try:
        svc = await run_service(args, work, recs_a, recs_b, live.url)
    finally:
        await live.stop()
    snap = svc["snapshot"]
    out["service"] = {k: snap[k] for k in ("history", "experiments", "seconds_per_experiment",
                                            "experiments_per_hour", "timings", "objective",
                                            "hardware")}
    out["service"]["first_campaign_s"] = svc["first_campaign_s"]
    out["service"]["live_ok"], out["service"]["live_failed"] = svc["live_ok"], svc["live_failed"]
    out["service"]["shift_to_done_s"] = svc["shift_to_done_s"]
    hist = snap["history"]
    # what is live after each campaign (a campaign that promotes nothing keeps the last)
    svc_space = SearchSpace.default(BASE, 1 << 30, SERVICE_KNOBS)
    live_a = _deployed(svc_space, hist[0], None)
    found = {"a": live_a, "b": _deployed(svc_space, hist[1], live_a)}
    out["found"] = {k: (svc_space.key(v) if v else None) for k, v in found.items()}
    # the grid's key of each (None when it runs engine-core processes: not in the grid)
    out["found_grid_key"] = {k: (space.key(v) if v and not v.engine.data_parallel_size
                                 else None) for k, v in found.items()}
    searched_b = (hist[1].get("best_fast") or {}).get("key")
    key_b = json.dumps(searched_b, sort_keys=True) if searched_b else None
    out["live_gap_b"] = 1 - values[key_b] / best if key_b in values else None

    # 4. gain over the default, paired, slow tier, each on its own traffic
    gain_engine = EngineProcess(BASE, log_path=work / "gain-engine.log")
    out["cold_start_s"].append(await gain_engine.start())
    try:
        await _gain_step(args, out, gain_engine, samples, tiers, found)
    finally:
        await gain_engine.stop()
    out["reload_s"] = [v["reload_s"] for v in table.values()]
    return out


async def _gain_step(args: argparse.Namespace, out: dict[str, Any], gain_engine: EngineProcess,
                     samples: dict[str, list[Any]], tiers: list[Tier],
                     found: dict[str, CompiledConfig | None]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        engine = EngineClient(gain_engine.url, session)
        await engine.wait_ready()
        # NOTE: a found config with another data_parallel_size runs on a second engine of
        # the pool (started once); the pairs still alternate default, found, default, ...
        pool = EnginePool(session, max_engines=2, log_dir=gain_engine.log_path.parent
                          if gain_engine.log_path else None)
        await pool.adopt(BASE, engine, gain_engine)
        measurer = Measurer(engine, samples, tiers, gain_engine.cpu_seconds, "wall", pool)
        out["gain"] = {}
        try:
            for name, tier, objective in (("a", "slow_a", args.a_objective),
                                          ("b", "open_b", "request")):
                cfg = found[name]
                if cfg is not None:
                    out["gain"][name] = await paired(measurer, BASE, cfg, tier, args.pairs,
                                                     objective)
            if found["a"] is not None and found["b"] is not None and found["a"] != found["b"]:
                out["gain"]["b_vs_a_on_b"] = await paired(measurer, found["a"], found["b"],
                                                          "open_b", args.pairs, "request")
        finally:
            await pool.adopt(BASE, engine)  # NOTE: the caller stops gain_engine itself
            await pool.close()


def _deployed(space: SearchSpace, entry: dict[str, Any],
              previous: CompiledConfig | None) -> CompiledConfig | None:
    """The config a campaign found: its confirmed winner (promoted or not), else the previous.

    NOTE: a winner the service did not promote (gain within its noise) is still
    measured against the default below, with more pairs; its status is printed.
    """
    if entry.get("key"):
        return space.build(entry["key"])
    return previous


def report(out: dict[str, Any]) -> str:
    lines = []
    grid = out["grid"]
    best_key = max(grid, key=lambda k: grid[k]["value"])
    anchors = out["grid_anchors"]
    lines.append(f"traffic A: {out['traffic']['a']}; traffic B: {out['traffic']['b']}")
    lines.append(f"grid: {len(grid)} configs on traffic B (objective: mean per-request output "
                 f"tok/s, closed loop at B's concurrency 1, full model), {out['grid_s']:.0f} s; "
                 f"default re-measured {len(anchors)} times: "
                 f"{' '.join(f'{a:.1f}' for a in anchors)} (cv {out['fast_tier_noise']:.1%}; "
                 f"values divided by it)")
    lines.append(f"  grid best {grid[best_key]['value']:.1f} req-tok/s: {best_key}")
    for strategy, s in out["search"].items():
        gaps = s["gaps"]
        within = sum(g <= 0.05 for g in gaps)
        lines.append(f"search[{strategy}] budget {s['budget']}/{s['grid']} "
                     f"({s['budget'] / s['grid']:.2f} of the grid): gap median "
                     f"{statistics.median(gaps):.1%}, max {max(gaps):.1%}, within 5% in "
                     f"{within}/{len(gaps)} seeds")
    if out.get("live_gap_b") is not None:
        lines.append(f"live campaign on B: its best screened config's grid gap "
                     f"{out['live_gap_b']:.1%}")
    svc = out["service"]
    for i, h in enumerate(svc["history"]):
        lines.append(f"campaign {i + 1}: {h.get('status')} gain {h.get('gain')} noise "
                     f"{h.get('noise')} in {h['seconds']} s, fast exps {h['fast_experiments']}, "
                     f"objective {h.get('objective')}, agents {h['agents']}")
        pr = h["pruning"]
        lines.append(f"  pruning: {pr.get('pruned')} pruned of {pr.get('considered')} considered,"
                     f" audit wrong/audited {pr.get('wrong')}/{pr.get('audited')}")
    lines.append(f"traffic shift -> campaign 2 finished in {svc['shift_to_done_s']:.0f} s "
                 f"(first campaign {svc['first_campaign_s']:.0f} s)")
    for name, key in out["found"].items():
        lines.append(f"found for {name.upper()}: {key}")
    lines.append(f"live worker traffic during the run: {svc['live_ok']} requests ok, "
                 f"{svc['live_failed']} failed")
    default = SearchSpace.default(BASE, 1 << 30, SMALL_KNOBS).key(BASE)
    for name, key in (("default", default), *out["found_grid_key"].items()):
        if key in grid:
            lines.append(f"  grid value of {name}: {grid[key]['value']:.1f} "
                         f"({grid[key]['value'] / grid[best_key]['value']:.3f} of the best)")
    what = {"a": f"found-for-A vs DEFAULT on A (closed loop c=8; objective "
                 f"{out['args']['a_objective']} tok/s)",
            "b": "found-for-B vs DEFAULT on B (open loop at B's arrivals; objective mean "
                 "per-request output tok/s)",
            "b_vs_a_on_b": "found-for-B vs found-for-A on B (open loop)"}
    for name, g in out["gain"].items():
        lines.append(f"gain[{name}] {what.get(name, name)}: {g['ratio']:.3f}x (noise "
                     f"{g['noise']:.3f}, significant {g['significant']}); per-request tok/s "
                     f"{g['request_ratio']:.3f}x, tok/cpu-s {g['cpu_ratio']:.3f}x, tok/wall-s "
                     f"{g['wall_ratio']:.3f}x, TPOT p50 {g['tpot_p50_ratio']:.3f}x; default's "
                     f"replay had {g['in_flight_a']:.2f} requests in flight; pairs "
                     f"{' '.join(f'{r:.2f}' for r in g.get('pair_ratios', []))}")
    rl = sorted(out["reload_s"])
    cold = out["cold_start_s"]
    lines.append(f"hot reload p50 {statistics.median(rl):.3f} s, max {max(rl):.3f} s; cold start "
                 f"median {statistics.median(cold):.1f} s -> restart/reload "
                 f"{statistics.median(cold) / statistics.median(rl):.0f}x")
    lines.append(f"experiments/hour: {svc['experiments_per_hour']}, seconds/experiment: "
                 f"{svc['seconds_per_experiment']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--records", type=int, default=200)
    p.add_argument("--fast-layers", type=int, default=0,
                   help="fast tier: first N layers only (0 = full model; a truncated model "
                        "writes other text, so it misjudges n-gram speculation)")
    p.add_argument("--fast-requests", type=int, default=4)
    p.add_argument("--slow-requests", type=int, default=24,
                   help="A's closed-loop sample (c=8; 12 left a tail that made pairs noisy)")
    p.add_argument("--open-requests", type=int, default=12,
                   help="consecutive B records replayed open loop for the gain")
    p.add_argument("--b-time-scale", type=float, default=2.0,
                   help="B's arrival gaps are divided by this in the open-loop replay (2: the "
                        "capped replay requests last about half the recorded 2 s, so this keeps "
                        "B's recorded ~1 request in flight; the report prints the replay's own)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--a-objective", choices=["wall", "cpu"], default="wall",
                   help="busy traffic A's objective: wall tok/s (closed loop at its concurrency) "
                        "or tok per engine CPU second")
    p.add_argument("--budget", type=int, default=20,
                   help="fast-tier experiments per campaign (an engine start for a "
                        "data_parallel_size candidate is charged ~8 of them)")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-output-tokens", type=int, default=48)
    p.add_argument("--search-seeds", type=int, default=10)
    p.add_argument("--watch-s", type=float, default=3.0)
    p.add_argument("--campaign-timeout-s", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", choices=["code", "conv"], default="code",
                   help="which trace is the quiet traffic B (the other is the busy A)")
    p.add_argument("--prompts", default=str(PROMPTS),
                   help="Spec-Bench questions used as the traces' recorded prompt text; '' = "
                        "synthetic prompts (optimizer.sample)")
    p.add_argument("--out", default="", help="write the raw results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.fast_requests, args.slow_requests, args.pairs, args.budget = 3, 4, 2, 4
        args.open_requests = 4
        args.search_seeds, args.max_output_tokens = 3, 16
    return args


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("aiohttp.access", "optimizer.measure"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = parse_args()
    result = asyncio.run(main(args))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(report(result))
    sys.exit(0)
