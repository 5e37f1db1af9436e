"""The LLM agent against an OpenAI-compatible endpoint on loopback.

No model that proposes sensible configs can run here, so the endpoint is a
fixture (tests/optimizer/fake_llm.py, a fake): a real aiohttp server that answers
chat completions with canned text and records what it was asked.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from optimizer.agents.base import BoardView
from optimizer.agents.llm import LlmAgent, parse_points
from optimizer.space import SearchSpace
from polyinfer.config import CompiledConfig
from tests.optimizer.fake_llm import FakeLlm


def test_parse_points_finds_the_json_list() -> None:
    text = 'Sure! Here you go:\n```json\n[{"max_num_seqs": 8}, 3, {"spec_method": "ngram"}]\n```'
    assert parse_points(text) == [{"max_num_seqs": 8}, {"spec_method": "ngram"}]
    assert parse_points("no json [here") == []
    assert parse_points("[not json] then [{\"a\": 1}]") == [{"a": 1}]


@pytest.fixture
def space(model_dir: Path) -> SearchSpace:
    base = CompiledConfig(model=str(model_dir)).with_engine(kv_cache_tokens=8192,
                                                            max_model_len=1024)
    return SearchSpace.default(base, 1 << 30)


async def test_llm_agent_repairs_and_dedups_answers(space: SearchSpace) -> None:
    answer = json.dumps([
        {"max_num_seqs": 8, "max_num_batched_tokens": 512, "spec_method": "ngram",
         "spec_max_depth": 0, "spec_default_depth": 0},  # repaired: depth >= 1
        {"max_num_seqs": 4, "max_num_batched_tokens": 256},
        {"max_num_seqs": 4, "max_num_batched_tokens": 256},  # duplicate
        {"no_such_knob": 1},
    ])
    fake = FakeLlm(f"Here are my picks: {answer}")
    runner, url = await fake.start()
    try:
        agent = LlmAgent(space, url, model="m")
        measured = {space.key(space.build({"max_num_seqs": 16})): 120.0}
        view = BoardView("c", measured, frozenset(measured))
        cands = await asyncio.get_running_loop().run_in_executor(None, agent.propose, view, 3)
    finally:
        await runner.cleanup()
    assert len(cands) == 2
    spec = cands[0].config.engine
    assert spec.spec_method == "ngram" and spec.spec_max_depth == 1
    assert cands[1].config.engine.max_num_seqs == 4
    prompt = fake.requests[0]["messages"][0]["content"]
    assert "max_num_seqs" in prompt and "120.0" in prompt and fake.requests[0]["model"] == "m"


def test_llm_agent_survives_a_dead_endpoint(space: SearchSpace) -> None:
    agent = LlmAgent(space, "http://127.0.0.1:9", timeout_s=2)
    assert agent.propose(BoardView("c", {}, frozenset()), 2) == []
