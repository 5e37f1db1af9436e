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
    python bench/proxy_overhead.py --no-working-tree --baseline-src /tmp/new --baseline-src /tmp/new \
        --baseline-src /tmp/base --prompts unique           # A/A pair + A/B, nothing else
    python bench/proxy_overhead.py --rounds 3                   # 3 sweeps, CPU ratios per round
    python bench/proxy_overhead.py --policies round_robin adaptive   # each proxy with both
    # a many-core machine: 4 upstream processes, the load from 6 processes, each on its core
    python bench/proxy_overhead.py --upstream-procs 4 --loadgen-procs 6 --rates 1000 2000 4000 \
        --vllm-router /path/to/vllm-router
    python bench/proxy_overhead.py --loadgen URL RATE SECONDS PROMPTS DATA OFFSET  # (internal)

Prompts (--prompts): ``fixed`` sends one short prompt every time (what the
earlier runs measured; the proxy's shape cache then always hits), ``real``
cycles through the 480 Spec-Bench prompts in data/ (repeats after
480 requests), ``shared`` appends the request number to a Spec-Bench prompt
(every prompt differs; its head repeats, as a system prompt or template
would), ``unique`` puts the request number first (nothing repeats: every
shape cache misses).

The proxy is pinned to one core (taskset) when there are at least two. With
enough cores (2 + upstream + load processes) it gets core 1 and every upstream
and load process a core of its own from core 2 on; otherwise the upstream and
load processes share core 1 (the 2-core dev box).
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
DATA = REPO / "data"  # --data: prompts/spec_bench_questions.jsonl
PROMPT_MODES = ("fixed", "real", "shared", "unique")


def payloads(mode: str, n: int, data: Path = DATA, start: int = 0) -> list[bytes]:
    """The bodies of requests ``start`` .. ``start + n - 1`` (serialised before the timed
    schedule starts)."""
    if mode == "fixed":
        return [json.dumps(BODY).encode()] * n
    spec_bench = data / "prompts" / "spec_bench_questions.jsonl"
    if not spec_bench.is_file():
        raise SystemExit(f"--prompts {mode} needs {spec_bench}")
    with open(spec_bench) as f:
        texts = [json.loads(line)["turns"][0] for line in f if line.strip()]
    out = []
    for i in range(start, start + n):
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


async def _load(url: str, rate: float, seconds: float, prompts: str, data: Path,
                offset: int = 0, connections: int = 0) -> dict:
    """One load process's raw samples (``offset``: its first request number, so that
    parallel load processes send different prompts; ``connections``: its pool's size, a
    request waiting for one of them when all are busy, its wait counted, every connection
    opened by the warm-up, as a client's pool is open before a surge; 0 = a new
    connection whenever none is idle)."""
    import aiohttp
    n = int(rate * seconds)
    warm = max(NUM_WARMUP, connections)
    out: list = []
    lags = []
    bodies = payloads(prompts, n + warm, data, offset)
    conn = aiohttp.TCPConnector(limit=connections, force_close=False)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=30)) as s:
        # warm-up: connections open (with a pool, all of them), caches warm
        await asyncio.gather(*(_one(s, url, bodies[n + i], []) for i in range(warm)))
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
    return {"sent": n, "num_total": n + warm, "wall_s": wall,
            "lag_ms": [round(x * 1e3, 4) for x in lags],
            "samples": [(None if t is None else round(t * 1e3, 4),
                         None if e is None else round(e * 1e3, 4), st) for t, e, st in out]}


def summarize(parts: list[dict]) -> dict:
    """The load processes' samples together: counts, achieved rate, percentiles (ms)."""
    samples = [s for p in parts for s in p["samples"]]
    wall = max(p["wall_s"] for p in parts)
    ok = [(t, e) for t, e, st in samples if st == 200 and t is not None]
    shed = sum(1 for _, _, st in samples if st in (429, 503))
    ttft = np.array([t for t, _ in ok])
    e2e = np.array([e for _, e in ok])

    def pct(a: np.ndarray, q: float) -> float | None:
        return float(np.percentile(a, q)) if len(a) else None
    sent = sum(p["sent"] for p in parts)
    return {"sent": sent, "ok": len(ok), "errors": len(samples) - len(ok) - shed, "shed": shed,
            "wall_s": wall,
            "num_total": sum(p["num_total"] for p in parts),  # warm-up included
            "achieved_rps": len(ok) / wall,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "e2e_p50_ms": pct(e2e, 50), "e2e_p99_ms": pct(e2e, 99),
            "send_lag_p99_ms": float(np.percentile(
                np.array([x for p in parts for x in p["lag_ms"]]), 99))}


