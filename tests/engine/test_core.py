"""The engine core on the tiny model: batching invariance, speculation, preemption, reload."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core import EngineCore
from engine.errors import ContextLengthError, ReloadError
from engine.loader import load_core
from engine.sequence import GenerationParams
from polyinfer.config import CompiledConfig, EngineConfig
from polyinfer.sampling import SamplingParams
from tests.engine.prompts import chat_text, mixed_prompts

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def core(tiny_model_dir: Path) -> EngineCore:
    cfg = CompiledConfig(model=str(tiny_model_dir), engine=EngineConfig(
        max_num_seqs=32, max_num_batched_tokens=256, kv_cache_tokens=16384,
        spec_method="ngram", spec_max_depth=4))
    return load_core(cfg)


@pytest.fixture(scope="module")
def prompt_ids(core: EngineCore) -> list[list[int]]:
    return [core.tokenizer.encode(chat_text(p)) for p in mixed_prompts(32)]


def run(core: EngineCore, prompts: list[list[int]], params: list[GenerationParams],
        max_steps: int = 5000) -> dict[str, list[int]]:
    """Submit all prompts at once, step until done; token ids per request id."""
    for i, (ids, p) in enumerate(zip(prompts, params, strict=False)):
        core.add_request(f"r{i}", ids, p)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    done: set[str] = set()
    for _ in range(max_steps):
        if not core.has_work:
            break
        outputs, _ = core.step()
        for o in outputs:
            out[o.request_id].extend(o.new_token_ids)
            if o.finished:
                done.add(o.request_id)
    assert done == set(out), "every request must finish"
    return out


def greedy(depth: int = 0, max_tokens: int = MAX_TOKENS) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, sampling=SamplingParams(0.0),
                            ignore_eos=True, spec_depth=depth)


@pytest.fixture(scope="module")
def alone(core: EngineCore, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of the first 20 prompts, each run alone."""
    return [run(core, [ids], [greedy()])["r0"] for ids in prompt_ids[:20]]


def test_greedy_alone_equals_batch_of_32(core: EngineCore, prompt_ids: list[list[int]],
                                         alone: list[list[int]]) -> None:
    # 32 mixed-length requests, prefills chunked under a 256-token budget alongside decodes.
    lengths = [MAX_TOKENS if i < 20 else 8 + i for i in range(32)]
    batch = run(core, prompt_ids, [greedy(max_tokens=n) for n in lengths])
    for i in range(20):
        assert batch[f"r{i}"] == alone[i], f"prompt {i} differs in a batch"


def test_greedy_speculation_equals_depth_zero(core: EngineCore, prompt_ids: list[list[int]],
                                              alone: list[list[int]]) -> None:
    params = [greedy(depth=1 + i % 4) for i in range(20)]
    spec = run(core, prompt_ids[:20], params)
    for i in range(20):
        assert spec[f"r{i}"] == alone[i], f"prompt {i} differs with depth {1 + i % 4}"


def test_draft_model_speculation_equals_depth_zero(tiny_model_dir: Path,
                                                   prompt_ids: list[list[int]],
                                                   alone: list[list[int]]) -> None:
    from polyinfer.config import TINY_DRAFT

    cfg = CompiledConfig(model=str(tiny_model_dir), engine=EngineConfig(
        max_num_seqs=32, max_num_batched_tokens=256, kv_cache_tokens=16384,
        spec_method="draft", draft_model=str(TINY_DRAFT), spec_max_depth=4))
    draft_core = load_core(cfg)
    spec = run(draft_core, prompt_ids[:20], [greedy(depth=1 + i % 4) for i in range(20)])
    for i in range(20):
        assert spec[f"r{i}"] == alone[i], f"prompt {i} differs with draft depth {1 + i % 4}"


def test_speculation_proposes_and_accepts_on_repetitive_text(core: EngineCore) -> None:
    ids = core.tokenizer.encode(chat_text("Repeat: a b c d e f g a b c d e f g a b c d e f g"))
    core.add_request("rep", ids, greedy(depth=4, max_tokens=40))
    last = None
    while core.has_work:
        for o in core.step()[0]:
            last = o
    assert last is not None and last.finished
    assert last.num_draft_tokens > 0
    assert 0 <= last.num_accepted_tokens <= last.num_draft_tokens


def test_decode_steps_report_their_shape_prefill_and_time(core: EngineCore,
                                                          prompt_ids: list[list[int]]) -> None:
    """StepStats.decode_step (the depth policy's step-time feed): set on steps where any
    sequence decodes, with the draft tokens verified and the prompt tokens of prefill
    chunks beside them; None on a step that only prefills."""
    core.reload(core.config)  # an empty prefix cache: a fully cached prompt would decode
    ids = core.tokenizer.encode(chat_text("Repeat: a b c d e f g a b c d e f g a b c d e f g"))
    core.add_request("feed-a", ids, greedy(depth=4, max_tokens=30))
    core.add_request("feed-b", prompt_ids[0], greedy(depth=0, max_tokens=30))
    seen = []
    for i in range(200):
        if i == 5:  # a third prompt joins: its prefill chunk shares a step with two decodes
            core.add_request("feed-c", prompt_ids[1], greedy(depth=0, max_tokens=30))
        if not core.has_work:
            break
        _, stats = core.step()
        if i == 0:  # both prompts prefill in the first step: nothing decodes
            assert stats.decode_step is None
        elif stats.decode_step is not None:
            seen.append((stats.decode_step, stats.num_draft_tokens))
    assert seen and not core.has_work
    for step, num_draft in seen:
        assert 1 <= step.num_seqs <= 3 and step.seconds > 0.0
        assert step.num_drafted == num_draft and 0 <= step.max_drafted <= 4
    assert any(step.num_seqs == 2 and step.num_drafted > 0 for step, _ in seen)
    mixed = [step for step, _ in seen if step.num_prefill]
    assert mixed and mixed[0].num_seqs == 2 and 0 < mixed[0].num_prefill <= 256


