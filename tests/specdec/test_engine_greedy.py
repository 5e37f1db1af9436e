"""End to end in the real engine core: greedy output is the same at any depth, with either proposer.

Spec-Bench prompts across domains run in one continuous batch in which every
request has its own ``speculative_depth`` (0..6); their texts must equal a run
of the same prompts on an engine without speculation. This exercises the
proposers, ``verify`` and the engine's step loop together.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.core import EngineCore
from engine.loader import load_core
from engine.sequence import GenerationParams
from polyinfer.config import TINY_DRAFT, TINY_TARGET, CompiledConfig, EngineConfig
from polyinfer.sampling import SamplingParams
from tests.engine.drive import generate

PROMPTS = Path(__file__).resolve().parents[2] / "data" / "prompts" / "spec_bench_questions.jsonl"
NUM_PROMPTS = 20
MAX_TOKENS = 16
DEPTHS = (0, 1, 2, 3, 4, 6)

pytestmark = [
    pytest.mark.skipif(not (TINY_TARGET / "model.safetensors").exists()
                       or not (TINY_DRAFT / "model.safetensors").exists(),
                       reason="the bundled model pair is not trained yet"),
]


def _prompts() -> list[str]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    by_category: dict[str, list[str]] = {}
    for row in rows:
        by_category.setdefault(row["category"], []).append(row["turns"][0])
    # round-robin over categories so every domain is represented
    out: list[str] = []
    while len(out) < NUM_PROMPTS:
        for texts in by_category.values():
            if texts and len(out) < NUM_PROMPTS:
                out.append(texts.pop(0))
    return out


def _run(core: EngineCore, prompts: list[str], depths: list[int]) -> tuple[list[str], int, int]:
    ids = [core.tokenizer.encode(core.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], True)) for text in prompts]
    params = [GenerationParams(max_tokens=MAX_TOKENS, sampling=SamplingParams(0.0),
                               ignore_eos=True, spec_depth=depth) for depth in depths]
    texts: dict[str, str] = {}
    _, drafted, accepted = generate(core, ids, params, texts=texts)
    return [texts.get(f"r{i}", "") for i in range(len(prompts))], drafted, accepted


def _core(**engine: object) -> EngineCore:
    cfg = EngineConfig(max_num_seqs=NUM_PROMPTS, kv_cache_tokens=16384, **engine)  # type: ignore
    return load_core(CompiledConfig(model=str(TINY_TARGET), engine=cfg))


@pytest.fixture(scope="module")
def reference() -> list[str]:
    prompts = _prompts()
    texts, drafted, _ = _run(_core(), prompts, [0] * len(prompts))
    assert drafted == 0
    return texts


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_identical_at_every_depth(method: str, reference: list[str]) -> None:
    prompts = _prompts()
    depths = [DEPTHS[i % len(DEPTHS)] for i in range(len(prompts))]
    core = _core(spec_method=method, spec_max_depth=max(DEPTHS), draft_model=str(TINY_DRAFT)
                 if method == "draft" else "")
    texts, drafted, accepted = _run(core, prompts, depths)
    assert drafted > 0 and accepted > 0  # speculation really happened
    mismatched = [i for i, (a, b) in enumerate(zip(texts, reference, strict=True)) if a != b]
    assert mismatched == [], [(i, depths[i]) for i in mismatched]
    if core.proposer is not None and hasattr(core.proposer, "num_tracked"):
        assert core.proposer.num_tracked == 0  # every finished sequence released its state
