"""Speculative verification through the captured decode graphs: the parts that run anywhere.

Row building, bucket choice and input packing with the answers written out, the
runner's choice of path, and the whole graph path (rows -> the Triton decode
kernel -> verify) run uncaptured under Triton's CPU interpreter against the
eager verify path. The captured, on-GPU versions are in test_cuda_graph_verify_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.cuda_graph import (
    COL_TABLE,
    DecodeRow,
    RowDecoder,
    bucket_table,
    decode_buckets,
    fill_inputs,
    graph_buckets,
    read_rows,
)
from engine.scheduler import ScheduledSeq
from engine.sequence import GenerationParams, Sequence
from polyinfer.config import TINY_TARGET, CompiledConfig, EngineConfig
from polyinfer.sampling import SamplingParams
from tests.engine.drive import generate, run_interpreted

# -- buckets, rows, packing ----------------------------------------------------------------


def test_graph_buckets_cover_every_verify_row_up_to_the_cap() -> None:
    assert graph_buckets(8) == [1, 2, 4, 8]  # no speculation: the decode buckets
    assert graph_buckets(8, 4) == [1, 2, 4, 8, 16, 24, 32, 40]  # 8 x (1 + 4) rows
    assert graph_buckets(1, 16) == [1, 2, 4, 8, 16, 17]  # batch 1 at depth 16
    assert graph_buckets(16, 16, max_rows=64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_buckets(600, 4)[:len(decode_buckets(600))] == decode_buckets(600)
    assert graph_buckets(32, 16)[-1] == 544  # 32 x 17 rows, under the default cap
    assert graph_buckets(64, 16)[-1] == 1088
    assert graph_buckets(128, 16)[-1] == 2048  # the default cap
    with pytest.raises(ValueError):
        graph_buckets(8, -1)
    with pytest.raises(ValueError):
        graph_buckets(8, 4, max_rows=0)
    with pytest.raises(ValueError):
        graph_buckets(8, 4, max_tokens=-1)


def test_graph_buckets_cover_the_token_budget_by_8_then_by_64() -> None:
    """Prefill chunks are rows too: the buckets reach max_num_batched_tokens."""
    fine = [1, 2, 4] + list(range(8, 257, 8))
    assert graph_buckets(8, 4, max_tokens=256) == fine
    assert graph_buckets(8, 4, max_tokens=1024) == fine + list(range(320, 1025, 64))
    assert graph_buckets(8, 4, max_tokens=300) == fine + [300]
    assert graph_buckets(8, 4, max_tokens=700) == fine + [320, 384, 448, 512, 576, 640, 700]
    assert graph_buckets(8, 0, max_rows=512, max_tokens=4096)[-1] == 512  # capped
    assert graph_buckets(4, 4, max_tokens=24) == [1, 2, 4, 8, 16, 24]
    assert len(graph_buckets(32, 16, max_tokens=2048)) == 35 + 28  # capture count at 2048


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
    # token, position, slot, context, sequence, block table (the blocks up to the last
    # draft's position; a plain row only up to its own)
    assert host[0, :COL_TABLE + 3].tolist() == [100, 15, 5 * 16 + 15, 16, 0, 5, 9, -1]
    assert host[1, :COL_TABLE + 3].tolist() == [101, 16, 9 * 16 + 0, 17, 0, 5, 9, -1]
    assert host[2, :COL_TABLE + 3].tolist() == [102, 17, 9 * 16 + 1, 18, 0, 5, 9, -1]
    assert host[3, :COL_TABLE + 2].tolist() == [200, 3, 4 * 16 + 3, 4, 1, 4, -1]
    for pad in range(4, 8):  # padding writes only row 0's slot, with row 0's values
        assert host[pad].tolist() == host[0].tolist()


def test_read_rows_are_each_sequences_last_rows() -> None:
    assert read_rows([3, 1, 2], [3, 0, 2]) == [0, 1, 2, 4, 5]
    assert read_rows([1, 1], [0, 0]) == []
    assert read_rows([2], [2]) == [0, 1]
    # a 5-token chunk that ends its prompt (reads its last row), a chunk that does not,
    # a verify step with 2 drafts (3 rows, all read)
    assert read_rows([5, 4, 3], [1, 0, 3]) == [4, 9, 10, 11]
    with pytest.raises(ValueError):
        read_rows([2], [3])


def test_a_prefill_chunk_is_one_row_per_token_at_consecutive_positions() -> None:
    """A 5-token chunk after 14 cached tokens (positions 14..18 over blocks 2 then 7),
    block size 16: row j writes slot of position 14 + j and attends 15 + j tokens."""
    row = DecodeRow.chunk([50, 51, 52, 53, 54], 14, [2, 7, 3])
    assert row.num_rows == 5 and row.token == 50 and list(row.drafts) == [51, 52, 53, 54]
    host = np.full((8, COL_TABLE + 3), -1, dtype=np.int32)
    fill_inputs(host, [row], bucket=8, block_size=16)
    want_slots = [2 * 16 + 14, 2 * 16 + 15, 7 * 16 + 0, 7 * 16 + 1, 7 * 16 + 2]
    assert host[:5, 0].tolist() == [50, 51, 52, 53, 54]
    assert host[:5, 1].tolist() == [14, 15, 16, 17, 18]
    assert host[:5, 2].tolist() == want_slots
    assert host[:5, 3].tolist() == [15, 16, 17, 18, 19]
    assert host[:5, COL_TABLE:].tolist() == [[2, 7, -1]] * 5
    with pytest.raises(ValueError):
        DecodeRow.chunk([], 0, [1])


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
    assert not can([decode, prefill])  # 11 rows: eager
    assert can([ScheduledSeq(_seq(2, 10, 0), 6, []), decode])  # a 6-token chunk + 1: 7 rows
    assert can([ScheduledSeq(_seq(2, 10, 3), 7, [])])  # the prompt's last 7 tokens
    graphs = runner.graphs
    for rows in ([], [DecodeRow(1, 9, [0], [2] * 8)]):  # 0 rows; 9 rows > the largest bucket
        with pytest.raises(ValueError, match="rows: no bucket"):
            graphs.run(rows)


# -- the whole path, uncaptured, in Triton's interpreter -----------------------------------

def _interpreter_core(graphs: bool, budget: int = 256, prefix_caching: bool = False):  # type: ignore[no-untyped-def]
    from engine.loader import load_core

    # NOTE: 2 of the 8 layers keep the interpreted kernel to a few seconds; both paths run
    # the same truncated model, so equality between them is still exact to check.
    core = load_core(CompiledConfig(model=str(TINY_TARGET), engine=EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=budget, kv_cache_tokens=2048, max_model_len=256,
        spec_method="ngram", spec_max_depth=4, enable_prefix_caching=prefix_caching,
        measure_num_layers=2)))
    if graphs:
        core.runner.graphs = RowDecoder(core.model, core.runner.kv,
                                        graph_buckets(4, 4, max_tokens=budget), 256 + 4 + 1)
    return core


def _count_paths(core) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Steps through the rows, of which with a prompt chunk; eager forwards."""
    runner = core.runner
    counts = {"rows": 0, "rows_prefill": 0, "eager": 0}
    run, forward = runner._execute_graph, runner._forward

    def on_rows(scheduled):  # type: ignore[no-untyped-def]
        counts["rows"] += 1
        counts["rows_prefill"] += any(it.num_new > 1 for it in scheduled)
        return run(scheduled)

    def on_forward(*a):  # type: ignore[no-untyped-def]
        counts["eager"] += 1
        return forward(*a)

    runner._execute_graph, runner._forward = on_rows, on_forward
    return counts


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
    plain = generate(eager, prompts, greedy(0))[0]
    eager_spec = generate(eager, prompts, greedy(4))[0]
    paths = _count_paths(rows)
    got, num_drafted, num_accepted = generate(rows, prompts, greedy(4))
    assert got == plain == eager_spec, (got, plain, eager_spec)
    assert 0 < num_accepted < num_drafted, (num_accepted, num_drafted)  # accepts and rejects
    assert paths["rows_prefill"] > 0 and paths["eager"] == 0, paths  # every step, prompts too
    assert generate(rows, prompts, seeded())[0] == generate(eager, prompts, seeded())[0]


