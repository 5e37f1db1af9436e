"""The graph runner's look-ahead (engine.runner.ModelRunner._look_ahead): a decode step
launched before the last step's tokens are read back must change no output. Also the
split decode attention (engine.forward.split_attention) on the same row-decoder engines.

On the CPU the graphs' forward runs uncaptured (engine.cuda_graph.RowDecoder) under
Triton's interpreter; on a GPU through captured graphs. Each compares an engine that
looks ahead with one that runs every step in series, token for token, over what makes
a step launched ahead wrong or useless: rows that finish (length, EOS), arrivals,
sampled and seeded rows, logprobs, block boundaries and preemption under KV pressure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.sequence import GenerationParams
from polyinfer.config import TINY_TARGET, CompiledConfig, EngineConfig
from polyinfer.sampling import SamplingParams
from tests.engine.drive import run_interpreted

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cases() -> list[tuple[list[list[int]], list[GenerationParams], int]]:
    """(prompts, params, steps after which the last request arrives; 0: all at once)."""
    def greedy(n: int, eos: bool = False) -> GenerationParams:
        return GenerationParams(max_tokens=n, sampling=SamplingParams(0.0), ignore_eos=not eos)

    prompts = [list(range(5, 25)), list(range(40, 47)), [9] * 12]
    return [
        ([prompts[0]], [greedy(24)], 0),  # batch 1 over the block boundary at 32
        (prompts, [greedy(n) for n in (5, 12, 8)], 0),  # finishes make subsets
        (prompts, [greedy(9), greedy(10, eos=True), greedy(6)], 4),  # an arrival
        (prompts[:2], [GenerationParams(max_tokens=8, ignore_eos=True, sampling=s) for s in (
            SamplingParams.seeded(7, 0.8, top_p=0.9), SamplingParams(0.9))], 0),
        (prompts[1:], [GenerationParams(max_tokens=6, ignore_eos=True, logprobs=2),
                       greedy(6)], 0),
    ]


def generate(core: Any, prompts: list[list[int]], params: list[GenerationParams],
             arrive_after: int) -> list[list[int]]:
    """Outputs per prompt; the last prompt is added after ``arrive_after`` steps if > 0."""
    last = len(prompts) - 1 if arrive_after else len(prompts)
    for i in range(last):
        core.add_request(f"r{i}", prompts[i], params[i])
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    torch.manual_seed(0)  # unseeded sampling draws the same uniforms on both engines
    for step in range(2000):
        if step == arrive_after and last < len(prompts):
            core.add_request(f"r{last}", prompts[last], params[last])
        if not core.has_work and step > arrive_after:
            break
        for o in core.step()[0]:
            out[o.request_id].extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def row_core(look_ahead: bool, kv_cache_tokens: int = 1024, forward: Any = None,
             max_tokens: int = 0) -> Any:
    """A CPU engine (2 layers) whose decode steps run through the graphs' forward,
    uncaptured; prompts, more rows than its largest bucket (4), run eager. ``max_tokens``:
    a step budget of that many rows, every prompt chunk through the graphs' forward too
    (prompts up to 256 tokens)."""
    from engine.cuda_graph import RowDecoder, graph_buckets
    from engine.loader import load_core
    from engine.runner import ModelRunner
    from polyinfer.config import ForwardConfig

    core = load_core(CompiledConfig(model=str(TINY_TARGET), engine=EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=max_tokens or 64,
        kv_cache_tokens=kv_cache_tokens, max_model_len=256 if max_tokens else 64,
        measure_num_layers=2, forward=forward or ForwardConfig())))
    old = core.runner
    graphs = RowDecoder(core.model, old.kv, graph_buckets(4, max_tokens=max_tokens),
                        core.max_model_len + 1)
    core.runner = ModelRunner(core.model, old.kv, old.short_q, graphs=graphs,
                              on_launch=core._launched,
                              more_waiting=lambda: bool(core.scheduler.waiting))
    core.runner.look_ahead = look_ahead
    return core


def check_look_ahead_changes_no_output() -> None:
    """Run under Triton's interpreter (the decode attention kernel)."""
    for kv_tokens, todo in ((1024, cases()), (64, cases()[1:2])):  # 64: preemption
        ahead, serial = row_core(True, kv_tokens), row_core(False, kv_tokens)
        for prompts, params, arrive in todo:
            want = generate(serial, prompts, params, arrive)
            got = generate(ahead, prompts, params, arrive)
            assert got == want, (kv_tokens, params, got, want)
            assert all(len(t) == p.max_tokens for t, p in zip(want, params, strict=True)
                       if p.ignore_eos)
        assert serial.runner.num_ahead_used == serial.runner.num_ahead_missed == 0
        # most decode steps ran ahead; arrivals, preemptions and logprobs did not
        used, missed = ahead.runner.num_ahead_used, ahead.runner.num_ahead_missed
        print(f"kv {kv_tokens}: {used} steps used a launch ahead, {missed} discarded")
        assert used >= (40 if kv_tokens > 64 else 4), used
    # a lone decode crosses a block boundary (its 32nd token) and keeps running ahead: the
    # scheduler gives it the next block a step early (engine.scheduler, _reserve)
    ahead = row_core(True)
    [prompts, params, _] = cases()[0]
    generate(ahead, prompts, params, 0)
    print(f"batch 1: {ahead.runner.num_ahead_used} of {params[0].max_tokens} steps ahead")
    assert ahead.runner.num_ahead_used == params[0].max_tokens - 2  # not the first nor last


