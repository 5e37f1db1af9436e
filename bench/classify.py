"""Cost of request-shape estimation on this CPU: classifier alone, token count, full estimate.

Prompts: every turn-prefix of the Spec-Bench questions (480 questions, 30 B - 20 kB)
plus 500 GSM8K problems, each as a chat body. Also measures the event-loop
lag a 1 ms ticker sees while the same estimates run inline on the loop, next
to the lag of an idle loop, in the same run.

    nice -n 10 /work/venv/bin/python bench/classify.py [--data ../shared/data] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from engine.config import TINY_TARGET
from router.corpus import gsm8k, spec_bench
from router.shape import ShapeEstimator
from router.tokens import render_chat


def percentiles(xs: list[float]) -> tuple[float, float, float]:
    xs = sorted(xs)
    return (xs[len(xs) // 2], xs[min(len(xs) - 1, int(len(xs) * 0.99))], xs[-1])


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def measure(name: str, fn: Callable[[dict], object], bodies: list[dict], repeat: int) -> None:
    samples: list[float] = []
    for body in bodies:
        samples += timed(lambda b=body: fn(b), repeat)
    p50, p99, mx = percentiles(samples)
    print(f"{name:<28} n={len(samples):>6}  p50 {p50 * 1e6:7.1f} us  p99 {p99 * 1e6:7.1f} us"
          f"  max {mx * 1e6:8.1f} us")


async def loop_lag(work: Callable[[], None] | None, seconds: float) -> list[float]:
    lags: list[float] = []
    stop = time.perf_counter() + seconds

    async def ticker() -> None:
        while time.perf_counter() < stop:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    async def worker() -> None:
        while work is not None and time.perf_counter() < stop:
            work()
            await asyncio.sleep(0)

    await asyncio.gather(ticker(), worker())
    return lags


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    prompts = [e.text for e in spec_bench(args.data / "prompts/spec_bench_questions.jsonl")]
    prompts += [e.text for e in gsm8k(args.data / "prompts/gsm8k_train.jsonl", 500)]
    bodies = [{"model": "m", "messages": [{"role": "user", "content": p}]} for p in prompts]
    est = ShapeEstimator.load(TINY_TARGET)
    clf, counter = est.classifier, est.counter
    for b in bodies[:50]:  # warm up
        est.estimate(b, "/v1/chat/completions")
    lens = [len(p) for p in prompts]
    print(f"{len(prompts)} prompts, chars p50 {statistics.median(lens):.0f} max {max(lens)}; "
          f"repeat {args.repeat}")
    measure("classify (domain)", lambda b: clf.predict(b["messages"][0]["content"]), bodies,
            args.repeat)
    measure("count tokens (rendered)", lambda b: counter.count(render_chat(b["messages"])),
            bodies, args.repeat)
    measure("estimate() full shape", lambda b: est.estimate(b, "/v1/chat/completions"), bodies,
            args.repeat)
    it = iter(bodies * 1000)
    for name, work in (("idle loop", None),
                       ("loop running estimate()", lambda: est.estimate(next(it), "chat"))):
        p50, p99, mx = percentiles(asyncio.run(loop_lag(work, 3.0)))
        print(f"1 ms ticker lag, {name:<24} p50 {p50 * 1e6:7.1f} us  p99 {p99 * 1e6:7.1f} us"
              f"  max {mx * 1e6:8.1f} us")
    print(json.dumps({"classifier_version": clf.meta.get("version")}))


if __name__ == "__main__":
    main()