def check_chunked_prefill_rows_equal_eager() -> None:
    """Prompt chunks as rows: a 24-token budget splits 30-50-token prompts into chunks that
    share steps with other sequences' decode and verify rows; prefix caching on, with two
    prompts sharing 2 full blocks, so the second starts its rows after a cache hit. Greedy
    outputs equal the eager engine's (same config) token for token and every step of the
    row engine went through the rows."""
    from engine.tokenizer import TextTokenizer
    from tests.engine.prompts import chat_text, mixed_prompts

    tok = TextTokenizer(str(TINY_TARGET), ())
    texts = [tok.encode(chat_text(p)) for p in mixed_prompts(3)]
    shared = texts[0][:32]  # 2 blocks of 16
    prompts = [shared + texts[1][:14], texts[2][:30], shared + texts[2][:18]]
    params = [GenerationParams(max_tokens=10, sampling=SamplingParams(0.0), ignore_eos=True,
                               spec_depth=d) for d in (3, 0, 2)]
    eager = _interpreter_core(False, budget=24, prefix_caching=True)
    rows = _interpreter_core(True, budget=24, prefix_caching=True)
    want = generate(eager, prompts, params)[0]
    paths = _count_paths(rows)
    rows.add_request("warm", prompts[0], params[0])  # caches the shared blocks first
    while rows.has_work:
        rows.step()
    cached: dict[str, int] = {}
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        rows.add_request(f"r{i}", ids, p)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(200):
        if not rows.has_work:
            break
        for o in rows.step()[0]:
            got[o.request_id].extend(o.new_token_ids)
            cached[o.request_id] = o.num_cached_tokens
    assert [got[f"r{i}"] for i in range(len(prompts))] == want, (got, want)
    assert cached == {"r0": 32, "r1": 0, "r2": 32}, cached  # rows after the hits
    assert paths["eager"] == 0 and paths["rows_prefill"] > 3, paths


