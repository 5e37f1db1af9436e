"""Proxy CPU per streamed request, paired: proxies from several source trees side by side.

For a noisy, shared machine (the 2-core dev box): every tree's proxy runs at once behind
one FakeFastUpstream (bench/fake_upstream.py, 16 SSE chunks + usage per stream), and one
open-loop load (streamed chat requests, every prompt new: Spec-Bench questions with the
request number first, no number sent twice) is dealt out request by request, request i
to proxy (i + w) mod k in window w. Each proxy's CPU (all its threads, from
/proc/<pid>/task/*/schedstat, nanoseconds) is read around each window, so every proxy
pays for the same moments of the machine's noise; the ratios to the first tree are per
window (window 0 warms up and is not counted). Name a tree twice for an A/A pair.

    python bench/proxy_cpu.py --tree /tmp/base --tree /tmp/new --tree /tmp/base --tree /tmp/new
    python bench/proxy_cpu.py --tree /tmp/base --tree /tmp/new --rate 800 --windows 10
    python bench/proxy_cpu.py --bytecodes --tree /tmp/base --tree /tmp/new   # counted, not timed
    python bench/proxy_cpu.py --bytecodes --functions 30 --tree .             # where they go

``--bytecodes`` instead runs each proxy under a ``sys.settrace`` counter (bytecodes and
Python calls of the event loop's thread; its C work and system calls are not counted) at
a low rate, one tree after another on the same prompts: a count that barely moves with
the machine's load (only through how many socket reads a stream takes). Functions called less than once per two requests (timers, probes,
the trace writer's flushes) are left out of the per-request totals.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import proxy_overhead as po  # noqa: E402

FIRST_REQUEST = 20_000_000  # request numbers from here: far from proxy_overhead's


def cpu_ns(pid: int) -> int:
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except OSError:
            continue
    return total


async def _window(session, urls: list[str], bodies: list[bytes], rate: float,  # type: ignore[no-untyped-def]
                  shift: int) -> list:
    out: list = []
    tasks = []
    start = time.perf_counter()
    for i, body in enumerate(bodies):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(po._one(session, urls[(i + shift) % len(urls)], body,
                                                 out)))
    await asyncio.gather(*tasks)
    return out


async def paired(targets: list[po.Target], args: argparse.Namespace) -> list[list[float]]:
    import aiohttp
    k = len(targets)
    n = int(args.rate * args.seconds)
    first = FIRST_REQUEST
    per_tree: list[list[float]] = [[] for _ in targets]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for w in range(args.windows + 1):
            bodies = po.payloads("unique", n, args.data, first)
            first += n
            before = [cpu_ns(t.proc.pid) for t in targets if t.proc]
            out = await _window(s, [t.url for t in targets], bodies, args.rate, w % k)
            await asyncio.sleep(0.3)  # the last records and the trace writer's flush
            after = [cpu_ns(t.proc.pid) for t in targets if t.proc]
            errors = sum(1 for r in out if r[2] != 200)
            ms = [(a - b) * 1e-6 / (n / k) for a, b in zip(after, before, strict=True)]
            print(f"window {w}{' (warm-up)' if not w else ''}: "
                  + "  ".join(f"{t.name} {x:.4f}" for t, x in zip(targets, ms, strict=True))
                  + f"  ms/req; errors {errors}", flush=True)
            if w:
                for got, x in zip(per_tree, ms, strict=True):
                    got.append(x)
    return per_tree


def print_paired(targets: list[po.Target], per_tree: list[list[float]]) -> None:
    for t, got in zip(targets, per_tree, strict=True):
        print(f"{t.name:<28} CPU ms/req median {statistics.median(got):.4f} "
              f"mean {statistics.mean(got):.4f}")
    for j in range(1, len(targets)):
        ratios = [x[j] / x[0] for x in zip(*per_tree, strict=True)]
        print(f"{targets[j].name} / {targets[0].name}: median {statistics.median(ratios):.3f} "
              f"(per window {min(ratios):.3f}-{max(ratios):.3f})")


# -- bytecode counts --------------------------------------------------------------------------

_COUNTER = '''
import asyncio, collections, json, signal, sys
sys.path.insert(0, sys.argv[3])
from proxy.config import ProxyConfig
from proxy.server import run, serve_until_signal
ops, calls = collections.Counter(), collections.Counter()
def tracer(frame, event, arg):
    if event == "call":
        calls[frame.f_code.co_filename + ":" + frame.f_code.co_name] += 1
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        return local
def local(frame, event, arg):
    if event == "opcode":
        ops[frame.f_code.co_filename + ":" + frame.f_code.co_name] += 1
    return local
def stop():
    sys.settrace(None)
    with open(sys.argv[2], "w") as f:
        json.dump({"ops": ops, "calls": calls}, f)
async def main():
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: sys.settrace(tracer))
    loop.add_signal_handler(signal.SIGUSR2, stop)
    await serve_until_signal(ProxyConfig.load(sys.argv[1]))
run(main)
'''


def count_bytecodes(tree: Path, up_url: str, workdir: Path, args: argparse.Namespace,
                    label: str) -> dict[str, Any]:
    """Bytecodes and calls per request of one tree's proxy (keys ``ops``, ``calls``)."""
    port = po.free_port()
    cfg = workdir / f"count-{port}.yaml"
    cfg.write_text(f"""
server: {{host: 127.0.0.1, port: {port}}}
workers:
  - {{name: up, url: "{up_url}", config: {{backend: external, model: fake-fast}}}}
routing: {{policy: {args.policy}, shape_estimator: classifier}}
traces: {{dir: "{workdir / 'traces'}"}}
""")
    script = workdir / "counter.py"
    script.write_text(_COUNTER)
    out = workdir / f"counts-{port}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen([po.PY, str(script), str(cfg), str(out), str(tree)], cwd=workdir,
                            env=env, stdout=subprocess.DEVNULL,
                            stderr=open(workdir / f"count-{port}.log", "w"))
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        po.wait_up(proc, f"http://127.0.0.1:{port}/health")
        po.run_load(url, 50, 1, "unique", args.data, (None,))  # connections, caches
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        n = po.NUM_WARMUP + int(args.count_rate * args.count_seconds)
        res = po.summarize([json.loads(subprocess.run(
            [po.PY, po.__file__, "--loadgen", url, str(args.count_rate), str(args.count_seconds),
             "unique", str(args.data), str(FIRST_REQUEST), "0"], capture_output=True, text=True,
            check=True).stdout.strip().splitlines()[-1])])
        proc.send_signal(signal.SIGUSR2)
        for _ in range(100):
            if out.exists() and out.stat().st_size:
                break
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if res["ok"] != n - po.NUM_WARMUP or res["errors"]:
        raise RuntimeError(f"{label}: {res['ok']} ok of {n}, {res['errors']} errors")
    data = json.loads(out.read_text())
    per_request: dict[str, Any] = {}
    for kind in ("ops", "calls"):
        counts = data[kind]
        path = {k: v for k, v in counts.items() if data["calls"].get(k, 0) >= n / 2}
        per_request[kind] = sum(path.values()) / n
        per_request[f"{kind}_by_file"] = collections.Counter()
        per_request[f"{kind}_by_function"] = collections.Counter()
        for k, v in path.items():
            name = k.replace(str(tree) + "/", "")
            per_request[f"{kind}_by_file"][name.split(":")[0]] += v / n
            per_request[f"{kind}_by_function"][name] += v / n
    return per_request


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", type=Path, action="append", required=True,
                   help="a source tree to run the proxy from (repeat; the first is the base)")
    p.add_argument("--rate", type=float, default=800, help="req/s, all proxies together")
    p.add_argument("--seconds", type=float, default=4.0, help="per window")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--policy", default="round_robin")
    p.add_argument("--data", type=Path, default=po.DATA)
    p.add_argument("--bytecodes", action="store_true", help="count, one tree at a time")
    p.add_argument("--count-rate", type=float, default=15)
    p.add_argument("--count-seconds", type=float, default=10)
    p.add_argument("--functions", type=int, default=0,
                   help="--bytecodes: also the N functions with the most bytecodes a request")
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="proxy-cpu-"))
    port = po.free_port()
    up = subprocess.Popen([po.PY, str(po.REPO / "bench" / "fake_upstream.py"), "--port",
                           str(port), "--chunks", "16"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    up_url = f"http://127.0.0.1:{port}"
    labels = po.source_labels(args.tree)
    targets: list[po.Target] = []
    try:
        po.wait_http(f"{up_url}/health")
        if args.bytecodes:
            counts = [count_bytecodes(t.resolve(), up_url, workdir, args, label)
                      for t, label in zip(args.tree, labels, strict=True)]
            base = counts[0]
            for label, c in zip(labels, counts, strict=True):
                print(f"{label:<20} bytecodes/req {c['ops']:7.0f} ({c['ops'] / base['ops'] - 1:+.1%})"
                      f"  Python calls/req {c['calls']:6.1f} ({c['calls'] / base['calls'] - 1:+.1%})")
            files = sorted(base["ops_by_file"], key=lambda f: -base["ops_by_file"][f])[:14]
            print("bytecodes/req by file: " + "  ".join(labels))
            for f in files:
                print(f"  {f:<34}" + "".join(f"{c['ops_by_file'].get(f, 0):9.0f}" for c in counts))
            if args.functions:
                by_fn = base["ops_by_function"]
                print("bytecodes/req by function (own, not callees'; calls/req of the first): "
                      + "  ".join(labels))
                for f in sorted(by_fn, key=lambda f: -by_fn[f])[:args.functions]:
                    print(f"  {f[-60:]:<60}" + "".join(
                        f"{c['ops_by_function'].get(f, 0):8.0f}" for c in counts)
                        + f"  ({base['calls_by_function'].get(f, 0):.1f})")
            return
        for t, label in zip(args.tree, labels, strict=True):
            targets.append(po.start_polyinfer(up_url, workdir, None, "classifier", t.resolve(),
                                              label, args.policy))
        per_tree = asyncio.run(paired(targets, args))
        print(f"# {args.rate:.0f} req/s over {len(targets)} proxies, {args.seconds:g} s x "
              f"{args.windows} windows, every prompt new, policy {args.policy}")
        print_paired(targets, per_tree)
    finally:
        for t in targets:
            if t.proc is not None:
                t.proc.terminate()
                t.proc.wait(timeout=30)
        up.terminate()
        up.wait(timeout=10)


if __name__ == "__main__":
    main()
