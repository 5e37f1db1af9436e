"""Where the engine's host time goes at batch 1, per step and per emitted token.

Runs one engine server per code tree (this working tree, and with ``--baseline REV`` the
tree of a git revision, exported with ``git archive`` to a temporary directory), each in
its own process with timers wrapped around the step's parts, and streams the same
prompts to them over HTTP at concurrency 1 (chat completions, SSE, as bench/spec_depth.py
does), alternating trees and depths request by request (ABBA), so every ratio printed
comes from one run on the same noisy machine.

Parts timed (wall ms, summed over the run; wrappers cost ~1 us each):

- step thread: ``step`` (EngineCore.step, the whole step), inside it ``propose``,
  ``schedule``, ``runner`` (ModelRunner.execute) of which ``forward`` (the model's
  forward and LM head on the CPU; with CUDA graphs the replay's launch only), ``graph run``
  (fill inputs, copy, launch) and ``sample/verify`` (with CUDA graphs: the wait for the
  GPU, argmax, the copy to the host, acceptance), ``postprocess`` (stop checks, spec
  counts, output building) of which ``detokenize``; after the step ``post`` (handing the
  outputs to the event loop) and ``idle`` (EngineCore.idle, where it exists).
- event loop: ``deliver`` (metrics and the request's queue), ``sse`` (chunk building,
  JSON and the socket write, per chunk).
- CPU time of the step thread and of the event-loop thread over the run.

``host/step`` is the step minus its forward (on a GPU it includes the wait for the device);
per token divides by emitted tokens.

NOTE: each tree runs in its own server process, and on the 2-core dev box an A/A run (the
same code as both trees, ``--new REV --baseline REV``) showed the first-started server ~12%
slower at k=0 (per-process start-up state): read new/base ratios against such a run.

    python bench/engine_host.py --depths 0 16 --per-domain 2
    python bench/engine_host.py --baseline 778ffad --depths 0 16   # before/after, one run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# (part, module, qualified name): wrapped in the engine process when the name exists
PARTS = (
    ("step", "engine.core", "EngineCore.step"),
    ("propose", "engine.core", "EngineCore._propose"),
    ("schedule", "engine.scheduler", "Scheduler.schedule"),
    ("runner", "engine.runner", "ModelRunner.execute"),
    ("forward", "engine.model", "LlamaModel.forward"),
    ("forward", "engine.model", "LlamaModel.logits"),
    ("forward", "engine.cuda_graph", "RowDecoder._launch"),
    ("forward", "engine.cuda_graph", "CudaGraphDecoder._launch"),
    ("graph run", "engine.cuda_graph", "RowDecoder.run"),
    ("sample/verify", "engine.runner", "ModelRunner._verify"),
    ("sample/verify", "engine.runner", "sample_on_device"),
    ("postprocess", "engine.core", "EngineCore._postprocess"),
    ("postprocess", "engine.core", "EngineCore._postprocess_all"),
    ("detokenize", "engine.detokenizer", "IncrementalDetokenizer.push"),
    ("post", "engine.async_engine", "AsyncEngine._post"),
    ("idle", "engine.core", "EngineCore.idle"),
    ("deliver", "engine.async_engine", "OutputRouter.deliver"),
)
ASYNC_PARTS = (("sse", "engine.server", "_send"),)
ROWS = ("step", "propose", "schedule", "runner", "forward", "graph run", "sample/verify",
        "postprocess", "detokenize", "post", "idle", "host/step", "deliver", "sse",
        "cpu step thread", "cpu loop thread", "client wall")


# -- the engine side (``--serve``) -----------------------------------------------------------


@dataclass
class Timers:
    ms: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    threads: dict[str, int] = field(default_factory=dict)  # role -> thread ident

    def add(self, part: str, seconds: float) -> None:
        self.ms[part] += seconds * 1e3
        self.calls[part] += 1


def _resolve(module: str, qualname: str) -> tuple[Any, str] | None:
    owner: Any = importlib.import_module(module)
    *path, name = qualname.split(".")
    for attr in path:
        owner = getattr(owner, attr, None)
        if owner is None:
            return None
    return (owner, name) if hasattr(owner, name) else None


def instrument(timers: Timers) -> None:
    nested: dict[str, int] = defaultdict(int)  # re-entrant parts count once

    def wrap(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if nested[part]:
                return fn(*args, **kwargs)
            nested[part] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.add(part, time.perf_counter() - t0)
                nested[part] -= 1
        return timed

    def wrap_async(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                timers.add(part, time.perf_counter() - t0)
        return timed

    for parts, wrapper in ((PARTS, wrap), (ASYNC_PARTS, wrap_async)):
        for part, module, qualname in parts:
            found = _resolve(module, qualname)
            if found is not None:
                owner, name = found
                setattr(owner, name, wrapper(part, getattr(owner, name)))


def _thread_cpu_s(ident: int | None) -> float:
    if ident is None:
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def serve(config_path: str, port: int) -> None:
    from aiohttp import web

    timers = Timers()
    instrument(timers)
    step_cls = importlib.import_module("engine.async_engine").StepLoop
    run = step_cls.run

    profiles: dict[str, Any] = {}

    def profiled(role: str) -> None:
        if os.environ.get("ENGINE_HOST_PROFILE"):  # cProfile per thread (Python 3.11: per thread)
            import cProfile

            profiles[role] = cProfile.Profile()
            profiles[role].enable()

    def run_named(self: Any) -> None:
        timers.threads["step"] = threading.get_ident()
        profiled("step")
        run(self)

    step_cls.run = run_named
    from engine.server import create_app
    from polyinfer.config import CompiledConfig

    async def stats(request: web.Request) -> web.Response:
        body = {"ms": timers.ms, "calls": timers.calls,
                "cpu": {role: _thread_cpu_s(ident) * 1e3
                        for role, ident in timers.threads.items()},
                "engine_file": importlib.import_module("engine").__file__}
        for role, prof in profiles.items() if request.query.get("dump") else ():
            prof.dump_stats(Path(os.environ["ENGINE_HOST_PROFILE"]) / f"{role}.pstats")
        return web.json_response(body)

    async def main() -> None:
        timers.threads["loop"] = threading.get_ident()
        profiled("loop")
        app = create_app(CompiledConfig.load(config_path))
        app.router.add_get("/bench/host_stats", stats)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    with contextlib.suppress(ImportError):
        if os.environ.get("ENGINE_HOST_PROFILE"):  # cProfile does not see uvloop's callbacks
            raise ImportError
        import uvloop  # as the engine CLI

        uvloop.install()
    asyncio.run(main())


# -- the client side -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _load_bench_specdec() -> Any:
    """bench/spec_depth.py, from this tree's bench package."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module("bench.spec_depth")


