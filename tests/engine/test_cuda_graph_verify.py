"""Speculative verification through the captured decode graphs: the parts that run anywhere.

Row building, bucket choice and input packing with the answers written out, the
runner's choice of path, and the whole graph path (rows -> the Triton decode
kernel -> verify) run uncaptured under Triton's CPU interpreter against the
eager verify path. The captured, on-GPU versions are in test_cuda_graph_verify_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from engine.config import REPO_ROOT, TINY_TARGET, CompiledConfig, EngineConfig
from engine.cuda_graph import (
    COL_TABLE,
    DecodeRow,
    RowDecoder,
    bucket_table,
    decode_buckets,
    fill_inputs,
    graph_buckets,
    kept_rows,
)
from engine.scheduler import ScheduledSeq
from engine.sequence import GenerationParams, Sequence
from specdec.sampling import SamplingParams

# -- buckets, rows, packing ----------------------------------------------------------------


def test_graph_buckets_cover_every_verify_row_up_to_the_cap() -> None:
    assert graph_buckets(8) == [1, 2, 4, 8]  # no speculation: the decode buckets
    assert graph_buckets(8, 4) == [1, 2, 4, 8, 16, 24, 32, 40]  # 8 x (1 + 4) rows
    assert graph_buckets(1, 16) == [1, 2, 4, 8, 16, 17]  # batch 1 at depth 16
    assert graph_buckets(16, 16, max_rows=64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_buckets(600, 4) == decode_buckets(600)  # decode batches stay covered
    assert graph_buckets(32, 16)[-1] == 512  # the default cap
    with pytest.raises(ValueError):
        graph_buckets(8, -1)
    with pytest.raises(ValueError):
        graph_buckets(8, 4, max_rows=0)


def test_bucket_table_without_times_is_the_smallest_bucket_that_holds_the_rows() -> None:
    table = bucket_table([1, 2, 4, 8, 16, 24])
    assert len(table) == 25
    assert [table[n] for n in (1, 2, 3, 5, 8, 9, 16, 17, 24)] == [1, 2, 4, 8, 8, 16, 16, 24, 24]


def test_bucket_table_skips_a_bucket_that_replays_slower_than_a_larger_one() -> None:
    """As measured on the H200 (float32, tiny model): the 8-row graph is the slow one."""
    ms = {1: 0.57, 2: 0.69, 4: 0.71, 8: 1.38, 16: 1.04, 24: 0.97, 32: 0.94}
    table = bucket_table(list(ms), ms)
    assert table[1:5] == [1, 2, 4, 4]
    assert table[5:9] == [32] * 4  # 24 is not within 3% of 32's 0.94 ms
    assert table[17:] == [32] * 16
    near = {1: 0.50, 2: 0.50, 4: 0.515, 8: 0.52}  # within 3% of the fastest: the smaller wins
    assert bucket_table(list(near), near)[1:] == [1, 2, 4, 4, 8, 8, 8, 8]


def test_a_decode_row_with_k_drafts_is_k_plus_one_rows() -> None:
    assert DecodeRow(7, 20, [3, 1, 2], [11, 12]).num_rows == 3
    assert DecodeRow(7, 0, [3]).num_rows == 1


def test_fill_inputs_for_verify_rows_across_a_block_boundary() -> None:
    """Seq A: 2 drafts after 15 cached tokens (positions 15, 16, 17: blocks 5 then 9);
    seq B: plain decode at position 3. 4 rows in bucket 8: rows 4..7 repeat row 0."""
    host = np.full((8, COL_TABLE + 3), -1, dtype=np.int32)
    rows = [DecodeRow(100, 15, [5, 9, 6], [101, 102]), DecodeRow(200, 3, [4, 8])]
    fill_inputs(host, rows, bucket=8, block_size=16)
    # token, position, slot, context, block table (the blocks up to the last draft's position;
    # a plain row only up to its own)
    assert host[0, :COL_TABLE + 3].tolist() == [100, 15, 5 * 16 + 15, 16, 5, 9, -1]
    assert host[1, :COL_TABLE + 3].tolist() == [101, 16, 9 * 16 + 0, 17, 5, 9, -1]
    assert host[2, :COL_TABLE + 3].tolist() == [102, 17, 9 * 16 + 1, 18, 5, 9, -1]
    assert host[3, :COL_TABLE + 2].tolist() == [200, 3, 4 * 16 + 3, 4, 4, -1]
    for pad in range(4, 8):  # padding writes only row 0's slot, with row 0's values
        assert host[pad].tolist() == host[0].tolist()


def test_kept_rows_selects_the_sampling_sequences_rows() -> None:
    assert kept_rows([3, 1, 2], [True, False, True]) == [0, 1, 2, 4, 5]
    assert kept_rows([1, 1], [False, False]) == []
    assert kept_rows([2], [True]) == [0, 1]


# -- the runner's choice of path -----------------------------------------------------------


def _seq(seq_id: int, num_tokens: int, num_computed: int) -> Sequence:
    seq = Sequence(seq_id, f"s{seq_id}", list(range(num_tokens)), num_tokens,
                   GenerationParams(max_tokens=8), 0.0)
    seq.num_computed = num_computed
    seq.block_table = [seq_id]
    return seq


def test_runner_sends_decode_and_verify_steps_to_the_graphs_if_the_rows_fit() -> None:
    from engine.checkpoint import load_weights, read_spec
    from engine.model import LlamaModel
    from engine.runner import ModelRunner

    spec = read_spec(TINY_TARGET)
    model = LlamaModel(spec, load_weights(TINY_TARGET, 1), max_positions=64)
    kv = model.new_kv_cache(8, 16)
    runner = ModelRunner(model, kv, short_q=8,
                         graphs=RowDecoder(model, kv, graph_buckets(2, 3), 64))
    assert runner.graphs is not None and runner.graphs.max_rows == 8
    decode = ScheduledSeq(_seq(0, 10, 9), 1, [])
    verify3 = ScheduledSeq(_seq(1, 10, 9), 1, [5, 6, 7])
    prefill = ScheduledSeq(_seq(2, 10, 0), 10, [])
    can = runner._graph_can_run
    assert can([decode]) and can([verify3]) and can([decode, verify3])  # 1, 4, 5 rows
    assert can([verify3, verify3])  # 8 rows: the largest bucket
    assert not can([verify3, verify3, decode])  # 9 rows: eager
    assert not can([decode, prefill])  # a prefill chunk: eager
    graphs = runner.graphs
    for rows in ([], [DecodeRow(1, 9, [0], [2] * 8)]):  # 0 rows; 9 rows > the largest bucket
        with pytest.raises(ValueError, match="rows: no bucket"):
            graphs.run(rows)


# -- the whole path, uncaptured, in Triton's interpreter -----------------------------------

def _interpreter_core(graphs: bool):  # type: ignore[no-untyped-def]
    from engine.loader import load_core

    # NOTE: 2 of the 8 layers keep the interpreted kernel to a few seconds; both paths run
    # the same truncated model, so equality between them is still exact to check.
    core = load_core(CompiledConfig(model=str(TINY_TARGET), engine=EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=256, kv_cache_tokens=2048, max_model_len=256,
        spec_method="ngram", spec_max_depth=4, enable_prefix_caching=False,
        measure_num_layers=2)))
    if graphs:
        core.runner.graphs = RowDecoder(core.model, core.runner.kv, graph_buckets(4, 4),
                                        256 + 4 + 1)
    return core


def _generate(core, prompts: list[list[int]], params: list[GenerationParams]):  # type: ignore[no-untyped-def]
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(f"r{i}", ids, p)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    num_drafted = num_accepted = 0
    for _ in range(500):
        if not core.has_work:
            break
        outputs, stats = core.step()
        num_drafted += stats.num_draft_tokens
        num_accepted += stats.num_accepted_tokens
        for o in outputs:
            out[o.request_id].extend(o.new_token_ids)
    assert not core.has_work
    return [out[f"r{i}"] for i in range(len(prompts))], num_drafted, num_accepted


def check_rows_verify_equals_eager() -> None:
    """Greedy, k = 1..4 per request in one batch: rows == k=0 == eager verify, token for
    token, with both accepted and rejected drafts; seeded sampling: rows == eager verify."""
    from engine.tokenizer import TextTokenizer
    from tests.engine.prompts import chat_text, mixed_prompts

    tok = TextTokenizer(str(TINY_TARGET), ())
    prompts = [tok.encode(chat_text(p))[:40] for p in mixed_prompts(4)]

    def greedy(depth: int) -> list[GenerationParams]:
        return [GenerationParams(max_tokens=14, sampling=SamplingParams(0.0), ignore_eos=True,
                                 spec_depth=depth and 1 + i % depth) for i in range(4)]

    def seeded() -> list[GenerationParams]:
        return [GenerationParams(max_tokens=10, ignore_eos=True, spec_depth=3,
                                 sampling=SamplingParams.seeded(50 + i, 0.8, top_k=20))
                for i in range(4)]

    eager, rows = _interpreter_core(False), _interpreter_core(True)
    plain = _generate(eager, prompts, greedy(0))[0]
    eager_spec = _generate(eager, prompts, greedy(4))[0]
    taken: list[int] = []
    run = rows.runner._execute_graph
    rows.runner._execute_graph = lambda s: (taken.append(len(s)), run(s))[1]
    got, num_drafted, num_accepted = _generate(rows, prompts, greedy(4))
    assert got == plain == eager_spec, (got, plain, eager_spec)
    assert 0 < num_accepted < num_drafted, (num_accepted, num_drafted)  # accepts and rejects
    assert taken  # the row path ran
    assert _generate(rows, prompts, seeded())[0] == _generate(eager, prompts, seeded())[0]


@pytest.mark.timeout(180)
def test_verify_rows_equal_eager_verify_in_the_interpreter() -> None:
    """The graph path's computation, uncaptured, with the Triton kernel interpreted on the CPU.

    NOTE: a subprocess because the interpreter is chosen when Triton is first imported.
    """
    pytest.importorskip("triton")
    code = ("from tests.engine.test_cuda_graph_verify import check_rows_verify_equals_eager; "
            "check_rows_verify_equals_eager()")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]

