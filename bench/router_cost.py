"""The adaptive router's cost per request on the proxy's event loop: ``choose`` + ``observe``.

Replays one seeded request stream through :class:`router.adaptive.AdaptivePolicy` at a
fixed number of requests in flight (0 / 16 / 64 / 256 by default): each request is chosen
with the in-flight ones' load in the worker views, then the oldest in flight finishes
(``observe``), so ``choose`` always sees N outstanding. Fleet: three engine workers as in
the routing bench -- ``spec`` (4 sequences, n-gram depth 4), ``batch`` and ``long`` (32
sequences each) -- SLOs set, exploration off, the engine's step feed every 25 requests.
Shapes: half shared-prefix requests (64-token blocks of 60 documents, popularity ~ 1/rank),
half short or long single requests, as bench/sim/prefix_mix_sim.py draws them. The
outcomes are a fixed function of the decision (not a model of a real fleet): the point is
the policy's own CPU time, with realistic state behind it.

Each tree runs in its own process (``--baseline REV``: the tree of a git revision, exported
with ``git archive``, first on PYTHONPATH), repeats alternating ABBA; the table shows the
median thread-CPU microseconds per request (choose + observe) and new / base, and whether
the trees made the same decisions (worker, depth, reason) on every request. ``--opcodes``
adds the Python bytecode instructions executed per request (``sys.settrace``; one run per
tree: the count is deterministic), a measure a co-tenant's load does not move.

    python bench/router_cost.py --baseline HEAD          # this work tree against HEAD
    python bench/router_cost.py --new HEAD --baseline HEAD~3   # two commits, no work tree
    python bench/router_cost.py --inflight 64 --repeats 3
    python bench/router_cost.py --baseline HEAD~3 --opcodes
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WARMUP = 200  # requests routed and finished before timing, per in-flight level
FEED_EVERY = 25  # requests between the step feeds


def _fleet() -> list[Any]:
    from polyinfer.config import CompiledConfig, DeclaredFit
    from router.base import WorkerView
    rep, conv, long_ = ("translation", "code", "extraction"), ("chat", "math", "qa"), \
        ("summarization", "rag")
    spec = CompiledConfig(fit=DeclaredFit(domains=rep, prompt_tokens=(0, 600))).with_engine(
        max_num_seqs=4, max_num_batched_tokens=256, spec_method="ngram", spec_max_depth=4)
    batch = CompiledConfig(fit=DeclaredFit(domains=conv, prompt_tokens=(0, 600))).with_engine(
        max_num_seqs=32, max_num_batched_tokens=256)
    long_cfg = CompiledConfig(fit=DeclaredFit(domains=long_)).with_engine(
        max_num_seqs=32, max_num_batched_tokens=2048)
    return [WorkerView(n, f"http://127.0.0.1:{8000 + i}", "engine", c)
            for i, (n, c) in enumerate((("spec", spec), ("batch", batch), ("long", long_cfg)))]


def _shapes(num: int, seed: int) -> list[Any]:
    from router.base import RequestShape
    rng = random.Random(seed)
    domains = ("translation", "code", "extraction", "chat", "math", "qa", "summarization", "rag")
    slos = {"prefix": (0.97, 0.0142), "translation": (0.30, 0.005), "code": (0.30, 0.005),
            "extraction": (0.30, 0.005), "summarization": (1.0, 0.023), "rag": (1.0, 0.023)}
    doc_blocks = [rng.randint(4, 24) for _ in range(60)]
    weights = [1.0 / (1 + d) for d in range(60)]
    out = []
    for i in range(num):
        if rng.random() < 0.5:
            doc = rng.choices(range(60), weights)[0]
            blocks = (*(1000 * doc + b for b in range(doc_blocks[doc])), 10**6 + i)
            ttft, tpot = slos["prefix"]
            out.append(RequestShape("rag", len(blocks) * 64, None,
                                    max(8, min(96, int(rng.lognormvariate(3.3, 1.2)))),
                                    prefix_hashes=blocks, prefix_block_tokens=64.0,
                                    slo_ttft_s=ttft, slo_tpot_s=tpot))
            continue
        domain = rng.choices(domains, [1, 1, 1, 2, 2, 2, 1, 1])[0]
        prompt = rng.randint(600, 1500) if domain in ("summarization", "rag") \
            else rng.randint(30, 400)
        ttft, tpot = slos.get(domain, (0.24, 0.009))
        out.append(RequestShape(domain, prompt, None, rng.choice((14, 24, 60, 96, 96)),
                                slo_ttft_s=ttft, slo_tpot_s=tpot))
    return out


def _outcome(shape: Any, decision: Any, batch: int) -> Any:
    """A fixed function of the decision: what the request measured."""
    from router.base import RequestOutcome
    step = 0.0025 + 0.00015 * min(batch, 32)
    if decision.worker == "spec" and shape.domain in ("translation", "code", "extraction"):
        step *= 0.5
    n = shape.predicted_output_tokens
    cached = 0.5 * shape.prompt_tokens if shape.prefix_hashes else 0.0
    ttft = 0.01 + 0.0002 * (shape.prompt_tokens - cached) + 0.002 * min(batch, 32)
    depth = decision.spec_depth or 0
    drafted = depth * (n // (depth + 1))
    return RequestOutcome(decision.worker, shape, "ok", completion_tokens=n, ttft_s=ttft,
                          tpot_s=step, e2e_s=ttft + step * (n - 1), spec_depth=depth,
                          spec_draft_tokens=drafted, spec_accepted_tokens=drafted // 2,
                          batch_size=batch, extra={"cached_tokens": cached})


def _feed(policy: Any, views: list[Any]) -> None:
    """Each worker's decode steps at batches 1-8, as the engine's step feed sums them."""
    from specdec.step_model import step_features
    for v in views:
        n = len(step_features(1, 0, 0))
        xtx, xty = [[0.0] * n for _ in range(n)], [0.0] * n
        for b in range(1, 9):
            x = step_features(b, 0, 0, 32.0)
            y = 0.0025 + 0.00015 * b
            for i in range(n):
                xty[i] += x[i] * y / y**2
                for j in range(n):
                    xtx[i][j] += x[i] * x[j] / y**2
        policy.depth_policy.observe_step_sums(v.name, xtx, xty, 8, 256.0)


def run_level(inflight: int, num: int, seed: int, opcodes: bool = False
              ) -> tuple[float, list[tuple]]:
    """(median seconds of choose + observe per request, the timed requests' decisions); with
    ``opcodes``, instead of seconds the mean bytecode instructions per timed request.

    NOTE: thread CPU time, not wall time: on a shared box a wall median moves with the
    co-tenants' load (an A/A pair differed by up to 37%); the CPU time is the call's own.
    Even that moved 15-23% between identical trees at load 2-3, hence ``opcodes``."""
    from router.adaptive import AdaptiveConfig, AdaptivePolicy
    clock = [0.0]
    policy = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0), seed=seed,
                            clock=lambda: clock[0])
    views = _fleet()
    shapes = _shapes(WARMUP + num, seed)
    pending: deque[tuple[Any, Any, int]] = deque()
    times, decisions = [], []
    count = [0]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            count[0] += 1
        return tracer
    for i, shape in enumerate(shapes):
        clock[0] += 0.01
        if i % FEED_EVERY == 0:
            _feed(policy, views)
        counting = opcodes and i >= WARMUP
        if counting:
            if i == WARMUP:
                # NOTE: a collection inside the window runs whatever __del__ the garbage of
                # earlier code holds (another test's unclosed session, in one process) and
                # the tracer counts it; with the collector off the count is the policy's
                gc.collect()
                gc.disable()
            sys.settrace(tracer)
        t0 = time.thread_time()
        d = policy.choose(shape, views)
        view = next(v for v in views if v.name == d.worker)
        pending.append((shape, d, view.outstanding_requests + 1))
        view.outstanding_requests += 1
        if len(pending) > inflight:
            done_shape, done, batch = pending.popleft()
            policy.observe(_outcome(done_shape, done, batch))
            next(v for v in views if v.name == done.worker).outstanding_requests -= 1
        t1 = time.thread_time()
        if counting:
            sys.settrace(None)
        if i >= WARMUP:
            times.append(t1 - t0)
            decisions.append((d.worker, d.spec_depth, d.reason))
    if opcodes:
        gc.enable()
        return count[0] / num, decisions
    return statistics.median(times), decisions


def child(args: argparse.Namespace) -> None:
    import router
    out: dict[str, Any] = {"router": router.__file__, "levels": {}}
    for n in args.inflight:
        median_s, decisions = run_level(n, args.num, args.seed)
        out["levels"][str(n)] = {"median_s": median_s, "decisions": decisions}
        if args.opcodes:
            out["levels"][str(n)]["opcodes"] = run_level(n, args.num, args.seed, True)[0]
    print(json.dumps(out))


def _run_tree(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--num", str(args.num),
           "--seed", str(args.seed), "--inflight", *map(str, args.inflight),
           *(["--opcodes"] if args.opcodes else [])]
    env = dict(os.environ, PYTHONPATH=str(tree))
    res = subprocess.run(cmd, env=env, cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def bench(args: argparse.Namespace) -> None:
    from revtree import export  # bench/, on the path when this file runs as a script

    with contextlib.ExitStack() as stack:
        _bench(args, lambda rev: export(rev, stack, "router-cost-"))


def _bench(args: argparse.Namespace, export_rev: Callable[[str], Path]) -> None:
    trees = {"new": export_rev(args.new) if args.new else REPO}
    bases = [export_rev(args.baseline)] if args.baseline else []
    bases += [Path(d).resolve() for d in args.baseline_dir]
    for i, tree in enumerate(bases):  # the same tree twice: an A/A pair
        trees["base" if i == 0 else f"base#{i + 1}"] = tree
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    order = list(trees)
    for r in range(args.repeats):
        for name in order if r % 2 == 0 else reversed(order):
            runs[name].append(_run_tree(trees[name], args))
    for name, rs in runs.items():
        print(f"{name}: router from {rs[0]['router']}")
    print(f"{args.num} timed requests per level (after {WARMUP} warm-up), seed {args.seed}, "
          f"median per request of each run, median of {args.repeats} runs")
    head = " | ".join(f"{name} us" for name in trees)
    others = [name for name in trees if name != "new"]
    extra = "".join(f" | new / {name}" for name in others)
    extra += " | same decisions" if others else ""
    if args.opcodes:
        extra += " | opcodes " + " / ".join(trees) + "".join(f" | ops new / {o}" for o in others)
    print(f"| in flight | {head}{extra} |")
    cols = len(trees) + len(others) + (1 if others else 0)
    cols += (1 + len(others)) if args.opcodes else 0
    print("|---|" + "---|" * cols)
    for n in map(str, args.inflight):
        us = {name: 1e6 * statistics.median(r["levels"][n]["median_s"] for r in rs)
              for name, rs in runs.items()}
        row = " | ".join(f"{us[name]:,.0f}" for name in trees)
        row += "".join(f" | {us['new'] / us[name]:.3f}" for name in others)
        if others:
            a = runs["new"][0]["levels"][n]["decisions"]
            same = min(sum(x == y for x, y in zip(a, runs[name][0]["levels"][n]["decisions"],
                                                 strict=True)) for name in others)
            row += f" | {same} of {len(a)}"
        if args.opcodes:  # deterministic: the first run's
            ops = {name: rs[0]["levels"][n]["opcodes"] for name, rs in runs.items()}
            row += " | " + " / ".join(f"{ops[name]:,.0f}" for name in trees)
            row += "".join(f" | {ops['new'] / ops[name]:.3f}" for name in others)
        print(f"| {n} | {row} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--baseline", help="git revision to compare against, side by side")
    parser.add_argument("--baseline-dir", action="append", default=[],
                        help="an exported tree to compare against (no git; repeatable: the "
                        "same tree twice is an A/A pair)")
    parser.add_argument("--new", help="git revision to run as 'new' (default: the work tree, "
                        "with whatever is uncommitted in it, others' edits included)")
    parser.add_argument("--inflight", type=int, nargs="+", default=[0, 16, 64, 256])
    parser.add_argument("--num", type=int, default=300, help="timed requests per level")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--opcodes", action="store_true",
                        help="also count the bytecode instructions per request (see above)")
    args = parser.parse_args()
    if args.child:
        child(args)
    else:
        bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
