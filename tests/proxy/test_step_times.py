"""The engine's per-step timings reach the proxy's depth policies through the scrape loop."""

from __future__ import annotations

from pathlib import Path

import openai

from proxy import keys
from specdec.policy import DepthPolicy
from tests.proxy.servers import EngineProcess, ProxyThread, eventually, external_config, read_traces

MODEL = "tiny-target"


def test_engine_step_times_reach_both_depth_policies(engines: list[EngineProcess],
                                                      tmp_path: Path) -> None:
    config = external_config(engines, tmp_path, routing={"policy": "adaptive"})
    with ProxyThread(config) as proxy:
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none")
        for i in range(4):
            client.completions.create(model=MODEL, prompt=f"Count from {i}:", max_tokens=12)
        assert eventually(lambda: len(read_traces(tmp_path / "traces")) == 4, 10.0)
        served = {r["worker"] for r in read_traces(tmp_path / "traces")}
        relay = proxy.app[keys.RELAY]
        policies = [relay.depth_policy, relay.policy.depth_policy]
        assert all(isinstance(p, DepthPolicy) for p in policies)
        assert policies[0] is not policies[1]

        def fed() -> bool:
            return all(p.step_time(w).num_fed_steps > 0 for p in policies for w in served)

        # the scrape runs every 0.5 s here; each hands the engine's steps since the last one
        assert eventually(fed, 10.0)