def loadgen_main(url: str, rate: float, seconds: float, prompts: str, data: str,
                 offset: int, connections: int = 0) -> None:
    loop: asyncio.AbstractEventLoop
    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    print(json.dumps(loop.run_until_complete(
        _load(url, rate, seconds, prompts, Path(data), offset, connections))))


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
                    shape_estimator: str, source: Path | None = None, label: str = "",
                    policy: str = "round_robin", cgroup: Path | None = None) -> Target:
    """``source``: run the proxy from another source tree (e.g. an earlier commit), as
    target ``polyinfer<label>``; a ``policy`` other than round_robin adds ``/<policy>``;
    ``cgroup``: a cgroup folder the proxy starts in (its CPU quota, bench/overload.py)."""
    port = free_port()
    tag = f"{shape_estimator}-{port}"
    cfg = workdir / f"polyinfer-{tag}.yaml"
    cfg.write_text(f"""
server: {{host: 127.0.0.1, port: {port}}}
workers:
  - {{name: up, url: "{upstream}", config: {{backend: external, model: fake-fast}}}}
routing: {{policy: {policy}, shape_estimator: {shape_estimator}}}
traces: {{dir: "{workdir / 'traces'}"}}
""")
    # NOTE: the tree first; what the bench's own path adds (a --target install of the
    # wheels a machine lacks) stays reachable after it
    path = os.pathsep.join(p for p in (str(source), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path} if source else None
    cmd = pinned([PY, "-m", "proxy.cli", "--log-level", "WARNING", "serve",
                  "--config", str(cfg)], core)
    if cgroup is not None:  # the shell joins the cgroup, then becomes the proxy
        cmd = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *cmd]
    proc = subprocess.Popen(cmd,
                            cwd=workdir, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(workdir / f"polyinfer-{tag}.log", "w"))
    wait_up(proc, f"http://127.0.0.1:{port}/health")
    name = "polyinfer" if shape_estimator == "classifier" else f"polyinfer-{shape_estimator[:5]}"
    label += "" if policy == "round_robin" else f"/{policy}"
    return Target(name + label, f"http://127.0.0.1:{port}/v1/chat/completions", proc)


def source_labels(sources: list[Path]) -> list[str]:
    """``@<folder name>`` per source tree, ``#k`` added to repeats (an A/A pair)."""
    out: list[str] = []
    for src in sources:
        label = f"@{src.resolve().name}"
        num = sum(1 for x in out if x.split("#")[0] == label)
        out.append(label if num == 0 else f"{label}#{num + 1}")
    return out


def find_vllm_router(explicit: str | None = None) -> str | None:
    for cand in (explicit, shutil.which("vllm-router"), "/tmp/vr-venv/bin/vllm-router"):
        if cand and Path(cand).exists():
            return str(Path(cand).resolve())  # the proxies run in a temporary directory
    return None


