"""Cost of request-shape estimation on this CPU: classifier alone, token count, full estimate.

Prompts: every turn-prefix of the Spec-Bench questions (480 questions, 30 B - 20 kB)
plus 500 GSM8K problems, each as a chat body; wall time and thread CPU time per
call (on a shared box, wall p99 is mostly preemption; CPU time is the cost of
the call itself). The proxy makes this call inline on its event loop, so the
wall time is how long it holds the loop; the last row shows that the text caps
keep 1 MB prompts as cheap as short ones.

The estimator memoises (whole texts, token counts per chunk, feature hashes per
window), so the cold rows make every call's text new: "(call k) " is put in
front of each prompt, which shifts every chunk and window. The cached rows
show what a repeated body costs, and one whose head repeats (the same prompt
with a new last line, as with a shared system prompt or template).

    nice -n 10 /work/venv/bin/python bench/classify.py [--data data] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from polyinfer.config import TINY_TARGET
from router.corpus import gsm8k, spec_bench
from router.shape import ShapeEstimator
from router.tokens import render_chat


def percentiles(xs: list[float]) -> tuple[float, float, float]:
    xs = sorted(xs)
    return (xs[len(xs) // 2], xs[min(len(xs) - 1, int(len(xs) * 0.99))], xs[-1])


def timed(fn: Callable[[], object], repeat: int) -> tuple[list[float], list[float]]:
    """Wall and thread-CPU seconds per call (CPU time excludes preemption by co-tenants)."""
    wall, cpu = [], []
    for _ in range(repeat):
        c = time.thread_time_ns()
        t = time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append((time.thread_time_ns() - c) * 1e-9)
    return wall, cpu


def measure(name: str, fn: Callable[[dict], object], bodies: list[dict], repeat: int) -> None:
    wall: list[float] = []
    cpu: list[float] = []
    for body in bodies:
        w, c = timed(lambda b=body: fn(b), repeat)
        wall += w
        cpu += c
    p50, p99, mx = percentiles(wall)
    c50, c99, _ = percentiles(cpu)
    print(f"{name:<26} n={len(wall):>5}  wall p50 {p50 * 1e6:6.1f} p99 {p99 * 1e6:7.1f} "
          f"max {mx * 1e6:8.1f} us | cpu p50 {c50 * 1e6:6.1f} p99 {c99 * 1e6:6.1f} us")


def variant(body: dict, k: int, where: str) -> dict:
    """``body`` with its text made new: "(call k) " in front, or a new last line."""
    text = body["messages"][0]["content"]
    text = f"(call {k}) {text}" if where == "front" else f"{text}\n(call {k})"
    return {**body, "messages": [{"role": "user", "content": text}]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[1] / "data")
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
    cold = [variant(b, k, "front") for k in range(args.repeat) for b in bodies]
    shared = [variant(b, k, "end") for k in range(args.repeat) for b in bodies]
    measure("classify (domain), cold", lambda b: clf.predict(b["messages"][0]["content"]),
            cold, 1)
    cold = [variant(b, args.repeat + k, "front") for k in range(args.repeat) for b in bodies]
    measure("count tokens, cold", lambda b: counter.count(render_chat(b["messages"])), cold, 1)
    cold = [variant(b, 2 * args.repeat + k, "front") for k in range(args.repeat) for b in bodies]
    measure("estimate(), cold", lambda b: est.estimate(b, "/v1/chat/completions"), cold, 1)
    for b in bodies:  # seen once before: the rows below are repeats
        est.estimate(b, "/v1/chat/completions")
    measure("estimate(), head repeats", lambda b: est.estimate(b, "/v1/chat/completions"),
            shared, 1)
    measure("estimate(), same body", lambda b: est.estimate(b, "/v1/chat/completions"), bodies,
            args.repeat)
    # NOTE: the call runs inline on the event loop, so its wall time is how long it holds
    # the loop; the text caps make that independent of prompt size, shown here on 1 MB.
    huge = [{"model": "m", "messages": [{"role": "user", "content": p * (1_000_000 // len(p))}]}
            for p in prompts[:20]]
    measure("estimate() on 1 MB prompts", lambda b: est.estimate(b, "/v1/chat/completions"),
            huge, args.repeat)
    print(json.dumps({"classifier_version": clf.meta.get("version")}))


if __name__ == "__main__":
    main()
