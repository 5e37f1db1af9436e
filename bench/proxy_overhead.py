"""Proxy overhead: the same open-loop streaming load, direct and through each proxy.

Every run starts a FakeFastUpstream (bench/fake_upstream.py: streams a fixed
number of chunks at once), then for each target (direct, polyinfer, and
vllm-router when its binary is found) and each request rate, a load
generator in its own process sends streaming chat requests on a fixed
schedule and measures TTFT (first body byte) and E2E. litellm's proxy joins
when its `litellm` binary is found (PATH or /tmp/litellm-venv), at rates up to
200 req/s. Printed side by side:
added TTFT / E2E p50 and p99 versus direct, achieved rate, and the proxy's
CPU seconds per request (from /proc/<pid>/stat, user + system).

    python bench/proxy_overhead.py                       # rates 50 200 500 1000
    python bench/proxy_overhead.py --rates 200 500 1000 2000 --duration 10
    python bench/proxy_overhead.py --prompts unique              # every prompt different
    python bench/proxy_overhead.py --baseline-src /tmp/base     # + polyinfer from another tree
    python bench/proxy_overhead.py --rounds 3                   # 3 sweeps, CPU ratios per round
    python bench/proxy_overhead.py --loadgen URL RATE SECONDS PROMPTS   # (internal) one load run

Prompts (--prompts): ``fixed`` sends one short prompt every time (what the
earlier runs measured; the proxy's shape cache then always hits), ``real``
cycles through the 480 Spec-Bench prompts in ../shared/data (repeats after
480 requests), ``shared`` appends the request number to a Spec-Bench prompt
(every prompt differs; its head repeats, as a system prompt or template
would), ``unique`` puts the request number first (nothing repeats: every
shape cache misses).

The proxy is pinned to one core (taskset) when there are at least two, and
the upstream + load generator share the others.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
NUM_WARMUP = 50  # requests sent before the timed schedule (connections opened, caches warm)
PY = sys.executable
BODY = {"model": "fake-fast", "stream": True, "max_tokens": 16,
        "messages": [{"role": "user", "content": "Say hello in sixteen short words, please."}]}
SPEC_BENCH = REPO.parent / "shared" / "data" / "prompts" / "spec_bench_questions.jsonl"
PROMPT_MODES = ("fixed", "real", "shared", "unique")


def payloads(mode: str, n: int) -> list[bytes]:
    """``n`` request bodies (serialised before the timed schedule starts)."""
    if mode == "fixed":
        return [json.dumps(BODY).encode()] * n
    if not SPEC_BENCH.is_file():
        raise SystemExit(f"--prompts {mode} needs {SPEC_BENCH}")
    with open(SPEC_BENCH) as f:
        texts = [json.loads(line)["turns"][0] for line in f if line.strip()]
    out = []
    for i in range(n):
        text = texts[i % len(texts)]
        if mode == "shared":
            text = f"{text}\n(request {i})"
        elif mode == "unique":
            text = f"(request {i}) {text}"
        out.append(json.dumps({**BODY, "messages": [{"role": "user", "content": text}]}).encode())
    return out


# -- load generator (runs in its own process) ------------------------------------------------

async def _one(session, url: str, payload: bytes, out: list) -> None:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    ttft = None
    try:
        async with session.post(url, data=payload,
                                headers={"Content-Type": "application/json"}) as r:
            status = r.status
            async for _chunk in r.content.iter_any():
                if ttft is None:
                    ttft = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 (counted, not raised: the run goes on)
        out.append((None, None, type(e).__name__))
        return
    out.append((ttft, time.perf_counter() - t0, status))


async def _load(url: str, rate: float, seconds: float, prompts: str) -> dict:
    import aiohttp
    n = int(rate * seconds)
    out: list = []
    lags = []
    bodies = payloads(prompts, n + NUM_WARMUP)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=30)) as s:
        # warm-up: open connections, JIT-less but caches warm
        await asyncio.gather(*(_one(s, url, bodies[n + i], []) for i in range(NUM_WARMUP)))
        tasks = []
        start = time.perf_counter()
        for i in range(n):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append(time.perf_counter() - due)
            tasks.append(asyncio.create_task(_one(s, url, bodies[i], out)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    ok = [(t, e) for t, e, st in out if st == 200 and t is not None]
    shed = sum(1 for _, _, st in out if st in (429, 503))
    errors = len(out) - len(ok) - shed
    ttft = np.array([t for t, _ in ok]) * 1e3
    e2e = np.array([e for _, e in ok]) * 1e3

    def pct(a: np.ndarray, q: float) -> float | None:
        return float(np.percentile(a, q)) if len(a) else None
    return {"sent": n, "ok": len(ok), "errors": errors, "shed": shed, "wall_s": wall,
            "num_total": n + NUM_WARMUP,  # every request the proxy handled, warm-up included
            "achieved_rps": len(ok) / wall,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "e2e_p50_ms": pct(e2e, 50), "e2e_p99_ms": pct(e2e, 99),
            "send_lag_p99_ms": float(np.percentile(np.array(lags) * 1e3, 99))}


def loadgen_main(url: str, rate: float, seconds: float, prompts: str) -> None:
    loop: asyncio.AbstractEventLoop
    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    print(json.dumps(loop.run_until_complete(_load(url, rate, seconds, prompts))))


# -- orchestration ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_up(proc: subprocess.Popen, url: str, timeout_s: float = 180) -> None:
    """Wait for ``url``; stop ``proc`` if it never answers (no orphans on a failed start)."""
    try:
        wait_http(url, timeout_s)
    except RuntimeError:
        proc.terminate()
        proc.wait(timeout=30)
        raise


def wait_http(url: str, timeout_s: float = 60) -> None:
    import urllib.request
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def _descendants(pid: int) -> list[int]:
    out = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            out += _descendants(int(child))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its live descendants (a proxy's workers)."""
    total = 0
    for p in _descendants(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def pinned(cmd: list[str], core: int | None) -> list[str]:
    if core is None or shutil.which("taskset") is None:
        return cmd
    return ["taskset", "-c", str(core), *cmd]


@dataclass
class Target:
    name: str
    url: str  # chat completions URL
    proc: subprocess.Popen | None  # the proxy process (None = direct)
    max_rate: float = float("inf")  # not offered more than this (it would only time out)


def start_polyinfer(upstream: str, workdir: Path, core: int | None,
                    shape_estimator: str, source: Path | None = None) -> Target:
    """``source``: run the proxy from another source tree (e.g. an earlier commit)."""
    port = free_port()
    tag = shape_estimator + ("-base" if source else "")
    cfg = workdir / f"polyinfer-{tag}.yaml"
    cfg.write_text(f"""
server: {{host: 127.0.0.1, port: {port}}}
workers:
  - {{name: up, url: "{upstream}", config: {{backend: external, model: fake-fast}}}}
routing: {{policy: round_robin, shape_estimator: {shape_estimator}}}
traces: {{dir: "{workdir / 'traces'}"}}
""")
    env = {**os.environ, "PYTHONPATH": str(source)} if source else None
    proc = subprocess.Popen(pinned([PY, "-m", "proxy.cli", "--log-level", "WARNING", "serve",
                                    "--config", str(cfg)], core),
                            cwd=workdir, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(workdir / f"polyinfer-{tag}.log", "w"))
    wait_up(proc, f"http://127.0.0.1:{port}/health")
    name = "polyinfer" if shape_estimator == "classifier" else f"polyinfer-{shape_estimator[:5]}"
    return Target(name + ("-base" if source else ""),
                  f"http://127.0.0.1:{port}/v1/chat/completions", proc)


def find_vllm_router() -> str | None:
    for cand in (shutil.which("vllm-router"), "/tmp/vr-venv/bin/vllm-router"):
        if cand and Path(cand).exists():
            return cand
    return None


def start_vllm_router(binary: str, upstream: str, workdir: Path, core: int | None) -> Target:
    port = free_port()
    proc = subprocess.Popen(pinned([binary, "--worker-urls", upstream, "--port", str(port),
                                    "--host", "127.0.0.1", "--policy", "round_robin"], core),
                            cwd=workdir, stdout=open(workdir / "vllm-router.log", "w"),
                            stderr=subprocess.STDOUT)
    wait_up(proc, f"http://127.0.0.1:{port}/health")
    return Target("vllm-router", f"http://127.0.0.1:{port}/v1/chat/completions", proc)


def find_litellm() -> str | None:
    for cand in (shutil.which("litellm"), "/tmp/litellm-venv/bin/litellm"):
        if cand and Path(cand).exists():
            return cand
    return None


def start_litellm(binary: str, upstream: str, workdir: Path, core: int | None) -> Target:
    port = free_port()
    cfg = workdir / "litellm.yaml"
    cfg.write_text(f"""model_list:
  - model_name: fake-fast
    litellm_params: {{model: openai/fake-fast, api_base: "{upstream}/v1", api_key: none}}
litellm_settings: {{telemetry: false}}
""")
    env = {**os.environ, "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False"}
    proc = subprocess.Popen(pinned([binary, "--config", str(cfg), "--port", str(port),
                                    "--host", "127.0.0.1", "--num_workers", "1"], core),
                            cwd=workdir, env=env, stdout=open(workdir / "litellm.log", "w"),
                            stderr=subprocess.STDOUT)
    wait_up(proc, f"http://127.0.0.1:{port}/health/liveliness")
    return Target("litellm", f"http://127.0.0.1:{port}/v1/chat/completions", proc,
                  max_rate=200)


def run_load(url: str, rate: float, seconds: float, prompts: str, core: int | None) -> dict:
    out = subprocess.run(pinned([PY, __file__, "--loadgen", url, str(rate), str(seconds),
                                 prompts], core),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(target: Target, rate: float, seconds: float, prompts: str,
            core: int | None) -> dict:
    before = cpu_seconds(target.proc.pid) if target.proc else 0.0
    res = run_load(target.url, rate, seconds, prompts, core)
    if target.proc:
        res["cpu_ms_per_req"] = (cpu_seconds(target.proc.pid) - before) * 1e3 / res["num_total"]
    return res


def fmt(v: float | None, nd: int = 2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def cpu_ratio(rows: list[tuple[str, float, dict, dict]], name: str, rate: float,
              peer: str) -> float | None:
    """``name``'s CPU per request over ``peer``'s at the same rate and round."""
    def cpu(n: str) -> float | None:
        return next((r.get("cpu_ms_per_req") for t, rt, r, _ in rows if t == n and rt == rate),
                    None)
    mine, theirs = cpu(name), cpu(peer)
    return None if mine is None or not theirs else mine / theirs


def print_table(rows: list[tuple[str, float, dict, dict]]) -> None:
    print(f"{'target':<16}{'rate':>6}{'goodput':>9}{'err':>5}{'shed':>6}{'ttft p50':>9}{'p99':>8}"
          f"{'e2e p50':>9}{'p99':>8}{'+ttft p50':>10}{'+p99':>8}{'+e2e p50':>9}{'+p99':>8}"
          f"{'cpu ms/req':>11}{'/vllm-router':>13}")
    for name, rate, r, d in rows:
        add = {k: (r[k] - d[k]) if r[k] is not None and d[k] is not None else None
               for k in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms")}
        direct = name == "direct"
        print(f"{name:<16}{rate:>6.0f}{r['achieved_rps']:>9.0f}{r['errors']:>5}{r['shed']:>6}"
              f"{fmt(r['ttft_p50_ms']):>9}{fmt(r['ttft_p99_ms']):>8}{fmt(r['e2e_p50_ms']):>9}"
              f"{fmt(r['e2e_p99_ms']):>8}"
              + ("" if direct else f"{fmt(add['ttft_p50_ms']):>10}{fmt(add['ttft_p99_ms']):>8}"
                 f"{fmt(add['e2e_p50_ms']):>9}{fmt(add['e2e_p99_ms']):>8}"
                 f"{fmt(r.get('cpu_ms_per_req'), 3):>11}"
                 f"{fmt(cpu_ratio(rows, name, rate, 'vllm-router')):>13}"))


def sustained(rows: list[tuple[str, float, dict, dict]], name: str) -> float | None:
    """Highest offered rate that the target kept up with (>= 95% achieved, no errors)."""
    good = [rate for n, rate, r, _ in rows
            if n == name and r["errors"] == 0 and r["shed"] == 0
            and r["achieved_rps"] >= 0.95 * rate]
    return max(good) if good else None


def sweep(targets: list[Target], args: argparse.Namespace,
          core: int | None) -> list[tuple[str, float, dict, dict]]:
    """Every target at every rate, targets one after another at each rate."""
    rows = []
    for rate in args.rates:
        direct = None
        for t in targets:
            if rate > t.max_rate:
                continue
            r = measure(t, rate, args.duration, args.prompts, core)
            direct = r if t.name == "direct" else direct
            assert direct is not None
            rows.append((t.name, rate, r, direct))
    return rows


def print_ratio_summary(rounds: list[list[tuple[str, float, dict, dict]]],
                        names: list[str]) -> None:
    """CPU per request over vllm-router's, per target and rate, one column per round."""
    print("# CPU per request / vllm-router's, per round (median last)")
    for name in names:
        if name == "vllm-router":
            continue
        for rate in sorted({rate for rows in rounds for _, rate, _, _ in rows}):
            ratios = [cpu_ratio(rows, name, rate, "vllm-router") for rows in rounds]
            got = [x for x in ratios if x is not None]
            if got:
                print(f"{name:<16}{rate:>6.0f}  " + "  ".join(fmt(x) for x in ratios)
                      + f"  | median {float(np.median(got)):.2f}")


def orchestrate(args: argparse.Namespace) -> None:
    ncpu = os.cpu_count() or 1
    proxy_core, other_core = (0, 1) if ncpu >= 2 and not args.no_pin else (None, None)
    workdir = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    up_port = free_port()
    upstream = subprocess.Popen(pinned([PY, str(REPO / "bench" / "fake_upstream.py"), "--port",
                                        str(up_port), "--chunks", str(args.chunks)], other_core),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    up_url = f"http://127.0.0.1:{up_port}"
    targets: list[Target] = []
    try:
        wait_http(f"{up_url}/health")
        targets.append(Target("direct", f"{up_url}/v1/chat/completions", None))
        for estimator in args.shape_estimators:
            targets.append(start_polyinfer(up_url, workdir, proxy_core, estimator))
        if args.baseline_src:
            targets.append(start_polyinfer(up_url, workdir, proxy_core, "classifier",
                                           args.baseline_src.resolve()))
        binary = find_vllm_router()
        if binary:
            try:
                targets.append(start_vllm_router(binary, up_url, workdir, proxy_core))
            except RuntimeError as e:
                print(f"# vllm-router did not start: {e}")
        else:
            print("# vllm-router not installed: not compared")
        litellm = find_litellm() if not args.skip_litellm else None
        if litellm:
            try:
                targets.append(start_litellm(litellm, up_url, workdir, proxy_core))
            except RuntimeError as e:
                print(f"# litellm did not start: {e}")
        else:
            print("# litellm not installed (or --skip-litellm): not compared")
        rounds = []
        for i in range(args.rounds):
            rows = sweep(targets, args, other_core)
            rounds.append(rows)
            print(f"# round {i + 1}/{args.rounds}: FakeFastUpstream, {args.chunks} chunks/stream, "
                  f"{args.duration:.0f} s per point, prompts {args.prompts}; proxy pinned to core "
                  f"{proxy_core}; times in ms", flush=True)
            print_table(rows)
            for t in targets[1:]:
                print(f"# {t.name}: highest sustained rate tested = "
                      f"{sustained(rows, t.name)} req/s")
        if args.rounds > 1:
            print_ratio_summary(rounds, [t.name for t in targets if t.proc is not None])
        (workdir / "results.json").write_text(json.dumps(rounds, indent=1))
        print(f"# raw results: {workdir / 'results.json'}")
    finally:
        for t in targets:
            if t.proc is not None:
                t.proc.terminate()
                t.proc.wait(timeout=30)
        upstream.terminate()
        upstream.wait(timeout=10)


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--loadgen":
        loadgen_main(sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
        return
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=float, nargs="+", default=[50, 200, 500, 1000])
    p.add_argument("--duration", type=float, default=5.0, help="seconds per point")
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the whole sweep this many times with the same processes")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    p.add_argument("--skip-litellm", action="store_true")
    p.add_argument("--baseline-src", type=Path, default=None,
                   help="also run polyinfer (classifier) from this source tree, e.g. "
                        "`git archive <commit> | tar -x -C DIR` (target polyinfer-base)")
    p.add_argument("--prompts", choices=PROMPT_MODES, default="fixed",
                   help="fixed: one short prompt; real: Spec-Bench prompts cycled; shared: "
                        "each different, heads repeat; unique: nothing repeats")
    p.add_argument("--shape-estimators", nargs="+", default=["classifier", "heuristic"],
                   choices=["classifier", "heuristic"],
                   help="polyinfer variants: router classifier (default config) and/or the "
                        "cheap heuristic shape estimator")
    orchestrate(p.parse_args())


if __name__ == "__main__":
    main()
