"""What automatic prefix caching buys one built-in engine: caching on vs off, same run.

``--workload mooncake`` (default) is a window of the Mooncake trace
(``traces/mooncake_synthetic.jsonl``), whose ``hash_ids`` name shared 512-token
prefix blocks. Each hash id becomes a fixed run of ``--block-tokens``
pseudo-random token ids (seeded by the id), so requests that share hash ids
share exactly that token prefix; prompts are capped to fit the tiny model's
context. ``--workload sessions`` is multi-turn chat: Spec-Bench questions with
their follow-up turns (padded to ``--turns`` with "Please continue."), each
turn's prompt being the whole conversation so far (prompts, answers) in the
model's chat format. Requests (sessions, turn after turn) go through a closed
loop of ``--concurrency`` streams (``/v1/completions``, greedy, ``ignore_eos``),
first to an engine with ``enable_prefix_caching: true``, then to an identical
one with ``false`` (the order alternates per round), each started fresh here.

Prints, per side: TTFT p50/p90, request and output-token throughput, the
prompt tokens served from the cache (``usage.prompt_tokens_details``), and the
on/off ratios; plus whether the greedy outputs of the two sides are identical.

    python bench/prefix_cache.py --offset 3850 --requests 128 --concurrency 4 --rounds 2
    python bench/prefix_cache.py --workload sessions --requests 24 --turns 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import orjson
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine_throughput import wait_ready  # noqa: E402
from polyinfer.config import TINY_TARGET  # noqa: E402

VOCAB = 8192
FIRST_ID = 10  # keep clear of the special tokens


@dataclass(frozen=True)
class Request:
    """One request, or the turns of one chat session (user texts, answered in order)."""

    prompt: list[int] | None
    max_tokens: int
    turns: tuple[str, ...] = ()


def chat_turn(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class Side:
    ttft_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    num_output: int = 0
    num_prompt: int = 0
    num_cached: int = 0
    outputs: list[list[str]] = field(default_factory=list)  # per request, per turn


def block_tokens(hash_id: int, n: int) -> list[int]:
    rng = np.random.default_rng(hash_id)
    return rng.integers(FIRST_ID, VOCAB, size=n).tolist()


def load_requests(path: Path, offset: int, count: int, tokens_per_block: int,
                  max_model_len: int, max_tokens: int) -> tuple[list[Request], float]:
    """Requests of the trace window, and its prefix hit rate with an unbounded cache."""
    rows = [json.loads(line) for line in path.read_text().splitlines()[offset:offset + count]]
    max_blocks = (max_model_len - max_tokens) // tokens_per_block
    requests, seen, hit, total = [], set(), 0, 0
    for row in rows:
        ids = row["hash_ids"][:max_blocks]
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        hit, total = hit + k, total + len(ids)
        seen.update(ids)
        prompt = [t for h in ids for t in block_tokens(h, tokens_per_block)]
        requests.append(Request(prompt, max(1, min(row["output_length"], max_tokens))))
    return requests, hit / max(total, 1)


def load_sessions(path: Path, count: int, turns: int, max_tokens: int) -> list[Request]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows = [r for r in rows if len(r["turns"]) > 1][:count]  # the MT-bench ones: 2 turns
    out = []
    for r in rows:
        user = list(r["turns"][:turns]) + ["Please continue."] * (turns - len(r["turns"]))
        out.append(Request(None, max_tokens, tuple(user)))
    return out


async def one(s: aiohttp.ClientSession, url: str, prompt: list[int] | str, max_tokens: int,
              side: Side) -> str:
    """Stream one completion; records its TTFT and usage; returns its text."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    text = []
    async with s.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(await r.text())
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                u = chunk["usage"]
                side.num_output += u["completion_tokens"]
                side.num_prompt += u["prompt_tokens"]
                side.num_cached += u["prompt_tokens_details"]["cached_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                first = first if first is not None else time.perf_counter()
                text.append(chunk["choices"][0]["text"])
    side.ttft_s.append((first or time.perf_counter()) - t0)
    return "".join(text)


async def run_request(s: aiohttp.ClientSession, url: str, req: Request, side: Side) -> list[str]:
    if req.prompt is not None:
        return [await one(s, url, req.prompt, req.max_tokens, side)]
    history, answers = "", []
    for user in req.turns:  # NOTE: the conversation so far is the next turn's prefix
        history += chat_turn(user)
        answers.append(await one(s, url, history, req.max_tokens, side))
        history += answers[-1] + "<|im_end|>\n"
    return answers


async def closed_loop(url: str, requests: list[Request], concurrency: int) -> Side:
    side = Side(outputs=[[] for _ in requests])
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(requests)):
        queue.put_nowait(i)
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=3600)) as s:
        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                side.outputs[i] = await run_request(s, url, requests[i], side)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        side.seconds = time.perf_counter() - t0
    return side


