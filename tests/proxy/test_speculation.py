"""The ``speculation`` settings decide the depth the adaptive router prices, records and sends.

A bug this guards against: with ``speculation: {mode: off}`` the relay sent depth 0 while
the adaptive router priced and recorded its own depth policy's (3 on the n-gram worker,
for 9 of 10 requests).
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from proxy import keys
from tests.proxy.servers import EngineProcess, ProxyThread, eventually, external_config, read_traces

MODEL = "tiny-target"
PROMPT = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 3


@pytest.mark.parametrize(("speculation", "depth"), [({"mode": "off"}, 0),
                                                    ({"mode": "fixed", "fixed_depth": 2}, 2)])
def test_adaptive_router_prices_and_records_the_depth_sent(
        engines: list[EngineProcess], tmp_path: Path, speculation: dict[str, object],
        depth: int) -> None:
    config = external_config(engines, tmp_path, routing={"policy": "adaptive"},
                             speculation=speculation)
    with ProxyThread(config) as proxy:
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none")
        sent = []
        for i in range(10):
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=f"{PROMPT}# {i}\n", max_tokens=8)
            sent.append((raw.headers["x-polyinfer-worker"], raw.headers["x-polyinfer-spec-depth"]))
        assert eventually(lambda: len(read_traces(tmp_path / "traces")) == 10, 10.0)
        policy = proxy.app[keys.RELAY].policy
        stats = policy.stats()  # type: ignore[attr-defined]
    # the depth pinned by the settings is sent to both engine workers; the n-gram worker
    # runs it (up to its spec_max_depth, 4), the other runs none: what the router records
    assert all(d == str(depth) for _, d in sent), sent
    num_latency = sum(w == "latency" for w, _ in sent)
    recorded = {str(depth): num_latency, "0": 10 - num_latency} if depth else {"0": 10}
    assert stats["depths"] == {k: v for k, v in recorded.items() if v}
    assert {r["spec_depth"] for r in read_traces(tmp_path / "traces")} == {depth}
