"""The step loop's idle work: a finished request's output joins the n-gram pool off its path."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.loader import load_core
from engine.metrics import EngineMetrics
from engine.sequence import GenerationParams
from polyinfer.config import CompiledConfig, EngineConfig
from polyinfer.sampling import SamplingParams
from specdec.ngram import NgramProposer
from tests.engine.prompts import chat_text


async def test_an_idle_engine_pools_the_finished_output(tiny_model_dir: Path) -> None:
    cfg = CompiledConfig(model=str(tiny_model_dir), engine=EngineConfig(
        max_num_seqs=4, kv_cache_tokens=4096, spec_method="ngram", spec_max_depth=4))
    core = load_core(cfg)
    engine = AsyncEngine(core, EngineMetrics("tiny"))
    await engine.start()
    try:
        proposer = core.proposer
        assert isinstance(proposer, NgramProposer)
        ids = core.tokenizer.encode(chat_text("Repeat: a b c d e f g a b c d e f g"))
        params = GenerationParams(max_tokens=16, sampling=SamplingParams(0.0),
                                  ignore_eos=True, spec_depth=4)
        tokens = [t async for out in engine.generate("r0", ids, params)
                  for t in out.new_token_ids]
        assert len(tokens) == 16
        for _ in range(500):  # the step loop waits IDLE_WORK_AFTER_S, then flushes
            if not proposer._unpooled:
                break
            await asyncio.sleep(0.01)
        assert not proposer._unpooled
        assert proposer._pool is not None and len(proposer._pool) == 1
    finally:
        await engine.stop()


def _sample(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line
                                               for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name}{{{want}}}")


async def test_router_metrics_per_position_reason_and_gauges() -> None:
    from engine.async_engine import OutputRouter
    from engine.core import RequestOutput, StepStats

    metrics = EngineMetrics("tiny")
    router = OutputRouter(metrics)
    stream = router.open("a")
    steps = [StepStats(num_generated=4, num_drafts=1, num_draft_tokens=5,
                       num_accepted_tokens=3, accepted_per_pos=[1, 1, 1], num_running=1),
             StepStats(num_generated=2, num_drafts=1, num_draft_tokens=5,
                       num_accepted_tokens=1, accepted_per_pos=[1], num_waiting=2,
                       kv_usage=0.5)]
    outs = [RequestOutput("a", "x", [1, 2, 3, 4], False, None, None, 3, 4, 5, 3),
            RequestOutput("a", "y", [5, 6], True, "length", None, 3, 6, 10, 4)]
    for out, stats in zip(outs, steps, strict=True):
        router.deliver([out], stats)
    assert [stream.queue.get_nowait() for _ in outs] == outs
    text = metrics.expose().decode()
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [_sample(text, name, position=str(p)) for p in range(3)] == [2.0, 1.0, 1.0]
    assert _sample(text, "vllm:spec_decode_num_accepted_tokens_total") == 4.0
    assert _sample(text, "vllm:generation_tokens_total") == 6.0
    assert _sample(text, "vllm:request_success_total", finished_reason="length") == 1.0
    assert _sample(text, "vllm:num_requests_waiting") == 2.0
    assert _sample(text, "vllm:kv_cache_usage_perc") == 0.5
    assert _sample(text, "vllm:time_to_first_token_seconds_count") == 1.0
    assert _sample(text, "vllm:inter_token_latency_seconds_count") == 1.0


@pytest.mark.parametrize("announce_launch", [True, False])
def test_a_steps_outputs_are_posted_once_the_next_forward_is_launched(
        tiny_model_dir: Path, announce_launch: bool) -> None:
    """With CUDA graphs the runner announces each queued replay (``on_launch``); the CPU's
    eager forward does not, and there every step posts at its end. Here the announcement
    is made by wrapping the CPU runner's execute (no GPU on this machine; the GPU tests run
    the real replay path end to end)."""
    import queue
    import threading

    from engine.async_engine import Add, Command, StepLoop
    from engine.core import RequestOutput, StepStats

    cfg = CompiledConfig(model=str(tiny_model_dir), engine=EngineConfig(
        max_num_seqs=4, kv_cache_tokens=4096, spec_method="ngram", spec_max_depth=4))
    core = load_core(cfg)
    steps = [0]  # steps begun
    in_step = threading.Event()
    step = core.step

    def counted_step() -> tuple[list[RequestOutput], StepStats]:
        steps[0] += 1
        in_step.set()
        try:
            return step()
        finally:
            in_step.clear()

    core.step = counted_step  # type: ignore[method-assign]
    if announce_launch:
        execute = core.runner.execute

        def execute_announcing_launch(scheduled):  # type: ignore[no-untyped-def]
            assert core.runner.on_launch is not None
            core.runner.on_launch()
            return execute(scheduled)

        core.runner.execute = execute_announcing_launch  # type: ignore[method-assign]
    posts: list[tuple[list[RequestOutput], int, bool]] = []  # outputs, steps begun, in a step
    inbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
    loop = StepLoop(core, inbox, lambda outs, stats: posts.append(
        (outs, steps[0], in_step.is_set())))
    ids = core.tokenizer.encode(chat_text("Count: one two three four five six"))
    params = GenerationParams(max_tokens=12, sampling=SamplingParams(0.0), ignore_eos=True,
                              spec_depth=4)
    inbox.put(Add("r0", ids, params))
    thread = threading.Thread(target=loop.run)
    thread.start()
    for _ in range(1000):
        if any(o.finished for outs, _, _ in posts for o in outs):
            break
        threading.Event().wait(0.01)
    inbox.put(None)
    thread.join(timeout=30)
    carrying = [(outs, begun, inside) for outs, begun, inside in posts if outs]
    assert sum(len(o.new_token_ids) for outs, _, _ in carrying for o in outs) == 12
    assert carrying[-1][0][-1].finished
    if announce_launch:  # every step's outputs but the last left inside the next step
        assert all(inside for _, _, inside in carrying[:-1]) and not carrying[-1][2]
        assert [begun for _, begun, _ in carrying] == list(range(2, len(carrying) + 1)) + [
            len(carrying)]
    else:  # each step's outputs left at its end
        assert not any(inside for _, _, inside in carrying)
        assert [begun for _, begun, _ in carrying] == list(range(1, len(carrying) + 1))
