"""The optimizer's whole loop on a replayed trace, through the proxy, and its mutation suite.

    python bench/optimizer_loop.py             # ~10-15 minutes on a busy 2-core box
    python bench/optimizer_loop.py --budget 4  # a shorter search
    # a default that is poor for the traffic (one sequence at a time under 8 streams),
    # scored in tokens per engine CPU second: a known-better config exists
    python bench/optimizer_loop.py --worker-seqs 1 --objective cpu

Two steps, real engines on the bundled model, loopback HTTP:

  mutants  an engine worker under the test-only fault injector
           (tests/optimizer/faults.py) verified against the incumbent: a clean
           candidate must pass, each planted fault must be rejected
           (caught / planted);
  loop     a proxy supervising one engine worker (launched: a switch stops a
           real process), clients replaying the Azure conversation trace
           (data/traces, lengths capped) at the worker's capacity (``--clients``
           streams in flight, 8: twice the default batch), and an optimizer for
           that worker fed the proxy's own trace records, promoting through the
           proxy's blue-green and hot reload (judged by the per-shape canary on
           those records); ``limits.drain_timeout_s`` is 1 s, shorter than the
           drain at capacity. Every client request must come back whole (HTTP 200,
           all its tokens, ``[DONE]``): anything else is a request lost.

Prints experiments/hour, the campaign's decision (gain over the default with its
95% CI), promotions, requests lost, mutants caught / planted.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import orjson  # noqa: E402

from optimizer.campaign import SearchConfig  # noqa: E402
from optimizer.engine_proc import EngineProcess  # noqa: E402
from optimizer.measure import EngineClient, Tier  # noqa: E402
from optimizer.promote import PromotionConfig  # noqa: E402
from optimizer.sample import DomainPromptSynthesizer, SampleConfig  # noqa: E402
from optimizer.service import OptimizerConfig, OptimizerService  # noqa: E402
from optimizer.space import Knob  # noqa: E402
from optimizer.verify import (  # noqa: E402
    VerifyConfig,
    reference_outputs,
    verification_plan,
    verify_candidate,
)
from polyinfer.config import TINY_TARGET, CompiledConfig  # noqa: E402
from proxy import keys  # noqa: E402
from proxy.config import (  # noqa: E402
    HealthConfig,
    LaunchSpec,
    LimitsConfig,
    ServerConfig,
    TraceConfig,
    default_config,
)
from proxy.promotion import PoolConfigSink, PoolSwitch  # noqa: E402
from proxy.server import ProxyServer  # noqa: E402
from tests.optimizer.faults import FAULTS, LAUNCHER  # noqa: E402

TRACE = ROOT / "data" / "traces" / "azure_llm_2023_conv.csv"
KNOBS = (Knob("max_num_seqs", (1, 2, 4, 8, 16)), Knob("max_num_batched_tokens", (128, 256, 512)),
         Knob("spec_method", ("none", "ngram")), Knob("spec_max_depth", (0, 2, 4)),
         Knob("spec_default_depth", (0, 2, 4)), Knob("num_threads", (0, 1, 2)))


async def mutants(log_path: Path | None) -> dict[str, Any]:
    incumbent = CompiledConfig(model=str(TINY_TARGET)).with_engine(
        kv_cache_tokens=8192, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=512)
    candidate = incumbent.with_engine(max_num_seqs=16, max_num_batched_tokens=1024)
    vcfg = VerifyConfig(max_batch=16)
    plan = verification_plan(DomainPromptSynthesizer(TINY_TARGET / "tokenizer.json", seed=0), vcfg)
    t0 = time.perf_counter()
    caught: dict[str, bool] = {}
    async with EngineProcess(incumbent, launcher=LAUNCHER, log_path=log_path) as proc, \
            aiohttp.ClientSession() as session:
        engine = EngineClient(proc.url, session)
        await engine.wait_ready()
        reference = await reference_outputs(engine, incumbent, plan)
        clean = await verify_candidate(engine, candidate, plan, reference, vcfg)
        for fault in FAULTS[1:]:
            async with session.post(f"{proc.url}/test/fault", json={"name": fault}):
                pass
            report = await verify_candidate(engine, candidate, plan, reference, vcfg)
            caught[fault] = not report.ok
        async with session.post(f"{proc.url}/test/fault", json={"name": "none"}):
            pass
    return {"clean_passed": clean.ok, "caught": caught, "seconds": time.perf_counter() - t0}


def trace_rows(n: int, max_prompt: int, max_output: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of the trace's first ``n`` rows, capped."""
    with open(TRACE) as f:
        rows = list(csv.DictReader(f))[:n]
    return [(min(max_prompt, max(8, int(r["ContextTokens"]))),
             min(max_output, max(4, int(r["GeneratedTokens"])))) for r in rows]


