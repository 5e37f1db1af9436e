"""Overload: polyinfer at 3x its capacity, on its own core, in front of an instant upstream.

DESIGN's target: past capacity the proxy sheds load (429/503 with Retry-After) instead of
collapsing: at 3x capacity goodput >= 0.9x of capacity, accepted requests keep a bounded
p99, and the proxy's own load never marks its healthy worker down.

Capacity is measured first: offered rates rise by ``--step`` from ``--start`` until the
proxy no longer keeps up (goodput under 95% of the offered rate, or any refusal), and the
highest goodput seen is the capacity (streaming chat, bench/proxy_overhead.py's open-loop
load processes, FakeFastUpstream processes). Then the load is held at ``--factor`` x that
for ``--overload-duration`` seconds and the run prints goodput / capacity, the p50 / p99 of
the accepted (200) requests beside the capacity point's, the answers by status, the load
processes' send lag (they must not be the bottleneck), and what the proxy's /stats says
about shedding, its in-flight limit, connections and its worker (probe, breaker, healthy).

    python bench/overload.py                          # 2000 req/s x1.25 until saturated, then 3x
    python bench/overload.py --sweep 2000 2500 3000 --duration 10 --prompts unique
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_overhead as po  # noqa: E402  (a bench sibling, not a package)


def summary(parts: list[dict], rate: float) -> dict:
    samples = [s for p in parts for s in p["samples"]]
    wall = max(p["wall_s"] for p in parts)
    ok_e2e = np.array([e for _, e, st in samples if st == 200 and e is not None])
    ok_ttft = np.array([t for t, _, st in samples if st == 200 and t is not None])
    by_status: dict[str, int] = {}
    for _, _, st in samples:
        by_status[str(st)] = by_status.get(str(st), 0) + 1

    def pct(a: np.ndarray, q: float) -> float | None:
        return round(float(np.percentile(a, q)), 2) if len(a) else None
    lags = np.array([x for p in parts for x in p["lag_ms"]])
    return {"offered_rps": rate, "goodput_rps": round(len(ok_e2e) / wall, 1),
            "by_status": by_status, "e2e_p50_ms": pct(ok_e2e, 50),
            "e2e_p99_ms": pct(ok_e2e, 99), "ttft_p99_ms": pct(ok_ttft, 99),
            "e2e_max_ms": pct(ok_e2e, 100), "send_lag_p99_ms": pct(lags, 99)}


def saturated(row: dict) -> bool:
    """The proxy did not keep up with the offered rate, or refused some of it."""
    num_other = sum(n for st, n in row["by_status"].items() if st != "200")
    return row["goodput_rps"] < 0.95 * row["offered_rps"] or num_other > 0


def proxy_stats(url: str) -> dict:
    with urllib.request.urlopen(url.replace("/v1/chat/completions", "/stats"), timeout=10) as r:
        doc = json.loads(r.read())
    worker = doc["workers"][0] if isinstance(doc.get("workers"), list) else \
        next(iter(doc.get("workers", {}).values()), {})
    return {"shed_at_door": doc.get("shed_at_door"),
            "in_flight_limit": doc.get("in_flight_limit"),
            "connections": doc.get("connections"), "loop_lag_ms": doc.get("loop_lag_ms"),
            "worker": {k: worker.get(k) for k in ("healthy", "probe_ok", "breaker")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", type=float, nargs="+", default=None,
                   help="offered rates (req/s) whose best goodput is the capacity "
                        "(default: --start, x --step, until saturated)")
    p.add_argument("--start", type=float, default=2000.0)
    p.add_argument("--step", type=float, default=1.25)
    p.add_argument("--max-points", type=int, default=10)
    p.add_argument("--duration", type=float, default=5.0, help="seconds per sweep point")
    p.add_argument("--overload-duration", type=float, default=20.0,
                   help="seconds at 3x capacity")
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--upstream-procs", type=int, default=4)
    p.add_argument("--loadgen-procs", type=int, default=6)
    p.add_argument("--prompts", choices=po.PROMPT_MODES, default="fixed")
    p.add_argument("--shape-estimator", default="classifier")
    p.add_argument("--data", type=Path, default=po.DATA)
    p.add_argument("--source", type=Path, default=None,
                   help="run the proxy from another source tree (e.g. an earlier commit)")
    args = p.parse_args()
    layout = po.Layout.plan(os.cpu_count() or 1, args.upstream_procs, args.loadgen_procs, True)
    print(f"# cores: proxy {layout.proxy}, upstream {list(layout.upstream)}, "
          f"load {list(layout.loadgen)} (of {os.cpu_count()})", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="overload-"))
    up_url, upstreams = po.start_upstreams(args, layout)
    target = None
    rows = []
    try:
        po.wait_http(f"{up_url}/health")
        # NOTE: the tree always named: the proxy runs in workdir, where a relative
        # PYTHONPATH entry (".") no longer finds it unless the project is installed
        target = po.start_polyinfer(up_url, workdir, layout.proxy, args.shape_estimator,
                                    (args.source or po.REPO).resolve())
        rates = args.sweep or [args.start * args.step ** i for i in range(args.max_points)]
        for rate in rates:
            row = summary(po.load_parts(target.url, round(rate), args.duration, args.prompts,
                                        args.data, layout.loadgen), round(rate))
            rows.append(row)
            print(json.dumps(row), flush=True)
            time.sleep(1)
            if args.sweep is None and saturated(row):
                break
        best = max(rows, key=lambda r: r["goodput_rps"])
        capacity = best["goodput_rps"]
        rate = args.factor * capacity
        print(f"# capacity {capacity:.0f} req/s; holding {rate:.0f} req/s for "
              f"{args.overload_duration:.0f} s", flush=True)
        over = summary(po.load_parts(target.url, rate, args.overload_duration, args.prompts,
                            args.data, layout.loadgen), rate)
        over["goodput_over_capacity"] = round(over["goodput_rps"] / max(capacity, 1e-9), 3)
        over["capacity_point"] = {k: best[k] for k in ("offered_rps", "goodput_rps",
                                                        "e2e_p50_ms", "e2e_p99_ms")}
        over["p99_over_capacity_p99"] = round(over["e2e_p99_ms"] / best["e2e_p99_ms"], 1) \
            if over["e2e_p99_ms"] and best["e2e_p99_ms"] else None
        over["proxy"] = proxy_stats(target.url)
        print(json.dumps(over), flush=True)
        (workdir / "overload.json").write_text(json.dumps({"sweep": rows, "overload": over}))
        print(f"# raw: {workdir / 'overload.json'}; proxy log {workdir}/polyinfer-*.log")
    finally:
        if target is not None and target.proc is not None:
            target.proc.terminate()
            target.proc.wait(timeout=30)
        for up in upstreams:
            up.terminate()
            up.wait(timeout=10)


if __name__ == "__main__":
    main()
