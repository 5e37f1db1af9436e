"""Cost of changing a worker's config: vLLM blue-green replacement vs the engine's hot reload.

Side by side, in one run, on the bundled tiny target:

1. engine: ``polyinfer engine`` is started once; then its config is swapped
   ``--reloads`` times with ``POST /admin/reload`` (n-gram speculation on/off,
   batch caps changed); each swap is timed at the client.
2. vLLM: a proxy launches one vLLM worker (no speculation), then replaces it
   with an n-gram-speculation config through ``POST /admin/workers/w/replace``
   while a client keeps sending requests; the replacement's own timings are
   printed, with the number of client requests that failed (should be 0).

Prints the seconds of each and the ratio blue-green / hot reload.

    python bench/vllm_bluegreen.py [--reloads 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polyinfer.config import TINY_TARGET, CompiledConfig, EngineConfig  # noqa: E402
from proxy.config import ProxyConfig, WorkerSpec  # noqa: E402
from proxy.server import ProxyServer  # noqa: E402
from proxy.supervisor import engine_command, free_port  # noqa: E402

MODEL = "tiny-target"
ADMIN = {"x-admin-key": "bench"}


async def wait_healthy(session: aiohttp.ClientSession, url: str, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


async def engine_reloads(num_reloads: int, tmp: Path) -> dict[str, Any]:
    """Start one engine; time ``num_reloads`` config swaps through POST /admin/reload."""
    configs = [
        CompiledConfig(engine=EngineConfig(spec_method="ngram", spec_max_depth=4,
                                           max_num_seqs=8)),
        CompiledConfig(engine=EngineConfig(spec_method="none", spec_max_depth=0,
                                           max_num_seqs=32)),
    ]
    port = free_port()
    path = tmp / "engine.yaml"
    path.write_text(json.dumps(configs[1].to_dict()))
    spec = WorkerSpec(name="e", url="http://127.0.0.1:1", config=configs[1])
    log = open(tmp / "engine.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(engine_command(spec, "127.0.0.1", port, path), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            cold_s = await wait_healthy(s, url, 300)
            seconds = []
            for i in range(num_reloads):
                body = configs[i % 2].to_dict()
                t = time.perf_counter()
                async with s.post(url + "/admin/reload", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                seconds.append(time.perf_counter() - t)
                async with s.post(url + "/v1/completions", json={
                        "model": MODEL, "prompt": "def f(x):", "max_tokens": 4}) as r:
                    assert r.status == 200
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    return {"cold_start_s": cold_s, "reload_s": seconds,
            "reload_median_s": statistics.median(seconds)}


def vllm_spec(speculative: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "name": "w",
        "launch": {"env": {"VLLM_CPU_KVCACHE_SPACE": "1"}, "startup_timeout_s": 900},
        "config": {"backend": "vllm", "model": str(TINY_TARGET), "served_model_name": MODEL,
                   "vllm": {"dtype": "float32", "gpu_memory_utilization": 0.3,
                            "max_num_seqs": 8,
                            "speculative_config": json.dumps(speculative) if speculative else "",
                            "args": ["--max-model-len", "2048", "--enforce-eager"]}},
    }


async def client_loop(url: str, stop: asyncio.Event, results: list[tuple[float, int]]) -> None:
    """Requests back to back; (monotonic end time, HTTP status or -1 for a client error)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        while not stop.is_set():
            try:
                async with s.post(url + "/v1/completions", json={
                        "model": MODEL, "prompt": "def add(a, b):\n    return a + b\n\ndef add(",
                        "max_tokens": 16, "temperature": 0}) as r:
                    await r.read()
                    results.append((time.monotonic(), r.status))
            except (aiohttp.ClientError, TimeoutError):
                results.append((time.monotonic(), -1))


def failures_by_phase(results: list[tuple[float, int]], t_post: float,
                      report: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Failed requests (status -> count) in each phase of the replacement."""
    bounds = [("before", t_post)]
    t = t_post
    for phase in ("start_s", "warmup_s", "drain_s", "stop_s"):
        t += report[phase]
        bounds.append((phase.removesuffix("_s"), t))
    out: dict[str, dict[str, int]] = {}
    for end, status in results:
        if status == 200:
            continue
        phase = next((name for name, until in bounds if end <= until), "after")
        out.setdefault(phase, {})
        out[phase][str(status)] = out[phase].get(str(status), 0) + 1
    return out


async def vllm_blue_green(tmp: Path) -> dict[str, Any]:
    config = ProxyConfig.from_dict({
        "server": {"port": 0}, "workers": [vllm_spec(None)],
        "auth": {"admin_key": ADMIN["x-admin-key"]}, "traces": {"enabled": False},
        "routing": {"shape_estimator": "heuristic"}, "run_dir": str(tmp / "run"),
        "health": {"interval_s": 0.5, "metrics_interval_s": 0.5}})
    server = ProxyServer(config)
    t0 = time.monotonic()
    await server.start()
    cold_s = time.monotonic() - t0
    stop, results = asyncio.Event(), list[tuple[float, int]]()
    clients = [asyncio.create_task(client_loop(server.url, stop, results)) for _ in range(2)]
    try:
        await asyncio.sleep(2.0)
        t_post = time.monotonic()
        body = {"config": vllm_spec({"method": "ngram", "num_speculative_tokens": 4,
                                     "prompt_lookup_max": 4, "prompt_lookup_min": 2})["config"]}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1200)) as s:
            async with s.post(server.url + "/admin/workers/w/replace", json=body,
                              headers=ADMIN) as r:
                report = await r.json()
                assert r.status == 200, report
        await asyncio.sleep(2.0)
    finally:
        stop.set()
        await asyncio.gather(*clients)
        await server.stop()
    return {"cold_start_s": cold_s, "replacement": report, "num_requests": len(results),
            "num_failed": sum(1 for _, c in results if c != 200),
            "failed_by_phase": failures_by_phase(results, t_post, report)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reloads", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        engine = await engine_reloads(args.reloads, tmp)
        vllm = await vllm_blue_green(tmp)
    rep = vllm["replacement"]
    print(f"engine  cold start {engine['cold_start_s']:.1f} s; hot reload "
          f"median {engine['reload_median_s'] * 1000:.0f} ms "
          f"({', '.join(f'{s * 1000:.0f}' for s in engine['reload_s'])} ms)")
    print(f"vllm    cold start {vllm['cold_start_s']:.1f} s; blue-green total {rep['total_s']:.1f} s"
          f" = start {rep['start_s']:.1f} + warm-up {rep['warmup_s']:.2f} + drain "
          f"{rep['drain_s']:.2f} + stop {rep['stop_s']:.2f}; client requests during it: "
          f"{vllm['num_requests']}, failed {vllm['num_failed']} "
          f"(by phase and status: {json.dumps(vllm['failed_by_phase'])})")
    print(f"ratio   blue-green / hot reload = {rep['total_s'] / engine['reload_median_s']:.0f}x; "
          f"traffic interruption: none for either (the old vLLM serves until the shift)")


if __name__ == "__main__":
    asyncio.run(main())