@pytest.mark.timeout(300)
def test_look_ahead_changes_no_output_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    done = run_interpreted("from tests.engine.test_look_ahead import "
                           "check_look_ahead_changes_no_output as f; f()", timeout_s=290)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_look_ahead_changes_no_output_with_graphs_on_the_gpu(tiny_model_dir: Path) -> None:
    from engine.loader import load_core
    from polyinfer.config import GPU_FORWARD

    def core(look_ahead: bool, dtype: str) -> Any:
        c = load_core(CompiledConfig(model=str(tiny_model_dir), engine=EngineConfig(
            device="cuda", dtype=dtype, execution="cuda_graph", max_num_seqs=4,  # type: ignore[arg-type]
            max_num_batched_tokens=64, kv_cache_tokens=1024, max_model_len=64,
            forward=GPU_FORWARD if dtype == "bfloat16" else EngineConfig().forward)))
        c.runner.look_ahead = look_ahead
        return c

    for dtype in ("float32", "bfloat16"):
        ahead, serial = core(True, dtype), core(False, dtype)
        for prompts, params, arrive in cases():
            assert generate(ahead, prompts, params, arrive) == generate(serial, prompts,
                                                                        params, arrive)
        assert ahead.runner.num_ahead_used >= 40


def check_split_attention_keeps_greedy_outputs() -> None:
    """Run under Triton's interpreter: the decode steps with split_attention (the
    contexts cut into slices, up to 16), and with RoPE and the K/V write inside
    attention (fused_rope_attention: plain decode steps only, prompt chunks as before),
    give the same greedy tokens."""
    from polyinfer.config import ForwardConfig

    plain, split = row_core(True), row_core(True, forward=ForwardConfig(split_attention=True))
    rope = row_core(True, forward=ForwardConfig(fused_rope_attention=True))
    assert split.model.variants == ("split_attention",)
    for prompts, params, arrive in cases()[:2]:
        want = generate(plain, prompts, params, arrive)
        assert generate(split, prompts, params, arrive) == want
        assert generate(rope, prompts, params, arrive) == want
    assert rope.runner.graphs.num_one_row_each >= 20


def check_prefill_attention_keeps_greedy_outputs() -> None:
    """Run under Triton's interpreter: prompt chunks of up to 160 rows through the graphs'
    forward, with prefill_attention (steps of >= 128 rows: tiles of one sequence's rows,
    decode rows beside them) and without, give the same greedy tokens."""
    import engine.model
    from polyinfer.config import ForwardConfig

    calls = []
    kernel = engine.model.prefill_attention

    def counted(q, *args):  # type: ignore[no-untyped-def]
        calls.append(q.shape[0])
        return kernel(q, *args)

    engine.model.prefill_attention = counted
    plain = row_core(True, max_tokens=160)
    tiled = row_core(True, forward=ForwardConfig(prefill_attention=True), max_tokens=160)
    params = [GenerationParams(max_tokens=n, sampling=SamplingParams(0.0), ignore_eos=True)
              for n in (6, 9, 12)]
    for k, arrive in ((1, 0), (2, 3)):  # all at once; the last one arriving mid-decode
        # new prompts each time (the prefix cache would shorten repeated ones' chunks)
        prompts = [[(7 * i + 3 * j + k) % 900 + 5 for j in range(n)]
                   for i, n in enumerate((200, 150, 140))]
        want = generate(plain, prompts, params, arrive)
        assert not calls
        assert generate(tiled, prompts, params, arrive) == want, arrive
        assert calls and min(calls) >= engine.model.PREFILL_MIN_ROWS, calls
        calls.clear()


@pytest.mark.timeout(200)
def test_prefill_attention_keeps_greedy_outputs_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    done = run_interpreted("from tests.engine.test_look_ahead import "
                           "check_prefill_attention_keeps_greedy_outputs as f; f()",
                           timeout_s=190)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.timeout(200)
def test_split_attention_keeps_greedy_outputs_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    done = run_interpreted("from tests.engine.test_look_ahead import "
                           "check_split_attention_keeps_greedy_outputs as f; f()", timeout_s=190)
    assert done.returncode == 0, done.stderr[-3000:]
