"""Integration: loadgen against a real `polyinfer engine` serving the bundled model.

The engine reports ``usage.prompt_tokens`` from its own tokenizer, so this
checks end to end that synthesized prompts (completions) and templated chat
prompts have exactly the length loadgen intended, and that ``ignore_eos``
yields exactly ``max_tokens``.
"""

from __future__ import annotations

import json
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
    SloConfig,
    TraceConfig,
    replay,
)
from polyinfer.config import TINY_TARGET
from proxy.supervisor import free_port
from tests.loadgen.conftest import DATA, REPO
from tests.loadgen.servers import running_server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine_url() -> AsyncIterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "proxy.cli", "engine", "--model", str(TINY_TARGET),
            "--port", str(port)]
    async with running_server(argv, port, REPO) as url:
        yield url


@pytest.mark.timeout(400)
@pytest.mark.asyncio(loop_scope="module")
async def test_replay_against_the_engine(engine_url: str, tmp_path: Path) -> None:
    trace = tmp_path / "mc.jsonl"
    rows = [(0, 3000, 6, [1, 2, 3, 4, 5, 6]), (200, 2600, 4, [1, 2, 3, 4, 9]),
            (300, 900, 5, [7, 8])]
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o,
                                         "hash_ids": h}) + "\n" for t, i, o, h in rows))
    cfg = ReplayConfig(
        trace=TraceConfig(str(trace)), client=ClientConfig(engine_url),
        arrivals=ArrivalConfig(mode="trace"),
        lengths=LengthConfig(prompt_scale=0.25, max_model_len=2048),
        slo=SloConfig(ttft_s=60.0, tpot_s=10.0), output=OutputConfig(quiet=True),
        tokenizer=str(TINY_TARGET))
    result = await replay(cfg)
    s = result.summary
    assert s["num_ok"] == 3, s["errors"]
    assert s["model"] == "tiny-target"
    by_index = sorted(result.results, key=lambda r: r.index)
    assert [r.expected_prompt_tokens for r in by_index] == [750, 650, 225]
    assert [r.prompt_tokens for r in by_index] == [750, 650, 225]  # the engine's own count
    assert [r.completion_tokens for r in by_index] == [6, 4, 5]  # ignore_eos
    assert all(r.ttft_s and r.tpot_s and len(r.itl_s) >= 1 for r in by_index)
    assert s["num_prompt_token_mismatch"] == 0 and s["num_good"] == 3


@pytest.mark.timeout(400)
@pytest.mark.asyncio(loop_scope="module")
async def test_chat_prompts_count_the_template(engine_url: str) -> None:
    cfg = ReplayConfig(
        trace=TraceConfig(str(DATA / "prompts/spec_bench_questions.jsonl")),
        client=ClientConfig(engine_url),
        arrivals=ArrivalConfig(mode="concurrency", concurrency=2, max_requests=2),
        lengths=LengthConfig(default_output_tokens=3), output=OutputConfig(quiet=True))
    # no tokenizer given: loadgen uses the checkpoint the engine reports as the model's root
    result = await replay(cfg)
    assert result.summary["num_ok"] == 2 and result.summary["prompts"]["exact"]
    for r in result.results:
        assert r.prompt_tokens == r.expected_prompt_tokens and r.completion_tokens == 3
