"""The whole loop through ``polyinfer serve --optimize``, on loopback, in one piece.

A real proxy (built from the ``serve`` command line, flags included) over a real
engine worker whose config is deliberately poor for its traffic (one sequence
at a time under three concurrent clients), the optimizer's own measurement
engine, and the
LLM agent as the only proposer, asking a scripted OpenAI-compatible endpoint
(:class:`FakeLlm`, a fake: no model that proposes configs can run here). The
fake first answers prose without a list, then a list with one good point and
two invalid ones; every unusable proposal must be rejected with its reason on
the board, and the good one measured and confirmed beyond noise. It is
promoted by hot reload. The worker runs under the test-only fault injector
(tests/optimizer/faults.py): its ``slow_prompts`` fault makes every config but
the incumbent start long prompts three seconds late, so the promotion regresses one
shape only, and the per-shape canary must roll it back by itself, naming that
shape and metric in /stats and on the board. No client request may fail.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from optimizer.board import Board
from optimizer.engine_proc import EngineProcess
from optimizer.measure import EngineClient
from optimizer.sample import DomainPromptSynthesizer
from polyinfer.config import TINY_TARGET, CompiledConfig
from proxy.cli import build_parser
from proxy.serve_cli import build_config
from proxy.server import ProxyServer
from tests.optimizer.fake_llm import FakeLlm
from tests.optimizer.faults import LAUNCHER

pytestmark = pytest.mark.timeout(240)

# one sequence at a time: four concurrent clients queue behind each other
POOR = CompiledConfig(model=str(TINY_TARGET)).with_engine(
    kv_cache_tokens=8192, max_model_len=1024, max_num_seqs=1, max_num_batched_tokens=512)
SETTINGS = {
    "knobs": [{"name": "max_num_seqs", "values": [1, 8]}],
    # decode-heavy replays at a fixed concurrency of 8, scored in tokens per engine CPU
    # second (steady on a shared box): one sequence at a time costs ~4x the CPU
    "objective": "cpu", "concurrency_from_traffic": False,
    # NOTE: three closed-loop clients of a one-sequence worker: their Little's-law
    # concurrency follows the worker's e2e, which the measurement engine's CPU use moves on
    # a busy machine (0 -> 1 of the distance; CI refused a winner as profile_stale twice).
    # Only a shift of the requests themselves stops this promotion; the load term's own
    # refusal is tests/optimizer/test_stale_profile.py's
    "shift_threshold": 1.5,
    "fast": {"name": "fast", "num_layers": 2, "num_requests": 4, "concurrency": 8,
             "warmup_requests": 1},
    "slow": {"name": "slow", "num_layers": None, "num_requests": 8, "repeats": 3,
             "concurrency": 8, "warmup_requests": 0},
    "sample": {"max_prompt_tokens": 32, "max_output_tokens": 16},
    "search": {"fast_budget": 2, "finalists": 1, "idle_timeout_s": 20, "max_pairs": 3,
               "min_detectable_effect": 0.5, "spec_method_margin": None},
    # NOTE: batching eight sequences instead of one makes each token of the short requests
    # 1-7x slower here (they no longer queue, so they mostly finish sooner, but not always
    # beyond noise in 5 samples): this operator judges the switch by TTFT and errors and
    # tolerates TPOT up to 10x, so that the planted regression is what the canary finds
    "promotion": {"watch_s": 1.0, "max_watch_s": 40.0, "max_tpot_regression": 10.0,
                  "canary": {"min_samples": 6}},
    "verify": {"max_batch": 8, "prompt_tokens": [56, 96], "max_tokens": [4, 6]},
}
ANSWERS = [
    "More concurrency should help here; I would raise the batch.",  # no JSON list
    json.dumps([{"max_num_seqs": 8}, {"max_num_seqs": "lots"}, {"kv_cache_tokens": 99}]),
]


class Clients:
    """Closed-loop streaming clients through the proxy; every request must come back whole."""

    def __init__(self, url: str, prompts: list[str]) -> None:
        self.url, self.prompts = url, prompts
        self.think_s = 0.2
        self.num_ok = 0
        self.failed: list[str] = []

    async def run(self, stop: asyncio.Event, concurrency: int) -> None:
        async with aiohttp.ClientSession() as s:
            await asyncio.gather(*(self._client(s, i, stop) for i in range(concurrency)))

    async def _client(self, s: aiohttp.ClientSession, i: int, stop: asyncio.Event) -> None:
        n = i
        while not stop.is_set():
            body = {"model": "tiny-target", "prompt": self.prompts[n % len(self.prompts)],
                    "max_tokens": 8, "ignore_eos": True, "temperature": 0, "stream": True}
            n += 1
            async with s.post(self.url + "/v1/completions", json=body) as r:
                lines = [ln.decode().strip() async for ln in r.content]
            if r.status != 200 or "data: [DONE]" not in lines:
                self.failed.append(f"HTTP {r.status}: {lines[-2:]}")
            else:
                self.num_ok += 1
            # NOTE: a pause between requests leaves the measurement engine some CPU
            await asyncio.sleep(self.think_s)


def serve_config(tmp: Path, worker_url: str, llm_url: str) -> Any:
    proxy_yaml = tmp / "proxy.yaml"
    proxy_yaml.write_text(yaml.safe_dump({
        "server": {"host": "127.0.0.1", "port": 0},
        "workers": [{"name": "w", "url": worker_url, "config": POOR.to_dict()}],
        "traces": {"dir": str(tmp / "traces"), "flush_interval_s": 0.2},
        "health": {"interval_s": 0.5, "metrics_interval_s": 0.5},
        "limits": {"max_loop_lag_s": 0},
        "optimize": {"min_records": 30, "board_path": str(tmp / "board.sqlite")},
        "run_dir": str(tmp / "run")}))
    settings = tmp / "optimizer.yaml"
    settings.write_text(yaml.safe_dump(SETTINGS))
    return build_config(build_parser().parse_args([
        "serve", "--config", str(proxy_yaml), "--optimize", "--optimize-agents", "llm",
        "--optimize-llm-url", llm_url, "--optimize-llm-model", "fake-llm",
        "--optimize-settings", str(settings)]))


async def serving(url: str, timeout_s: float = 60.0) -> None:
    """Until the proxy has seen the worker healthy (its first probe after start-up).

    NOTE: read from /stats, not by sending requests: each refused request is a trace
    record, and on a busy machine a dozen "x" prompts in the campaign's first 30 records
    moved its profile so far from the traffic's that the winner was refused as stale."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while True:
            async with s.get(url + "/stats") as r:
                workers = (await r.json())["workers"]
            if workers and all(w["healthy"] for w in workers):
                return
            assert time.monotonic() < deadline, workers
            await asyncio.sleep(0.2)


