"""Integration: loadgen through the real `polyinfer serve` proxy, then a replay of the proxy's
own trace records.

The proxy fronts the scripted upstream fixture (``--worker``), so the test
knows the timing underneath; the proxy adds its headers and writes trace
records, which loadgen must read (``--format auto``) and replay with the
recorded lengths.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from loadgen import (
    ArrivalConfig,
    ClientConfig,
    LengthConfig,
    OutputConfig,
    ReplayConfig,
    TraceConfig,
    replay,
)
from loadgen.readers import detect_format, read_trace
from polyinfer.config import DOMAINS, TINY_TARGET
from proxy.supervisor import free_port
from tests.loadgen.conftest import DATA
from tests.loadgen.servers import running_server
from tests.loadgen.upstream import Script, ScriptedUpstream


@pytest_asyncio.fixture
async def upstream_slow() -> AsyncIterator[ScriptedUpstream]:
    server = ScriptedUpstream(Script(ttft_s=0.05, itl_s=0.005))
    await server.start()
    yield server
    await server.close()


@pytest.mark.timeout(400)
async def test_through_the_proxy_and_back_from_its_traces(upstream_slow: ScriptedUpstream,
                                                          tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "proxy.cli", "serve", "--worker", upstream_slow.url,
            "--port", str(port)]
    # the proxy writes traces/ under its cwd; leaving the context stops it, which flushes them
    async with running_server(argv, port, tmp_path) as proxy_url:
        cfg = ReplayConfig(
            trace=TraceConfig(str(DATA / "prompts/spec_bench_questions.jsonl")),
            client=ClientConfig(proxy_url),
            arrivals=ArrivalConfig(mode="poisson", rate=20.0, max_requests=6, seed=2),
            lengths=LengthConfig(default_output_tokens=4), output=OutputConfig(quiet=True),
            tokenizer=str(TINY_TARGET))
        first = await replay(cfg)
    assert first.summary["num_ok"] == 6
    assert set(first.summary["by_worker"]) == {"w0"}
    assert all(r.domain in DOMAINS and r.request_id for r in first.results)
    assert len(upstream_slow.received) == 6
    assert all(r.ttft_s is not None and r.ttft_s >= 0.05 for r in first.results)

    (trace,) = (tmp_path / "traces").glob("*.jsonl")
    assert detect_format(trace) == "polyinfer"
    records = list(read_trace(trace))
    assert len(records) == 6 and all(r.prompt is None and r.messages is None for r in records)
    upstream_slow.received = []
    again = await replay(ReplayConfig(
        trace=TraceConfig(str(trace)), client=ClientConfig(upstream_slow.url),
        arrivals=ArrivalConfig(mode="trace"), output=OutputConfig(quiet=True),
        tokenizer=str(TINY_TARGET)))
    assert again.summary["num_ok"] == 6 and again.summary["trace"]["format"] == "polyinfer"
    by_time = sorted(records, key=lambda r: r.timestamp_s or 0.0)
    replayed = sorted(again.results, key=lambda r: r.index)
    assert [r.expected_prompt_tokens for r in replayed] == [r.prompt_tokens for r in by_time]
    assert [r.max_tokens for r in replayed] == [r.output_tokens for r in by_time] == [4] * 6
    assert [r.domain for r in replayed] == [r.domain for r in by_time]
    assert len(upstream_slow.received) == 6
