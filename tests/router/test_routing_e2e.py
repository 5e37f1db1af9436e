"""End to end on loopback: the real openai client -> polyinfer proxy with the router's
ShapeEstimator and AdaptivePolicy -> two real engine workers with different configs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import openai
import pytest
from aiohttp import web

from engine.server import create_app as create_engine_app
from polyinfer.config import TINY_TARGET, CompiledConfig, DeclaredFit
from proxy.app import create_app as create_proxy_app
from proxy.config import (
    HealthConfig,
    LimitsConfig,
    ProxyConfig,
    RoutingConfig,
    TraceConfig,
    WorkerSpec,
)
from proxy.supervisor import free_port
from router.adaptive import AdaptiveConfig, AdaptivePolicy
from router.shape import ShapeEstimator

pytestmark = pytest.mark.timeout(300)

SMALL = CompiledConfig(model=str(TINY_TARGET), fit=DeclaredFit(domains=("code",))).with_engine(
    max_num_seqs=4, max_num_batched_tokens=256, spec_method="ngram", spec_max_depth=3)
BIG = CompiledConfig(model=str(TINY_TARGET), fit=DeclaredFit(domains=("translation",))
                     ).with_engine(max_num_seqs=16, max_num_batched_tokens=1024)
PROMPTS = {
    "translation": "Translate German to English: Der Zug kommt heute später an .",
    "code": "Write a Python function that returns the n-th Fibonacci number using memoization.",
    "math": "Anna has 12 apples, eats 3 and buys twice as many as she has left. "
            "How many apples does she have now?",
}


async def start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def stack() -> AsyncIterator[tuple[str, AdaptivePolicy, ShapeEstimator]]:
    small, small_url = await start(create_engine_app(SMALL))
    big, big_url = await start(create_engine_app(BIG))
    policy = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0, confidence=None))
    estimator = ShapeEstimator.load(TINY_TARGET)
    config = ProxyConfig(
        workers=(WorkerSpec("spec-small", url=small_url, config=SMALL),
                 WorkerSpec("batch-big", url=big_url, config=BIG)),
        routing=RoutingConfig(policy="adaptive"), traces=TraceConfig(enabled=False),
        health=HealthConfig(interval_s=0.2, metrics_interval_s=0.2),
        # NOTE: the engines share this test's event loop, and the test box is loaded:
        # no loop-lag shedding here (tests/proxy covers it).
        limits=LimitsConfig(max_loop_lag_s=0))
    proxy, proxy_url = await start(create_proxy_app(config, estimator=estimator, policy=policy))
    await asyncio.sleep(0.5)  # first health probes
    try:
        yield proxy_url, policy, estimator
    finally:
        for r in (proxy, small, big):
            await r.cleanup()


async def test_requests_are_classified_routed_and_learned_from(stack) -> None:
    url, policy, estimator = stack
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    seen = []
    for round_ in range(2):
        for domain, text in PROMPTS.items():
            raw = await client.chat.completions.with_raw_response.create(
                model="tiny-target", messages=[{"role": "user", "content": text}],
                max_tokens=6, stream=round_ == 1)
            seen.append((domain, raw.headers["x-polyinfer-domain"],
                         raw.headers["x-polyinfer-worker"], raw.headers["x-polyinfer-spec-depth"]))
            if round_ == 1:
                async for _ in raw.parse():
                    pass
    assert [s[1] for s in seen] == [s[0] for s in seen]  # the classifier's domain header
    for _, _, worker, depth in seen:
        assert worker in ("spec-small", "batch-big")
        if worker == "batch-big":
            assert depth == "0"  # no speculation configured there
        else:
            assert depth.isdigit() and int(depth) <= 3  # the depth policy's k, capped
    stats = policy.stats()
    assert sum(stats["reasons"].values()) == len(PROMPTS) * 2
    for _ in range(300):  # outcomes are reported after the response completes (<= 30 s)
        if sum(p["num_samples"] for p in policy.stats()["profiles"].values()) == 6:
            break
        await asyncio.sleep(0.1)
    assert sum(p["num_samples"] for p in policy.stats()["profiles"].values()) == 6
    learned = estimator.stats()["output_tokens"]
    assert learned["translation"]["num_observed"] == 2 and learned["code"]["num_observed"] == 2


async def test_a_shared_prefix_goes_back_to_its_worker_and_its_hits_are_learned(stack) -> None:
    """Both engines cache prefixes (the default): the requests sharing a ~600-token prefix
    stay where the first one went, and the engine's reported cached tokens
    (usage.prompt_tokens_details, relayed by the proxy) reach the policy's hit ratio."""
    url, policy, _ = stack
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    shared = " ".join(f"Section {i}: the committee reviewed the budget." for i in range(60))
    workers = []
    for question in ("What was reviewed?", "Who reviewed it?", "Which sections?"):
        stream = await client.chat.completions.with_raw_response.create(
            model="tiny-target", max_tokens=4, stream=True,
            messages=[{"role": "user", "content": f"{shared}\n\n{question}"}])
        workers.append(stream.headers["x-polyinfer-worker"])
        async for _ in stream.parse():
            pass
        for _ in range(300):  # the outcome is reported after the response completes
            if policy.stats()["in_flight"] == 0:
                break
            await asyncio.sleep(0.1)
    assert workers[1] == workers[0] and workers[2] == workers[0]
    modelled = policy.stats()["prefix_cache"]
    assert list(modelled) == [workers[0]] and modelled[workers[0]]["blocks"] >= 8
    # the engine found what the model predicted for the second and third requests
    assert modelled[workers[0]]["hits_observed"] == 2 and modelled[workers[0]]["hit_ratio"] > 0.5
