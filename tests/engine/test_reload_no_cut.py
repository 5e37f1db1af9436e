"""A hot reload never cuts a request in flight short of its own max_tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import ReloadError
from engine.loader import load_core
from engine.sequence import GenerationParams
from polyinfer.config import CompiledConfig, EngineConfig
from polyinfer.sampling import SamplingParams


def test_reload_that_would_cut_a_request_is_refused_and_it_finishes(
        tiny_model_dir: Path) -> None:
    core = load_core(CompiledConfig(model=str(tiny_model_dir), engine=EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=128, kv_cache_tokens=2048, max_model_len=512)))
    ids = core.tokenizer.encode("def add(a, b):\n    return a + b\n" * 4)
    params = GenerationParams(max_tokens=200, sampling=SamplingParams(0.0), ignore_eos=True)
    core.add_request("long", ids, params)
    out: list[int] = []
    for _ in range(3):
        for o in core.step()[0]:
            out.extend(o.new_token_ids)
    small = core.config.with_engine(max_model_len=len(ids) + 50)  # would end it at "length"
    with pytest.raises(ReloadError, match="in flight"):
        core.reload(small)
    core.reload(core.config.with_engine(max_num_seqs=2))  # one that holds it: recomputed
    finish = None
    while core.has_work:
        for o in core.step()[0]:
            out.extend(o.new_token_ids)
            finish = o.finish_reason if o.finished else finish
    assert len(out) == 200 and finish == "length"
    core.reload(small)  # nothing in flight: applied
    assert core.config.engine.max_model_len == len(ids) + 50