def start_vllm_router(binary: str, upstream: str, workdir: Path, core: int | None) -> Target:
    port = free_port()
    # NOTE: its Prometheus exporter takes a fixed port unless told: two runs would collide
    proc = subprocess.Popen(pinned([binary, "--worker-urls", upstream, "--port", str(port),
                                    "--host", "127.0.0.1", "--policy", "round_robin",
                                    "--prometheus-port", str(free_port())], core),
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


@dataclass(frozen=True)
class Layout:
    """Which cores run what: each proxy on ``proxy``, the upstream and load processes on
    their own cores when there are enough (None = not pinned)."""

    proxy: int | None = None
    upstream: tuple[int | None, ...] = (None,)
    loadgen: tuple[int | None, ...] = (None,)

    @classmethod
    def plan(cls, ncpu: int, upstream_procs: int, loadgen_procs: int, pin: bool) -> Layout:
        if not pin or ncpu < 2:
            return cls(None, (None,) * upstream_procs, (None,) * loadgen_procs)
        if ncpu < 2 + upstream_procs + loadgen_procs:
            # the 2-core dev box: the proxy on core 0, everything else on core 1
            return cls(0, (1,) * upstream_procs, (1,) * loadgen_procs)
        # NOTE: core 0 left to the system (interrupts, the bench itself); the proxy on 1
        others = list(range(2, ncpu))
        return cls(1, tuple(others[:upstream_procs]),
                   tuple(others[upstream_procs:upstream_procs + loadgen_procs]))


def run_load(url: str, rate: float, seconds: float, prompts: str, data: Path,
             cores: tuple[int | None, ...]) -> dict:
    """``rate`` split over one load process per core in ``cores``, run together."""
    return summarize(load_parts(url, rate, seconds, prompts, data, cores))


_first_request = [0]  # the next request number: no two points send the same prompt


def load_parts(url: str, rate: float, seconds: float, prompts: str, data: Path,
               cores: tuple[int | None, ...], connections: int = 0) -> list[dict]:
    """Each load process's raw samples (:func:`run_load` without the summary);
    ``connections``: each process's connection pool (0 = unbounded, see :func:`_load`).

    NOTE: the request numbers go on from point to point (and round to round): with
    ``--prompts unique`` a proxy never sees a prompt twice, so its shape cache (4,096
    entries) never hits, in a second round either."""
    n = len(cores)
    per_proc = int(rate * seconds / n + NUM_WARMUP)
    first, _first_request[0] = _first_request[0], _first_request[0] + n * per_proc
    procs = [subprocess.Popen(pinned([PY, __file__, "--loadgen", url, str(rate / n),
                                      str(seconds), prompts, str(data),
                                      str(first + i * per_proc), str(connections)], core),
                              stdout=subprocess.PIPE, text=True)
             for i, core in enumerate(cores)]
    parts = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"load process failed ({proc.returncode})")
        parts.append(json.loads(out.strip().splitlines()[-1]))
    return parts


def measure(target: Target, rate: float, args: argparse.Namespace, layout: Layout) -> dict:
    before = cpu_seconds(target.proc.pid) if target.proc else 0.0
    res = run_load(target.url, rate, args.duration, args.prompts, args.data, layout.loadgen)
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
          layout: Layout) -> list[tuple[str, float, dict, dict]]:
    """Every target at every rate, targets one after another at each rate."""
    rows = []
    for rate in args.rates:
        direct = None
        for t in targets:
            if rate > t.max_rate:
                continue
            r = measure(t, rate, args, layout)
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


