from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from optimizer.errors import SpaceError
from optimizer.space import Knob, ModelShape, SearchSpace
from polyinfer.config import CompiledConfig


@pytest.fixture
def space(model_dir: Path) -> SearchSpace:
    base = CompiledConfig(model=str(model_dir)).with_engine(max_model_len=1024, kv_cache_tokens=8192)
    # tiny shape: 2 * 8 layers * 2 kv heads * 64 * 4 B = 8192 B per token
    return SearchSpace.default(base, memory_budget_bytes=8192 * 16384)


def test_model_shape_reads_config(space: SearchSpace) -> None:
    s = space.shape
    assert (s.num_layers, s.hidden_size, s.num_kv_heads, s.head_dim) == (8, 256, 2, 64)
    assert s.kv_bytes_per_token("float32") == 8192
    assert s.kv_bytes_per_token("bfloat16", num_layers=2) == 1024
    # 8 layers x (attn 256*64*(8+4) + mlp 3*256*768) + tied embedding 8192*256
    assert s.num_params() == 8 * (196608 + 589824) + 2097152


def test_kv_cache_must_fit_memory(space: SearchSpace) -> None:
    assert space.try_build({"kv_cache_tokens": 16384}) is not None
    with pytest.raises(SpaceError, match="exceeds the memory budget"):
        space.build({"kv_cache_tokens": 32768})


def test_batch_budget_covers_speculative_decode_step(space: SearchSpace) -> None:
    with pytest.raises(SpaceError, match=r"max_num_seqs x \(1 \+ spec_max_depth\)"):
        space.build({"max_num_seqs": 32, "max_num_batched_tokens": 128, "spec_method": "ngram",
                     "spec_max_depth": 4, "spec_default_depth": 2})
    ok = space.build({"max_num_seqs": 32, "max_num_batched_tokens": 256, "spec_method": "ngram",
                      "spec_max_depth": 4, "spec_default_depth": 2, "kv_cache_tokens": 4096})
    assert ok.engine.max_num_batched_tokens == 256


def test_depth_constraints(space: SearchSpace) -> None:
    with pytest.raises(SpaceError, match="spec_default_depth"):
        space.build({"spec_method": "ngram", "spec_max_depth": 2, "spec_default_depth": 4})
    with pytest.raises(SpaceError, match="needs spec_max_depth >= 1"):
        space.build({"spec_method": "ngram", "spec_max_depth": 0, "spec_default_depth": 0})
    with pytest.raises(SpaceError, match="unknown knob"):
        space.build({"max_num_sequences": 4})


def test_no_speculation_folds_depth_knobs(space: SearchSpace) -> None:
    a = space.build({"spec_method": "none", "spec_max_depth": 6, "spec_default_depth": 3,
                     "ngram_max": 2})
    b = space.build({"spec_method": "none"})
    assert a.engine.spec_max_depth == 0 and space.key(a) == space.key(b)


def test_grid_is_valid_and_unique(space: SearchSpace) -> None:
    grid = list(space.grid())
    keys = [space.key(c) for c in grid]
    assert len(keys) == len(set(keys)) > 100
    assert all(space.is_valid(c) for c in grid)
    assert all(c.engine.kv_cache_tokens <= 16384 for c in grid)
    assert "draft" not in {c.engine.spec_method for c in grid}  # no draft model given


def test_encode_decode_roundtrip(space: SearchSpace) -> None:
    rng = random.Random(0)
    for _ in range(50):
        cfg = space.sample(rng)
        x = space.encode(cfg)
        assert x.shape == (space.dim,) and np.all((0 <= x) & (x <= 1))
        assert space.key(space.decode(x)) == space.key(cfg)
        assert space.key(space.from_key(space.key(cfg))) == space.key(cfg)
    with pytest.raises(SpaceError, match="expected a vector"):
        space.decode([0.5])


def test_neighbors_move_one_knob_one_step(space: SearchSpace) -> None:
    cfg = space.build({"max_num_seqs": 4, "max_num_batched_tokens": 256,
                       "kv_cache_tokens": 8192, "spec_method": "none"})
    moves = space.neighbors(cfg)
    seqs = sorted({m.engine.max_num_seqs for m in moves})
    assert seqs == [2, 4, 8]
    assert all(space.is_valid(m) for m in moves)
    assert space.key(cfg) not in {space.key(m) for m in moves}


def test_repair_raises_batch_budget() -> None:
    shape = ModelShape(2, 64, 128, 2, 1, 32, 100)
    base = CompiledConfig().with_engine(max_model_len=512)
    space = SearchSpace(base, (Knob("max_num_seqs", (8, 16)),
                               Knob("max_num_batched_tokens", (16, 64, 128)),
                               Knob("spec_method", ("none", "ngram")),
                               Knob("spec_max_depth", (0, 4)),
                               Knob("spec_default_depth", (0, 2))), shape, 1 << 30)
    fixed = space.repair({"max_num_seqs": 16, "max_num_batched_tokens": 16,
                          "spec_method": "ngram", "spec_max_depth": 0, "spec_default_depth": 0})
    assert fixed is not None
    assert fixed.engine.spec_max_depth == 1 and fixed.engine.max_num_batched_tokens == 64


def test_auto_threads_fold_into_the_count_they_resolve_to(space: SearchSpace) -> None:
    from optimizer.space import resolved_threads

    cpus = len(os.sched_getaffinity(0))
    auto = space.base.with_engine(num_threads=0)
    same = space.base.with_engine(num_threads=max(1, cpus // 2))
    assert space.key(auto) == space.key(same)
    assert resolved_threads(auto.engine, num_cpus=2) == 1
    assert resolved_threads(auto.with_engine(data_parallel_size=2).engine, num_cpus=8) == 1
    assert resolved_threads(auto.engine, num_cpus=8) == 4
    keys = {space.key(space.base.with_engine(num_threads=n)) for n in (0, 1, 2)}
    assert len(keys) == len({max(1, cpus // 2), 1, 2})