@contextlib.contextmanager
def engine_server(tree: Path, args: argparse.Namespace) -> Iterator[str]:
    engine = {"max_num_seqs": 16, "kv_cache_tokens": 32768, "spec_method": args.method,
              "spec_max_depth": max(args.depths), "device": args.device,
              "execution": args.execution, "dtype": args.dtype,
              "enable_prefix_caching": False}
    if args.method == "draft":
        engine["draft_model"] = str(REPO / "models" / "tiny-draft")
    config = {"backend": "engine", "model": str(REPO / "models" / "tiny-target"),
              "engine": engine}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(config, f)
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(tree))
    log = open(Path(tempfile.gettempdir()) / f"bench-engine-host-{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", f.name,
                             "--port", str(port)], cwd=tree, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        bs = _load_bench_specdec()
        asyncio.run(bs._wait_healthy(url, proc))
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        os.unlink(f.name)


async def _stats(url: str, dump: bool = False) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/bench/host_stats" + ("?dump=1" if dump else "")) as r:
            result: dict[str, Any] = await r.json()
            return result


@dataclass
class Cell:
    ms: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    steps: int = 0
    tokens: int = 0
    texts: list[str] = field(default_factory=list)


async def _one(url: str, bs: Any, prompt: Any, depth: int, max_tokens: int,
               cell: Cell) -> None:
    await _block(url, bs, [prompt], depth, max_tokens, cell)


async def _block(url: str, bs: Any, prompts: list[Any], depth: int, max_tokens: int,
                 cell: Cell) -> None:
    """``prompts`` sent together (concurrency ``len(prompts)``); the parts' time between the
    stats taken before and after the block goes to ``cell``."""
    import aiohttp

    before = await _stats(url)
    n = len(prompts)
    async with aiohttp.ClientSession() as session:
        outs = await asyncio.gather(*(bs.send(session, url, p, depth, max_tokens, n, depth, n)
                                      for p in prompts))
    after = await _stats(url)
    for part, ms in after["ms"].items():
        cell.ms[part] += ms - before["ms"].get(part, 0.0)
    for role, ms in after["cpu"].items():
        cell.ms[f"cpu {role} thread"] += ms - before["cpu"].get(role, 0.0)
    cell.steps += after["calls"].get("step", 0) - before["calls"].get("step", 0)
    for o in outs:
        cell.tokens += o.tokens
        cell.ms["client wall"] += (o.e2e_s - o.ttft_s) * 1e3 / n  # per token: the block's
        cell.texts.append(o.text)


