"""Why the grid and the paired replay disagree, and what the busy traffic rewards: paired probes.

Uses bench/optimizer.py's traffic (same seeds, samples and caps) and measures
configs against the DEFAULT ``EngineConfig()`` in interleaved pairs
(default, candidate, default, candidate, ...), each pair on the same sample:

  grid    the grid's sample of B (4 requests, closed loop at concurrency 1)
  open    B's open-loop sample (12 consecutive records at B's arrivals)
  busy    A's sample (12 requests, closed loop at c=8): wall tokens/s

Candidates that change a restart-only knob (``data_parallel_size``) run on an
engine process started with that value (optimizer.pool); all engines stay up
and the pairs still alternate, so drift on the shared box hits both sides alike.

    python bench/optimizer_probe.py --quiet conv --pairs 5
    python bench/optimizer_probe.py --quiet code --probes dp1@open dp2@open found@open
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))  # the repository, for the bench package

import aiohttp  # noqa: E402

from bench import optimizer_replay as bo  # noqa: E402
from optimizer.abtest import paired_gain  # noqa: E402
from optimizer.engine_proc import EngineProcess  # noqa: E402
from optimizer.measure import EngineClient, Measurer, Tier  # noqa: E402
from optimizer.pool import EnginePool  # noqa: E402
from optimizer.profile import read_trace_files, stratified_sample  # noqa: E402
from optimizer.sample import DomainPromptSynthesizer, SampleConfig, build_replay  # noqa: E402
from polyinfer.config import TINY_TARGET, CompiledConfig  # noqa: E402

logger = logging.getLogger("bench.optimizer_probe")

GRID_BEST = {"spec_method": "ngram", "spec_max_depth": 8, "spec_default_depth": 2,
             "max_num_seqs": 8, "num_threads": 2}
PROMOTED = {"spec_method": "ngram", "spec_max_depth": 4, "spec_default_depth": 2,
            "max_num_seqs": 8, "num_threads": 2}


def samples(args: argparse.Namespace, work: Path) -> dict[str, list[Any]]:
    busy, quiet = bo.TRACES[args.quiet == "code"], bo.TRACES[args.quiet == "conv"]
    recs_a = bo.azure_records(bo.DATA / busy[0], args.records, args.seed, busy[1],
                              rate_rps=4.0, e2e_s=2.5, t0=1.7e9)
    recs_b = bo.azure_records(bo.DATA / quiet[0], args.records, args.seed + 1, quiet[1],
                              rate_rps=0.5, e2e_s=2.0, t0=1.7e9 + 3600)
    synth = DomainPromptSynthesizer(TINY_TARGET / "tokenizer.json", seed=args.seed)
    for i, recs in enumerate((recs_a, recs_b)):
        bo.attach_prompts(recs, Path(args.prompts), synth, args.max_prompt_tokens, args.seed + i)
    bo.write_jsonl(work / "a.jsonl", recs_a)
    bo.write_jsonl(work / "b.jsonl", recs_b)
    cfg = SampleConfig(args.max_prompt_tokens, args.max_output_tokens)

    def replay(path: Path, n: int, seed: int) -> list[Any]:
        return build_replay(stratified_sample(read_trace_files([path]).records, n, seed), synth,
                            cfg)

    window_b = read_trace_files([work / "b.jsonl"]).records[: args.open_requests]
    open_cfg = SampleConfig(args.max_prompt_tokens, args.max_output_tokens, time_scale=2.0)
    return {"grid": replay(work / "b.jsonl", 4, 0),
            "busy": replay(work / "a.jsonl", args.busy_requests, 1),
            "open": build_replay(window_b, synth, open_cfg)}


def tiers(args: argparse.Namespace) -> list[Tier]:
    return [Tier("grid", None, 4, concurrency=1, warmup_requests=1),
            Tier("open", None, 12, concurrency=8, open_loop=True, warmup_requests=1),
            Tier("busy", None, args.busy_requests, concurrency=8)]
KEYS = ("request_tokens_per_s", "wall_tokens_per_s", "ttft_p50_s", "tpot_p50_s", "in_flight")


async def pair_runs(ma: Measurer, mb: Measurer, a: CompiledConfig, b: CompiledConfig, tier: str,
                    pairs: int, key: str) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    for _ in range(pairs):
        runs["a"].append((await ma.measure(a, tier, repeats=1)).details)
        runs["b"].append((await mb.measure(b, tier, repeats=1)).details)
    sa = [float(d[key]) for d in runs["a"]]
    sb = [float(d[key]) for d in runs["b"]]
    g = paired_gain(sb, sa, min_gain=0.0)
    out = {"tier": tier, "objective": key, "ratio": 1 + g.gain, "noise": g.noise,
           "significant": g.significant, "a": sa, "b": sb}
    for k in KEYS:
        va = [float(d[k] or 0.0) for d in runs["a"]]
        vb = [float(d[k] or 0.0) for d in runs["b"]]
        out[f"{k}_a"], out[f"{k}_b"] = statistics.fmean(va), statistics.fmean(vb)
    return out


def describe(name: str, s: list[Any]) -> str:
    p = [r.prompt_tokens for r in s]
    o = [r.max_tokens for r in s]
    return (f"sample {name}: {len(s)} requests, prompt tokens mean {statistics.fmean(p):.0f} "
            f"(max {max(p)}), output tokens mean {statistics.fmean(o):.1f} (max {max(o)})")


FOUND = {"data_parallel_size": 2, "spec_method": "ngram", "spec_max_depth": 4,
         "spec_default_depth": 2, "max_num_seqs": 8, "num_threads": 2}
PROBES: dict[str, tuple[str, dict[str, Any], str]] = {  # name -> (tier, changes, objective)
    "grid-best": ("grid", GRID_BEST, "request_tokens_per_s"),
    "grid-best@open": ("open", GRID_BEST, "request_tokens_per_s"),
    "promoted": ("grid", PROMOTED, "request_tokens_per_s"),
    "threads2": ("busy", {"num_threads": 2}, "wall_tokens_per_s"),
    "dp2": ("busy", {"data_parallel_size": 2}, "wall_tokens_per_s"),
    "dp2+ngram": ("busy", {"data_parallel_size": 2, "spec_method": "ngram", "spec_max_depth": 4,
                           "spec_default_depth": 2}, "wall_tokens_per_s"),
    "found@busy": ("busy", FOUND, "wall_tokens_per_s"),
    # low load: what moves per-request tok/s (a process of its own, threads, speculation)
    "dp1@open": ("open", {"data_parallel_size": 1}, "request_tokens_per_s"),
    "dp2@open": ("open", {"data_parallel_size": 2}, "request_tokens_per_s"),
    "threads2@open": ("open", {"num_threads": 2}, "request_tokens_per_s"),
    "dp1+threads2@open": ("open", {"data_parallel_size": 1, "num_threads": 2},
                          "request_tokens_per_s"),
    "found@open": ("open", FOUND, "request_tokens_per_s"),
}
DEFAULT_PROBES = ("grid-best", "grid-best@open", "promoted", "threads2", "dp2", "dp2+ngram")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-optimizer-probe-"))
    smp = samples(args, work)
    for name, s in smp.items():
        print(describe(name, s), flush=True)
    base = bo.BASE
    first = EngineProcess(base, log_path=work / "engine0.log")
    out: dict[str, Any] = {"probes": []}
    await first.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
            # NOTE: one engine per data_parallel_size, all kept up: pairs alternate engines
            pool = EnginePool(session, max_engines=4, log_dir=work)
            await pool.adopt(base, EngineClient(first.url, session), first)
            m = Measurer(EngineClient(first.url, session), smp, tiers(args), None, "wall", pool)
            for name in args.probes or DEFAULT_PROBES:
                tier, changes, key = PROBES[name]
                r = await pair_runs(m, m, base, base.with_engine(**changes), tier, args.pairs,
                                    key)
                r["name"] = name
                out["probes"].append(r)
                print(line(r), flush=True)
            await pool.adopt(base, EngineClient(first.url, session))  # NOTE: stopped below
            await pool.close()
    finally:
        await first.stop()
    return out


def line(r: dict[str, Any]) -> str:
    return (f"{r['name']} on {r['tier']} ({r['objective']}): {r['ratio']:.3f}x (noise "
            f"{r['noise']:.3f}, significant {r['significant']}); default/cand "
            f"req-tok/s {r['request_tokens_per_s_a']:.1f}/{r['request_tokens_per_s_b']:.1f}, "
            f"wall tok/s {r['wall_tokens_per_s_a']:.1f}/{r['wall_tokens_per_s_b']:.1f}, "
            f"TTFT p50 {r['ttft_p50_s_a'] * 1e3:.0f}/{r['ttft_p50_s_b'] * 1e3:.0f} ms, "
            f"TPOT p50 {r['tpot_p50_s_a'] * 1e3:.1f}/{r['tpot_p50_s_b'] * 1e3:.1f} ms, "
            f"in flight {r['in_flight_a']:.2f}/{r['in_flight_b']:.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quiet", choices=["code", "conv"], default="conv")
    p.add_argument("--records", type=int, default=200)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-output-tokens", type=int, default=48)
    p.add_argument("--open-requests", type=int, default=12)
    p.add_argument("--busy-requests", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", default=str(bo.PROMPTS))
    p.add_argument("--probes", nargs="*", default=[], choices=sorted(PROBES),
                   help=f"which probes (default: {' '.join(DEFAULT_PROBES)})")
    p.add_argument("--out", default="")
    return p.parse_args(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args()
    result = asyncio.run(main(args))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
