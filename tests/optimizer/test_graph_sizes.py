"""CUDA-graph capture sizes chosen from the traffic's decode batch sizes (optimizer.space)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.cuda_graph import capture_sizes, decode_buckets
from optimizer.space import (
    SearchSpace,
    decode_rows_share,
    graph_ladder,
    graph_sizes_for,
    graph_sizes_knob,
)
from polyinfer.config import CompiledConfig, ConfigError, EngineConfig
from polyinfer.trace import TraceRecord


def record(ts: float, ttft_s: float, e2e_s: float, status: str = "ok") -> TraceRecord:
    return TraceRecord(ts=ts, ttft_s=ttft_s, e2e_s=e2e_s, status=status)


def test_decode_rows_share_is_time_weighted_concurrency() -> None:
    # decode intervals: [1, 5), [2, 4), [3, 9): 1 row for 1 s, 2 for 1 s, 3 for 1 s,
    # 2 for 1 s (4-5), 1 for 4 s (5-9); the failed request does not count
    records = [record(0, 1, 5), record(1, 1, 3), record(2, 1, 7), record(0, 0, 50, "error")]
    assert decode_rows_share(records, 32) == {1: 5 / 8, 2: 2 / 8, 3: 1 / 8}
    assert decode_rows_share(records, 2) == {1: 5 / 8, 2: 3 / 8}  # capped at max_num_seqs
    assert decode_rows_share([], 8) == {}


def test_the_ladder_is_the_engines_default() -> None:
    for top in (1, 3, 8, 20, 64):
        assert graph_ladder(top) == decode_buckets(top)


def test_sizes_keep_what_the_steps_use_and_the_largest() -> None:
    share = {1: 0.70, 2: 0.2, 3: 0.05, 5: 0.004, 9: 0.046}
    # 3 runs in 4 (5%), 5 in 8 (0.4%: dropped at 1%), 9 in 16 (the largest seen)
    assert graph_sizes_for(share, 16, min_share=0.01) == (1, 2, 4, 16)
    assert graph_sizes_for(share, 16, min_share=0.1) == (1, 2, 16)
    assert graph_sizes_for({}, 16) == ()


def test_the_knob_orders_fewest_graphs_first_then_the_default() -> None:
    records = [record(i * 0.5, 0.1, 2.0) for i in range(40)]  # ~4 decoding at once
    knob = graph_sizes_knob(records, 32)
    assert knob.name == "graph_sizes" and knob.values[-1] == ()
    assert all(v and max(v) <= 8 for v in knob.values[:-1]), knob.values
    assert graph_sizes_knob([], 32).values == ((),)


def test_engine_config_takes_sizes_and_the_decoder_captures_them(model_dir: Path) -> None:
    cfg = CompiledConfig(model=str(model_dir)).with_engine(graph_sizes=(8, 1, 4))
    again = CompiledConfig.from_dict(cfg.to_dict())
    assert again.engine.graph_sizes == (8, 1, 4)
    with pytest.raises(ConfigError, match="graph_sizes"):
        EngineConfig(graph_sizes=(0, 4))
    assert capture_sizes(8, sizes=(8, 1, 4, 4)) == [1, 4, 8]
    assert capture_sizes(8) == [1, 2, 4, 8]  # no sizes: the default ladder


def test_the_space_searches_sizes(model_dir: Path) -> None:
    base = CompiledConfig(model=str(model_dir)).with_engine(max_model_len=1024,
                                                            kv_cache_tokens=8192)
    knob = graph_sizes_knob([record(i * 0.5, 0.1, 2.0) for i in range(40)], 32)
    space = SearchSpace.default(base, 8192 * 16384, knobs=(knob,))
    cfgs = list(space.grid())
    assert [c.engine.graph_sizes for c in cfgs] == list(knob.values)
    assert space.from_key(space.key(cfgs[0])).engine.graph_sizes == knob.values[0]
