"""What the dashboard's history costs the proxy: per request, per second, per page refresh.

Feeds :class:`proxy.history.History` one hour of seeded requests (``--workers`` workers,
the eight domains, four decision reasons, log-normal TTFTs) at ``--rate`` requests per
second with a fake clock, the sampler's tick after each second, and prints:

- ``record``: nanoseconds per request on the request path, and its ratio to
  :meth:`proxy.stats.Stats.record` (the counters it sits beside) measured the same way,
  best of 5 passes (the ratio holds on a busy machine, where the absolute numbers do not);
- ``tick``: microseconds per second of the sampler (closing a slot, folding it);
- the memory both rings hold when full (tracemalloc);
- ``window``: milliseconds to build the 5-minute and the 1-hour view the first time (in
  the slices the handler yields between, and the longest of them), to refresh each after
  one more second (the page's every 2 s / 10 s), and the JSON size.

    python bench/dashboard_history.py                  # 4 workers, 50 req/s
    python bench/dashboard_history.py --rate 500 --workers 8
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc
from collections.abc import Callable

import orjson

from polyinfer.config import DOMAINS
from proxy.history import COARSE_S, COARSE_SLOTS, History, Sample
from proxy.record import RequestRecord
from proxy.stats import Stats
from router.base import RequestShape

REASONS = ("fit", "balance", "explore", "reserve")


def requests(num: int, workers: list[str], seed: int = 0) -> list[RequestRecord]:
    rng = random.Random(seed)
    out = []
    for i in range(num):
        shape = RequestShape(domain=rng.choice(DOMAINS), prompt_tokens=rng.randint(10, 2000),
                             max_tokens=64, predicted_output_tokens=64)
        ttft_s = rng.lognormvariate(-3.0, 1.0)
        out.append(RequestRecord(
            request_id=f"r{i}", ts=0.0, t0=0.0, endpoint="chat/completions", shape=shape,
            worker=rng.choice(workers), reason=rng.choice(REASONS), spec_depth=rng.randint(0, 4),
            completion_tokens=rng.randint(2, 64), ttft_s=ttft_s,
            e2e_s=ttft_s + rng.lognormvariate(-1.0, 0.5)))
    return out


def per_call_ns(fn: Callable[[RequestRecord], None], recs: list[RequestRecord]) -> float:
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for rec in recs:
            fn(rec)
        best = min(best, (time.perf_counter() - t) / len(recs))
    return best * 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=int, default=50, help="requests per second")
    p.add_argument("--workers", type=int, default=4)
    args = p.parse_args()
    workers = [f"w{i}" for i in range(args.workers)]
    recs = requests(5000, workers)

    stats = Stats()
    history = stats.history
    stats.history = History()  # NOTE: Stats.record without the history: the baseline
    stats.history.record = lambda rec: None  # type: ignore[method-assign]
    record_ns, stats_ns = per_call_ns(history.record, recs), per_call_ns(stats.record, recs)
    print(f"record: {record_ns:.0f} ns per request; Stats.record {stats_ns:.0f} ns: "
          f"{record_ns / stats_ns:.2f}x")

    now = [1_000_000.0]
    history = History(lambda: now[0])
    gauges = {(g, w): 1.0 for g in ("outstanding", "running", "waiting") for w in workers}
    tokens = {(w, d): [0, 0] for w in workers for d in DOMAINS}
    errors = {"ttft": 0.5, "tpot": 0.25, "e2e": 0.3}
    tracemalloc.start()
    tick_s = 0.0
    num_seconds = int(COARSE_SLOTS * COARSE_S)
    for second in range(num_seconds):
        for j in range(args.rate):
            history.record(recs[(second * args.rate + j) % len(recs)])
        for pair in tokens.values():
            pair[0] += 10
            pair[1] += 7
        now[0] += 1.0
        t = time.perf_counter()
        history.tick(Sample(gauges=gauges, spec_tokens=tokens, prediction_error=errors))
        tick_s += time.perf_counter() - t
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"tick: {tick_s / num_seconds * 1e6:.0f} us per second; full rings hold "
          f"{held / 1e6:.1f} MB ({args.workers} workers x {len(DOMAINS)} domains, "
          f"{args.rate} req/s)")
    for window_s in (300, 3600):
        slices_ms = []
        ready = False
        while not ready:  # as the /stats/history handler builds a view the first time
            t = time.perf_counter()
            ready = history.prepare(window_s)
            slices_ms.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        doc = history.window(window_s)
        first_ms = sum(slices_ms) + (time.perf_counter() - t) * 1e3
        now[0] += 1.0
        history.tick(Sample(gauges=gauges, spec_tokens=tokens, prediction_error=errors))
        t = time.perf_counter()
        doc = history.window(window_s)
        refresh_ms = (time.perf_counter() - t) * 1e3
        size_kb = len(orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS)) / 1e3
        print(f"window {window_s} s: first {first_ms:.1f} ms in {len(slices_ms)} slices "
              f"(longest {max(slices_ms):.1f} ms), refresh {refresh_ms:.2f} ms, "
              f"{len(doc['t'])} points, {size_kb:.0f} kB of JSON")


if __name__ == "__main__":
    main()
