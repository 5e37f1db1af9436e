"""Automatic prefix caching on a GPU: eager and CUDA-graph decode, caching on equals off.

The CPU suite (test_prefix_cache.py) covers the block pool and the scheduler; here
the same shared-prefix requests run on CUDA cores that differ only in
``enable_prefix_caching``, so prefill chunks that start after cached blocks go through
the GPU attention path (and graph-captured decode reads the reused blocks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.sequence import GenerationParams
from polyinfer.config import CompiledConfig, EngineConfig
from polyinfer.sampling import SamplingParams
from tests.engine.prompts import chat_text, mixed_prompts

BS = 16  # the engine's block size
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_core(model_dir: Path, execution: str, caching: bool, spec: str = "none"):  # type: ignore[no-untyped-def]
    from engine.loader import load_core

    return load_core(CompiledConfig(model=str(model_dir), engine=EngineConfig(
        device="cuda", dtype="float32", execution=execution, max_num_seqs=8,  # type: ignore[arg-type]
        max_num_batched_tokens=256, kv_cache_tokens=8192, max_model_len=1024,
        spec_method=spec, spec_max_depth=4, enable_prefix_caching=caching)))  # type: ignore[arg-type]


def run(core, prompts: list[list[int]], depth: int) -> tuple[list[list[int]], list[int]]:  # type: ignore[no-untyped-def]
    """Greedy tokens per prompt, and the prompt tokens the engine reported cached per prompt."""
    params = GenerationParams(max_tokens=24, sampling=SamplingParams(0.0), ignore_eos=True,
                              spec_depth=depth)
    for i, ids in enumerate(prompts):
        core.add_request(f"r{i}", ids, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    cached: dict[str, int] = {}
    for _ in range(5000):
        if not core.has_work:
            break
        for o in core.step()[0]:
            out[o.request_id].extend(o.new_token_ids)
            cached[o.request_id] = o.num_cached_tokens
    assert not core.has_work
    return [out[f"r{i}"] for i in range(len(prompts))], [cached[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def shared_prefix_prompts(tiny_model_dir: Path) -> list[list[int]]:
    from engine.tokenizer import TextTokenizer

    tok = TextTokenizer(str(tiny_model_dir), ())
    texts = [chat_text(p) for p in mixed_prompts(6)]
    prefix = tok.encode(" ".join(texts[:3]))[:200]  # a 200-token shared "system prompt"
    return [prefix + tok.encode(t) for t in texts]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("execution", "spec", "depth"),
                         [("eager", "none", 0), ("cuda_graph", "none", 0),
                          ("cuda_graph", "ngram", 3)])
def test_prefix_cache_on_gpu_equals_off(tiny_model_dir: Path,
                                        shared_prefix_prompts: list[list[int]],
                                        execution: str, spec: str, depth: int) -> None:
    on = cuda_core(tiny_model_dir, execution, True, spec)
    off = cuda_core(tiny_model_dir, execution, False, spec)
    for round_ in range(2):
        want, none_cached = run(off, shared_prefix_prompts, depth)
        got, cached = run(on, shared_prefix_prompts, depth)
        assert got == want, f"round {round_}"
        assert not any(none_cached)
        if round_ == 1:  # all but the last token, in whole blocks
            assert cached == [(len(p) - 1) // BS * BS for p in shared_prefix_prompts]
        else:  # the first request computes the shared prefix; later ones find some of it
            assert cached[0] == 0 and sum(cached) > 0