async def wait_for_campaign(server: ProxyServer, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while True:
            async with s.get(server.url + "/stats") as r:
                doc = (await r.json())["optimizers"]["w"]
            assert doc["state"] != "failed", doc["last_error"]
            if doc["history"]:
                return doc
            assert time.monotonic() < deadline, doc
            await asyncio.sleep(0.5)


async def test_campaign_promotion_planted_regression_and_rollback(tmp_path: Path) -> None:
    synth = DomainPromptSynthesizer(TINY_TARGET / "tokenizer.json", seed=3)
    # short code prompts (band 0-256) and long chat prompts (band 256-1024, > 1,000 chars)
    long = synth.make("chat", 420)  # one text: one shape, the prefix cache warm for it
    prompts = [synth.make("code", 30), long, synth.make("code", 40)]
    assert len(prompts[1]) > 1000 > len(prompts[0]) + 200
    fake = FakeLlm(*ANSWERS, "[]")  # then empty lists
    llm_runner, llm_url = await fake.start()
    live = EngineProcess(POOR, launcher=LAUNCHER, log_path=tmp_path / "live.log")
    t0 = time.monotonic()
    server = ProxyServer(serve_config(tmp_path, live.url, llm_url))
    try:
        # the worker and the proxy (whose optimizer starts its measurement engine) at once
        await asyncio.gather(live.start(), server.start())
        async with aiohttp.ClientSession() as s:
            async with s.post(live.url + "/test/fault",
                              json={"name": "slow_prompts", "sleep_s": 3.0}) as r:
                assert r.status == 200
        await serving(server.url)
        try:
            clients, stop = Clients(server.url, prompts), asyncio.Event()
            load = asyncio.create_task(clients.run(stop, concurrency=3))
            try:
                doc = await wait_for_campaign(server, 180)
            finally:
                stop.set()
                await load
            async with aiohttp.ClientSession() as s:
                live_cfg = await EngineClient(live.url, s).config()
                async with s.get(live.url + "/test/fault") as r:
                    fault = await r.json()
        finally:
            await server.stop()
    finally:
        await live.stop()
        await llm_runner.cleanup()
    seconds = time.monotonic() - t0

    (entry,) = doc["history"]
    # NOTE: on a failure the campaign's recent log says what each fast-tier run measured
    assert entry.get("significant") and entry["gain"] > 0.3, (entry, doc.get("campaign"))
    assert entry["status"] == "rolled_back", entry
    # the reason names the long prompts' shape and their TTFT, with numbers
    assert "prompt 256-1024" in entry["reason"] and "TTFT" in entry["reason"], entry["reason"]
    regressed = doc["canary"]["regressed"]
    assert regressed["metric"] == "ttft_s" and regressed["ratio_low"] > 1.5
    assert regressed["shape"].endswith("prompt 256-1024")
    short = [row for name, row in doc["canary"]["shapes"].items() if "prompt 0-256" in name]
    assert short and all(row.get("ttft_s", {}).get("ratio_low", 0) < 1.5 for row in short)
    assert fault["num_triggered"] > 0
    assert live_cfg.engine.max_num_seqs == 1  # back on the incumbent
    assert clients.failed == [] and clients.num_ok > 40

    board = Board(tmp_path / "board.sqlite")
    (promotion,) = board.promotions()
    assert promotion["status"] == "rolled_back"
    assert board.notes(entry["campaign"], kind="rolled_back")  # the canary's table
    rejected = [n.body["reason"] for n in board.notes(entry["campaign"],
                                                      kind="rejected_proposal")]
    assert any("no JSON list" in r for r in rejected)
    assert any("lots" in r for r in rejected) and any("kv_cache_tokens" in r for r in rejected)
    measured = {r.agent for r in board.results(entry["campaign"], "fast")}
    assert "llm" in measured
    assert entry["rejected_proposals"] == {"llm": 3} and entry["agents"]["llm"] == 1
    assert len(fake.requests) >= 2 and fake.requests[0]["model"] == "fake-llm"
    print(f"whole loop: {seconds:.0f} s, {clients.num_ok} requests, canary "
          f"{regressed}")