def run_side(args: argparse.Namespace, caching: bool, requests: list[Request],
             tmp: Path) -> Side:
    cfg = {"backend": "engine", "model": str(args.model), "served_model_name": "bench",
           "engine": {"max_num_seqs": max(args.concurrency, 4),
                      "max_num_batched_tokens": args.batched_tokens,
                      "kv_cache_tokens": args.kv_cache_tokens,
                      "max_model_len": args.max_model_len, "num_threads": args.threads,
                      "enable_prefix_caching": caching}}
    path = tmp / f"engine-{caching}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "engine", "--config", str(path), "--port",
                             str(args.port), "--log-level", "WARNING"], cwd=ROOT)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(url, proc, 300)
        warm = [Request(block_tokens(10**9 + i, 64), 4) for i in range(2)]  # not in the window
        asyncio.run(closed_loop(url, warm, 2))
        return asyncio.run(closed_loop(url, requests, args.concurrency))
    finally:
        proc.terminate()
        proc.wait(30)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q))


def report(name: str, sides: list[Side]) -> dict[str, float]:
    ttft = [t for s in sides for t in s.ttft_s]
    seconds = sum(s.seconds for s in sides)
    out = {"ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p90_ms": pct(ttft, 90) * 1e3,
           "ttft_mean_ms": statistics.fmean(ttft) * 1e3,
           "req_per_s": sum(len(s.ttft_s) for s in sides) / seconds,
           "out_tok_per_s": sum(s.num_output for s in sides) / seconds,
           "cached_share": sum(s.num_cached for s in sides) / sum(s.num_prompt for s in sides)}
    print(f"{name:>4}: TTFT p50 {out['ttft_p50_ms']:.1f} ms, p90 {out['ttft_p90_ms']:.1f} ms, "
          f"mean {out['ttft_mean_ms']:.1f} ms; {out['req_per_s']:.2f} req/s, "
          f"{out['out_tok_per_s']:.0f} output tok/s; prompt tokens cached "
          f"{100 * out['cached_share']:.1f}%", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(ROOT / "data"))
    p.add_argument("--workload", choices=("mooncake", "sessions"), default="mooncake")
    p.add_argument("--turns", type=int, default=4, help="turns per session (sessions)")
    p.add_argument("--model", default=str(TINY_TARGET))
    p.add_argument("--offset", type=int, default=3850, help="first trace row of the window")
    p.add_argument("--requests", type=int, default=128, help="requests, or sessions")
    p.add_argument("--block-tokens", type=int, default=32,
                   help="tokens per trace hash block (512 in the trace; scaled to fit)")
    p.add_argument("--max-tokens", type=int, default=32, help="cap on each output length")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="on/off pairs, order alternating")
    p.add_argument("--max-model-len", type=int, default=1056)
    p.add_argument("--kv-cache-tokens", type=int, default=65536)
    p.add_argument("--batched-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--port", type=int, default=18761)
    args = p.parse_args()

    if args.workload == "sessions":
        requests = load_sessions(Path(args.data) / "prompts" / "spec_bench_questions.jsonl",
                                 args.requests, args.turns, args.max_tokens)
        print(f"{len(requests)} chat sessions x {args.turns} turns, {args.max_tokens} output "
              f"tokens a turn; concurrency {args.concurrency}", flush=True)
    else:
        trace = Path(args.data) / "traces" / "mooncake_synthetic.jsonl"
        requests, ideal = load_requests(trace, args.offset, args.requests, args.block_tokens,
                                        args.max_model_len, args.max_tokens)
        lengths = [len(r.prompt or ()) for r in requests]
        print(f"{len(requests)} requests (trace rows {args.offset}..), prompt tokens median "
              f"{statistics.median(lengths):.0f} max {max(lengths)}; prefix hit rate with an "
              f"unbounded cache {100 * ideal:.1f}%; concurrency {args.concurrency}", flush=True)
    sides: dict[bool, list[Side]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for caching in ((True, False) if r % 2 == 0 else (False, True)):
                sides[caching].append(run_side(args, caching, requests, Path(tmp)))
                print(f"  round {r} caching={caching}: {sides[caching][-1].seconds:.1f} s",
                      flush=True)
    on, off = report("on", sides[True]), report("off", sides[False])
    same = all(a.outputs == b.outputs for a in sides[True] for b in sides[False])
    print(f"on/off: TTFT p50 {off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x faster, "
          f"p90 {off['ttft_p90_ms'] / on['ttft_p90_ms']:.2f}x, mean "
          f"{off['ttft_mean_ms'] / on['ttft_mean_ms']:.2f}x; throughput "
          f"{on['req_per_s'] / off['req_per_s']:.2f}x req/s, "
          f"{on['out_tok_per_s'] / off['out_tok_per_s']:.2f}x output tok/s; "
          f"greedy outputs identical: {same}")


if __name__ == "__main__":
    main()