@dataclasses.dataclass
class Clients:
    ok: int = 0
    lost: list[str] = dataclasses.field(default_factory=list)

    async def run(self, url: str, model: str, prompts: list[tuple[str, int]], stop: asyncio.Event,
                  concurrency: int) -> None:
        cursor = iter(range(1 << 30))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
            await asyncio.gather(*(self._client(session, url, model, prompts, stop, cursor)
                                   for _ in range(concurrency)))

    async def _client(self, session: aiohttp.ClientSession, url: str, model: str,
                      prompts: list[tuple[str, int]], stop: asyncio.Event, cursor: Any) -> None:
        while not stop.is_set():
            prompt, max_tokens = prompts[next(cursor) % len(prompts)]
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                    "ignore_eos": True, "temperature": 0,
                    "stream_options": {"include_usage": True}}
            try:
                async with session.post(url + "/v1/completions", json=body) as r:
                    lines = [ln.decode().strip() async for ln in r.content]
            except (aiohttp.ClientError, OSError) as e:
                self.lost.append(f"transport: {e!r}")
                continue
            data = [ln for ln in lines if ln.startswith("data: ")]
            if r.status != 200 or not data or data[-1] != "data: [DONE]":
                self.lost.append(f"HTTP {r.status}: {data[-1:]!r}")
                continue
            usage = orjson.loads(data[-2][6:]).get("usage") or {}
            if usage.get("completion_tokens") != max_tokens:
                self.lost.append(f"cut stream: {usage}")
                continue
            self.ok += 1