def start_upstreams(args: argparse.Namespace, layout: Layout) -> tuple[str, list[subprocess.Popen]]:
    """FakeFastUpstream processes sharing one port (SO_REUSEPORT when more than one)."""
    port = free_port()
    cmd = [PY, str(REPO / "bench" / "fake_upstream.py"), "--port", str(port),
           "--chunks", str(args.chunks),
           "--token-interval-ms", str(getattr(args, "token_interval_ms", 0.0))] \
        + (["--reuse-port"] if len(layout.upstream) > 1 else [])
    procs = [subprocess.Popen(pinned(cmd, core), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for core in layout.upstream]
    return f"http://127.0.0.1:{port}", procs


def start_targets(up_url: str, args: argparse.Namespace, workdir: Path,
                  core: int | None) -> list[Target]:
    targets = [Target("direct", f"{up_url}/v1/chat/completions", None)]
    for policy in args.policies:
        for estimator in [] if args.no_working_tree else args.shape_estimators:
            targets.append(start_polyinfer(up_url, workdir, core, estimator, policy=policy))
        for src, label in zip(args.baseline_src, source_labels(args.baseline_src), strict=True):
            targets.append(start_polyinfer(up_url, workdir, core, "classifier", src.resolve(),
                                           label, policy))
    peers = (("vllm-router", find_vllm_router(args.vllm_router), start_vllm_router,
              "not installed"),
             ("litellm", None if args.skip_litellm else find_litellm(), start_litellm,
              "not installed (or --skip-litellm)"))
    for name, binary, start, missing in peers:
        if not binary:
            print(f"# {name} {missing}: not compared")
            continue
        try:
            targets.append(start(binary, up_url, workdir, core))
        except RuntimeError as e:
            print(f"# {name} did not start: {e}")
    return targets


def print_doubling(rows: list[tuple[str, float, dict, dict]], names: list[str]) -> None:
    """Goodput when the offered rate doubles (flat or rising = no collapse past capacity)."""
    rates = sorted({rate for _, rate, _, _ in rows})
    pairs = [(r, 2 * r) for r in rates if 2 * r in rates]
    for name in names:
        good = {rate: r["achieved_rps"] for n, rate, r, _ in rows if n == name}
        for lo, hi in pairs:
            if lo in good and hi in good:
                print(f"# {name}: offered {lo:.0f} -> {hi:.0f} req/s: goodput {good[lo]:.0f} -> "
                      f"{good[hi]:.0f} ({good[hi] / max(good[lo], 1e-9):.2f}x)")


def orchestrate(args: argparse.Namespace) -> None:
    layout = Layout.plan(os.cpu_count() or 1, args.upstream_procs, args.loadgen_procs,
                         not args.no_pin)
    print(f"# cores: proxy {layout.proxy}, upstream {list(layout.upstream)}, "
          f"load {list(layout.loadgen)} (of {os.cpu_count()})", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    up_url, upstreams = start_upstreams(args, layout)
    targets: list[Target] = []
    try:
        wait_http(f"{up_url}/health")
        targets = start_targets(up_url, args, workdir, layout.proxy)
        rounds = []
        for i in range(args.rounds):
            rows = sweep(targets, args, layout)
            rounds.append(rows)
            print(f"# round {i + 1}/{args.rounds}: FakeFastUpstream, {args.chunks} chunks/stream, "
                  f"{args.duration:.0f} s per point, prompts {args.prompts}; proxy pinned to core "
                  f"{layout.proxy}; times in ms", flush=True)
            print_table(rows)
            for t in targets[1:]:
                print(f"# {t.name}: highest sustained rate tested = "
                      f"{sustained(rows, t.name)} req/s")
            print_doubling(rows, [t.name for t in targets])
        if args.rounds > 1:
            print_ratio_summary(rounds, [t.name for t in targets if t.proc is not None])
        (workdir / "results.json").write_text(json.dumps(rounds, indent=1))
        print(f"# raw results: {workdir / 'results.json'}")
    finally:
        for t in targets:
            if t.proc is not None:
                t.proc.terminate()
                t.proc.wait(timeout=30)
        for up in upstreams:
            up.terminate()
            up.wait(timeout=10)


def main() -> None:
    if len(sys.argv) == 9 and sys.argv[1] == "--loadgen":
        loadgen_main(sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5],
                     sys.argv[6], int(sys.argv[7]), int(sys.argv[8]))
        return
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=float, nargs="+", default=[50, 200, 500, 1000])
    p.add_argument("--duration", type=float, default=5.0, help="seconds per point")
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the whole sweep this many times with the same processes")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    p.add_argument("--upstream-procs", type=int, default=1,
                   help="FakeFastUpstream processes (one port, SO_REUSEPORT), each on its core")
    p.add_argument("--loadgen-procs", type=int, default=1,
                   help="load processes sharing each rate, each on its own core")
    p.add_argument("--vllm-router", default=None, metavar="CMD",
                   help="the vllm-router executable (default: PATH, /tmp/vr-venv/bin)")
    p.add_argument("--data", type=Path, default=DATA,
                   help="data dir with prompts/spec_bench_questions.jsonl (--prompts real...)")
    p.add_argument("--skip-litellm", action="store_true")
    p.add_argument("--baseline-src", type=Path, action="append", default=[],
                   help="also run polyinfer (classifier) from this source tree, e.g. "
                        "`git archive <commit> | tar -x -C DIR` (target polyinfer@DIR's "
                        "name); repeatable, the same tree twice is an A/A pair")
    p.add_argument("--prompts", choices=PROMPT_MODES, default="fixed",
                   help="fixed: one short prompt; real: Spec-Bench prompts cycled; shared: "
                        "each different, heads repeat; unique: nothing repeats")
    p.add_argument("--no-working-tree", action="store_true",
                   help="run polyinfer only from the --baseline-src trees")
    p.add_argument("--shape-estimators", nargs="+", default=["classifier", "heuristic"],
                   choices=["classifier", "heuristic"],
                   help="polyinfer variants: router classifier (default config) and/or the "
                        "cheap heuristic shape estimator")
    p.add_argument("--policies", nargs="+", default=["round_robin"], metavar="POLICY",
                   help="routing policies: every polyinfer target once per policy (round_robin "
                        "as before; e.g. adaptive, the serve default, adds targets "
                        "polyinfer.../adaptive)")
    orchestrate(p.parse_args())


if __name__ == "__main__":
    main()