def check_prompts_are_indexed_while_the_rows_run() -> None:
    """The n-gram proposer indexes a new request's prompt during its prefill step's launch
    (EngineCore._overlap_proposer_work), before its first proposal."""
    from engine.tokenizer import TextTokenizer
    from tests.engine.prompts import chat_text, mixed_prompts

    tok = TextTokenizer(str(TINY_TARGET), ())
    core = _interpreter_core(True)
    assert core.proposer is not None
    for i, p in enumerate(mixed_prompts(2)):
        core.add_request(f"r{i}", tok.encode(chat_text(p))[:40], GenerationParams(
            max_tokens=6, sampling=SamplingParams(0.0), ignore_eos=True, spec_depth=3))
    assert core.proposer.num_tracked == 0
    core.step()  # both prompts in one step: no sequence decoded yet, so none proposed
    assert core.proposer.num_tracked == 2


@pytest.mark.timeout(180)
def test_verify_rows_equal_eager_verify_in_the_interpreter() -> None:
    """The graph path's computation, uncaptured, with the Triton kernel interpreted on the CPU.

    NOTE: a subprocess because the interpreter is chosen when Triton is first imported.
    """
    pytest.importorskip("triton")
    code = ("from tests.engine.test_cuda_graph_verify import check_rows_verify_equals_eager, "
            "check_chunked_prefill_rows_equal_eager, check_prompts_are_indexed_while_the_rows_run; "
            "check_rows_verify_equals_eager(); check_chunked_prefill_rows_equal_eager(); "
            "check_prompts_are_indexed_while_the_rows_run()")
    done = run_interpreted(code, timeout_s=170)
    assert done.returncode == 0, done.stderr[-3000:]