async def loop(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    base = next(w for w in default_config().workers if w.config.engine.spec_method == "none")
    worker_spec = dataclasses.replace(
        base, config=base.config.with_engine(max_num_seqs=args.worker_seqs))
    config = dataclasses.replace(
        default_config(), server=ServerConfig(port=0), run_dir=str(work / "run"),
        workers=(dataclasses.replace(worker_spec, launch=LaunchSpec(startup_timeout_s=300)),),
        traces=TraceConfig(dir=str(work / "traces"), flush_interval_s=0.5),
        limits=LimitsConfig(max_loop_lag_s=0, drain_timeout_s=1.0),
        health=HealthConfig(interval_s=0.5, metrics_interval_s=0.5))
    server = ProxyServer(config)
    await server.start()
    try:
        return await _loop(args, server, work)
    finally:
        await server.stop()


async def _loop(args: argparse.Namespace, server: ProxyServer, work: Path) -> dict[str, Any]:
    pool = server.app[keys.POOL]
    (name, worker), = pool.workers.items()
    synth = DomainPromptSynthesizer(TINY_TARGET / "tokenizer.json", seed=1)
    domains = ("chat", "qa", "summarization", "code")
    prompts = [(synth.make(domains[i % len(domains)], p), o)
               for i, (p, o) in enumerate(trace_rows(args.records, args.max_prompt_tokens,
                                                     args.max_output_tokens))]
    service = OptimizerService(
        OptimizerConfig(
            base=worker.view.config, worker_url=worker.url, worker_name=name,
            board_path=str(work / "board.sqlite"), knobs=KNOBS,
            fast=Tier("fast", 2, 8, concurrency=8, warmup_requests=1),
            slow=Tier("slow", None, 8, repeats=2, concurrency=8, warmup_requests=1),
            sample=SampleConfig(args.max_prompt_tokens, args.max_output_tokens),
            search=SearchConfig(fast_budget=args.budget, finalists=1, idle_timeout_s=30,
                                max_pairs=args.max_pairs),
            promotion=PromotionConfig(watch_s=3.0, min_requests=4, max_watch_s=60),
            verify=VerifyConfig(max_batch=8), min_records=args.min_records,
            objective=args.objective, once=True),
        sinks=(PoolConfigSink(pool),), blue_green=PoolSwitch(server.app[keys.BLUEGREEN], pool))
    server.app[keys.RELAY].on_finish.append(
        lambda rec: service.observe(rec.trace_record()) if rec.worker == name else None)
    clients, stop = Clients(), asyncio.Event()
    load = asyncio.create_task(clients.run(server.url, worker.view.config.model_name, prompts,
                                           stop, concurrency=args.clients))
    t0 = time.monotonic()
    switch: dict[str, Any] = {}
    try:
        await asyncio.wait_for(service.run(), args.timeout_s)
        switch = await _blue_green(server, name, service)
    finally:
        stop.set()
        await load
    snap = service.snapshot()
    return {"seconds": time.monotonic() - t0, "history": snap["history"],
            "experiments": snap["experiments"],
            "experiments_per_hour": snap["experiments_per_hour"],
            "requests_ok": clients.ok, "requests_lost": len(clients.lost), "switch": switch,
            "lost_examples": clients.lost[:5],
            "live_config": service.live_config.to_dict()["engine"] if service.live_config
            else None}


async def _blue_green(server: ProxyServer, name: str, service: OptimizerService
                      ) -> dict[str, Any]:
    """A blue-green switch of the worker, under the same load, to the campaign's best config.

    NOTE: the campaign may not promote (a hot reload when it does); this exercises the
    switch that once lost requests, on a real launched worker, at capacity.
    """
    pool = server.app[keys.POOL]
    live = pool.workers[name]
    key = (service.history[-1].get("key") if service.history else None) or {}
    target = live.view.config.with_engine(**key)
    await PoolSwitch(server.app[keys.BLUEGREEN], pool).replace(live.url, target)
    report = server.app[keys.BLUEGREEN].last
    assert report is not None
    await asyncio.sleep(2.0)  # traffic on the new worker
    return {"to": key, **report.to_dict()}


def _ratios(row: dict[str, Any]) -> str:
    """A canary row as 'metric after/before' ratios (geometric means) with the request counts."""
    parts = [f"{m} x{row[m]['after'] / row[m]['before']:.2f}" for m in ("ttft_s", "tpot_s",
                                                                        "e2e_s") if m in row]
    return f"n={row['requests']} " + " ".join(parts)


def report(m: dict[str, Any], lp: dict[str, Any]) -> str:
    caught = sum(m["caught"].values())
    lines = [f"mutants caught / planted: {caught} / {len(m['caught'])} "
             f"({', '.join(f'{k}: {v}' for k, v in m['caught'].items())}); clean candidate "
             f"passed: {m['clean_passed']}; {m['seconds']:.0f} s"]
    for h in lp["history"]:
        lines.append(f"campaign: {h.get('status')} {h.get('reason') or ''} gain vs default "
                     f"{h.get('gain')} CI {h.get('ci')} pairs {h.get('pairs')} (needed "
                     f"{h.get('pairs_needed')}, detectable {h.get('detectable_effect')}) key "
                     f"{h.get('key')} in {h.get('seconds')} s")
        canary = h.get("canary") or {}
        if canary:
            lines.append(f"canary: {canary.get('judged')} shape x metric comparisons judged, "
                         f"regressed: {canary.get('regressed')}; shapes "
                         + "; ".join(f"{k}: {_ratios(v)}" for k, v in
                                     canary.get("shapes", {}).items()))
    promotions = sum(h.get("status") == "promoted" for h in lp["history"])
    lines.append(f"experiments: {lp['experiments']}, experiments/hour: "
                 f"{lp['experiments_per_hour']}; promotions: {promotions}")
    sw = lp.get("switch") or {}
    if sw:
        lines.append(f"blue-green switch under the load to {sw['to']}: "
                     f"{sw['num_in_flight_at_shift']} in flight at the shift, drain "
                     f"{sw['drain_s']:.1f} s (limits.drain_timeout_s 1 s), abandoned "
                     f"{sw['num_abandoned']}, total {sw['total_s']:.1f} s")
    lines.append(f"client requests through the proxy at capacity: {lp['requests_ok']} whole, "
                 f"{lp['requests_lost']} lost {lp['lost_examples']}; loop {lp['seconds']:.0f} s")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=int, default=6, help="fast-tier experiments")
    p.add_argument("--max-pairs", type=int, default=4)
    p.add_argument("--records", type=int, default=200)
    p.add_argument("--min-records", type=int, default=40)
    p.add_argument("--max-prompt-tokens", type=int, default=160)
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--worker-seqs", type=int, default=4,
                   help="the live worker's max_num_seqs before the campaign (1: a default "
                        "that is poor for 8 clients, so a better config exists)")
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    p.add_argument("--objective", default="auto", choices=["auto", "wall", "cpu", "request"],
                   help="the campaign's objective (cpu: tokens per engine CPU second)")
    p.add_argument("--skip-mutants", action="store_true")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--engine-log", type=Path, help="the mutation suite's engine log")
    return p.parse_args(argv)


async def main(args: argparse.Namespace) -> None:
    m = {"clean_passed": None, "caught": {}, "seconds": 0.0}
    if not args.skip_mutants:
        m = await mutants(args.engine_log)
    with tempfile.TemporaryDirectory(prefix="polyinfer-loop-") as tmp:
        lp = await loop(args, Path(tmp))
    print(report(m, lp))
    if args.json:
        args.json.write_text(json.dumps({"mutants": m, "loop": lp}, indent=1, default=str))


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