def test_seeded_sampling_is_reproducible_alone_or_batched(core: EngineCore,
                                                          prompt_ids: list[list[int]]) -> None:
    def seeded() -> GenerationParams:
        return GenerationParams(max_tokens=16, sampling=SamplingParams.seeded(
            1234, temperature=0.8, top_p=0.9, top_k=50), ignore_eos=True)

    one = run(core, [prompt_ids[3]], [seeded()])["r0"]
    again = run(core, [prompt_ids[3]], [seeded()])["r0"]
    batch = run(core, [prompt_ids[3]] + prompt_ids[4:12], [seeded()] + [greedy()] * 8)["r0"]
    assert one == again == batch


def test_stop_token_ids_and_max_tokens(core: EngineCore, prompt_ids: list[list[int]],
                                       alone: list[list[int]]) -> None:
    target = alone[0][5]
    p = GenerationParams(max_tokens=MAX_TOKENS, sampling=SamplingParams(0.0), ignore_eos=True,
                         stop_token_ids=(target,))
    out = run(core, [prompt_ids[0]], [p])["r0"]
    assert out == alone[0][: alone[0].index(target) + 1]


def test_full_kv_cache_preempts_and_completes_everything(tiny_model_dir: Path,
                                                         prompt_ids: list[list[int]],
                                                         alone: list[list[int]]) -> None:
    # The short prompts need far more than the 40 blocks the cache has, so decoding preempts.
    cfg = CompiledConfig(model=str(tiny_model_dir), engine=EngineConfig(
        max_num_seqs=32, max_num_batched_tokens=512, kv_cache_tokens=640, block_size=16,
        max_model_len=640))
    small = load_core(cfg)
    chosen = [i for i, ids in enumerate(prompt_ids[:20]) if len(ids) + MAX_TOKENS <= 400]
    assert sum(len(prompt_ids[i]) + MAX_TOKENS for i in chosen) > 2 * 640
    preempted = 0
    for i in chosen:
        small.add_request(f"r{i}", prompt_ids[i], greedy())
    out: dict[str, list[int]] = {f"r{i}": [] for i in chosen}
    finished = 0
    for _ in range(5000):
        if not small.has_work:
            break
        outputs, stats = small.step()
        preempted += stats.num_preempted
        for o in outputs:
            out[o.request_id].extend(o.new_token_ids)
            finished += o.finished
    assert finished == len(chosen) and preempted > 0
    for i in chosen:
        assert out[f"r{i}"] == alone[i]
    assert small.kv_usage == 0.0
    with pytest.raises(ContextLengthError):
        small.add_request("too-long", prompt_ids[0], greedy(max_tokens=640))


def test_reload_requeues_in_flight_requests_without_loss(core: EngineCore,
                                                         prompt_ids: list[list[int]],
                                                         alone: list[list[int]]) -> None:
    old = core.config
    for i, ids in enumerate(prompt_ids[:8]):
        core.add_request(f"r{i}", ids, greedy())
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(8)}
    for _ in range(6):
        for o in core.step()[0]:
            out[o.request_id].extend(o.new_token_ids)
    seconds = core.reload(old.with_engine(max_num_seqs=4, max_num_batched_tokens=64,
                                          kv_cache_tokens=4096, spec_method="none"))
    assert seconds > 0 and core.num_waiting == 8 and core.kv_usage == 0.0
    while core.has_work:
        for o in core.step()[0]:
            out[o.request_id].extend(o.new_token_ids)
    for i in range(8):
        assert out[f"r{i}"] == alone[i]
    core.reload(old)


@pytest.mark.parametrize("change", [{"data_parallel_size": 2}, {"device": "meta"}])
def test_reload_refuses_restart_only_fields_and_keeps_serving(
        core: EngineCore, prompt_ids: list[list[int]], alone: list[list[int]],
        change: dict[str, object]) -> None:
    old = core.config
    with pytest.raises(ReloadError, match=f"engine.{next(iter(change))}"):
        core.reload(old.with_engine(**change))
    assert core.config == old  # /admin/config keeps reporting what runs
    core.add_request("after", prompt_ids[0], greedy())
    out: list[int] = []
    while core.has_work:
        for o in core.step()[0]:
            out.extend(o.new_token_ids)
    assert out == alone[0]


def test_abort_frees_blocks(core: EngineCore, prompt_ids: list[list[int]]) -> None:
    core.add_request("gone", prompt_ids[0], greedy(max_tokens=100))
    core.step()
    assert core.kv_usage > 0
    core.abort("gone")
    assert core.kv_usage == 0.0 and not core.has_work


def test_measure_num_layers_builds_a_truncated_model_that_reload_can_restore(
        tiny_model_dir: Path) -> None:
    cfg = CompiledConfig(model=str(tiny_model_dir), engine=EngineConfig(
        measure_num_layers=2, kv_cache_tokens=1024))
    core = load_core(cfg)
    assert core.model.num_layers == 2
    core.reload(cfg.with_engine(measure_num_layers=None))
    assert core.model.num_layers == core.spec.num_layers
