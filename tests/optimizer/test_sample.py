from __future__ import annotations

import pytest

from optimizer.errors import OptimizerError
from optimizer.measure import _reported_seconds
from optimizer.sample import DomainPromptSynthesizer, SampleConfig, build_replay
from polyinfer.config import TINY_TARGET
from polyinfer.trace import TraceRecord


@pytest.fixture(scope="module")
def synth() -> DomainPromptSynthesizer:
    return DomainPromptSynthesizer(TINY_TARGET / "tokenizer.json", seed=7)


def test_replay_caps_lengths_and_keeps_arrival_offsets(synth: DomainPromptSynthesizer) -> None:
    records = [TraceRecord(10.0, "code", 5000, completion_tokens=900),
               TraceRecord(12.0, "math", 30, completion_tokens=1),
               TraceRecord(11.0, "chat", 100, max_tokens=20),
               TraceRecord(13.0, "qa", 40, completion_tokens=10, prompt_text="What is 2+2?")]
    reqs = build_replay(records, synth, SampleConfig(max_prompt_tokens=64, max_output_tokens=16,
                                                     min_output_tokens=4, time_scale=2.0))
    assert [r.domain for r in reqs] == ["code", "chat", "math", "qa"]
    assert [r.offset_s for r in reqs] == [0.0, 0.5, 1.0, 1.5]
    assert [r.max_tokens for r in reqs] == [16, 16, 4, 10]
    assert 60 <= reqs[0].prompt_tokens <= 64 and 25 <= reqs[2].prompt_tokens <= 30
    assert reqs[3].prompt == "What is 2+2?"  # recorded text is used as is
    assert "def " in reqs[0].prompt or "class " in reqs[0].prompt or "import" in reqs[0].prompt


def test_recorded_prompts_are_cut_to_the_cap(synth: DomainPromptSynthesizer) -> None:
    long_text = "The quick brown fox jumps over the lazy dog. " * 40
    records = [TraceRecord(1.0, "chat", 400, completion_tokens=8, prompt_text=long_text)]
    (req,) = build_replay(records, synth, SampleConfig(max_prompt_tokens=32))
    assert 28 <= req.prompt_tokens <= 32 and long_text.startswith(req.prompt.strip()[:40])
    assert synth.truncate("short", 32) == "short"


def test_same_seed_same_prompts() -> None:
    a = DomainPromptSynthesizer(TINY_TARGET / "tokenizer.json", seed=3)
    b = DomainPromptSynthesizer(TINY_TARGET / "tokenizer.json", seed=3)
    assert [a.make(d, 40) for d in ("code", "math", "rag")] == [
        b.make(d, 40) for d in ("code", "math", "rag")]


def test_sample_config_is_checked() -> None:
    with pytest.raises(OptimizerError, match="min_output_tokens"):
        SampleConfig(max_output_tokens=4, min_output_tokens=8)
    with pytest.raises(OptimizerError, match="time_scale"):
        SampleConfig(time_scale=0)


def test_reload_seconds_from_the_engine_answer() -> None:
    assert _reported_seconds('{"status": "ok", "reload_s": 0.25}', 0.9) == 0.25
    assert _reported_seconds("not json", 0.9) == 0.9
    assert _reported_seconds('{"status": "ok"}', 0.9) == 0.9



def test_process_cpu_clock_counts_this_process_work() -> None:
    import os

    from optimizer.engine_proc import process_cpu_seconds

    t0 = process_cpu_seconds(os.getpid())
    sum(i * i for i in range(500_000))
    t1 = process_cpu_seconds(os.getpid())
    assert t1 > t0