def _print(cells: dict[tuple[str, int], Cell]) -> None:
    keys = list(cells)
    head = " | ".join(f"{tree} k={d} ms/step | us/tok" for tree, d in keys)
    print(f"| part | {head} |")
    print("|---|" + "---|---|" * len(keys))
    for row in ROWS:
        vals = []
        for key in keys:
            c = cells[key]
            ms = c.ms["step"] - c.ms["forward"] if row == "host/step" else c.ms.get(row, 0.0)
            vals.append(f"{ms / max(c.steps, 1):.3f} | {ms * 1e3 / max(c.tokens, 1):.1f}")
        print(f"| {row} | " + " | ".join(vals) + " |")
    print("| steps, tokens | " + " | ".join(f"{c.steps} | {c.tokens}" for c in cells.values())
          + " |")
    trees = sorted({t for t, _ in keys})
    if len(trees) == 2:
        a, b = trees if trees[0] != "new" else trees[::-1]
        for d in sorted({d for _, d in keys}):
            ca, cb = cells[(a, d)], cells[(b, d)]
            same = sum(x == y for x, y in zip(ca.texts, cb.texts, strict=True))
            for row in ("host/step", "cpu step thread", "cpu loop thread", "client wall"):
                def per_tok(c: Cell, row: str = row) -> float:
                    ms = c.ms["step"] - c.ms["forward"] if row == "host/step" else c.ms[row]
                    return ms / max(c.tokens, 1)
                print(f"k={d} {row} per token, {b} / {a}: {per_tok(cb) / per_tok(ca):.3f}")
            print(f"k={d} outputs identical {b} vs {a}: {same} of {len(ca.texts)}")


def bench(args: argparse.Namespace) -> None:
    # NOTE: before bench/spec_depth.py loads: run as a script, it puts the tree in bench/'s place
    from revtree import export  # bench/, on the path when this file runs as a script

    bs = _load_bench_specdec()
    path = Path(args.data) / "prompts" / "spec_bench_questions.jsonl"
    prompts = [p for p in bs.load_prompts(path, args.per_domain, args.seed)
               if args.domains is None or p.domain in args.domains]
    with contextlib.ExitStack() as stack:
        trees = {"new": export(args.new, stack, "engine-host-") if args.new else REPO}
        if args.baseline or args.baseline_dir:
            trees["base"] = (Path(args.baseline_dir).resolve() if args.baseline_dir
                             else export(args.baseline, stack, "engine-host-"))
        urls = {name: stack.enter_context(engine_server(tree, args))
                for name, tree in trees.items()}
        for name, url in urls.items():
            print(f"{name}: engine from {asyncio.run(_stats(url))['engine_file']}")
            for p in prompts[:2]:  # warm-up
                asyncio.run(_one(url, bs, p, max(args.depths), args.max_tokens, Cell()))
        cells = {(name, d): Cell() for name in trees for d in args.depths}
        order = list(cells)
        c = args.concurrency
        stream = prompts * args.rounds
        blocks = [[stream[(i + j) % len(stream)] for j in range(c)]
                  for i in range(0, len(stream), c)]
        for i, block in enumerate(blocks):
            for key in order if i % 2 == 0 else reversed(order):
                asyncio.run(_block(urls[key[0]], bs, block, key[1], args.max_tokens, cells[key]))
        for url in urls.values():
            asyncio.run(_stats(url, dump=True))  # cProfile files (ENGINE_HOST_PROFILE=DIR)
    print(f"{len(prompts)} prompts x {args.rounds} rounds, c={args.concurrency}, "
          f"max_tokens {args.max_tokens}, "
          f"{args.device}/{args.execution}/{args.dtype}")
    _print(cells)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=str(REPO / "data"))
    parser.add_argument("--baseline", help="git revision to compare against, side by side")
    parser.add_argument("--new", help="git revision to run as 'new' (default: the work tree)")
    parser.add_argument("--baseline-dir", help="an exported tree to compare against (no git)")
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 16])
    parser.add_argument("--domains", nargs="+",
                        default=["translation", "qa", "chat", "extraction"])
    parser.add_argument("--per-domain", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=1,
                        help="prompts sent together per block (client wall: block wall per "
                             "token, summed as if per request)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--method", choices=("ngram", "draft"), default="ngram",
                        help="the engine's spec_method")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--execution", default="eager")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    if args.concurrency < 1:
        parser.error(f"--concurrency: expected >= 1, got {args.concurrency}")
    if args.serve:
        serve(args.serve, args.port)
        return 0
    bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
