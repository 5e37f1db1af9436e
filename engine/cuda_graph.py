"""Decode and verify steps replayed from CUDA graphs, one per bucket of rows.

At batch 1 an eager decode step of a Llama model launches hundreds of small
kernels and builds its metadata on the host, so the GPU idles between them and
the step takes milliseconds at any model size. Here the whole forward of a
decode-only batch (embedding, every layer, final norm, LM head) is captured
once per bucket of batch sizes and replayed:

- all step inputs live in one static device buffer ``[max_batch, 4 + max_blocks]``
  int32 (token id, position, KV slot, context length, block table); the host
  fills a pinned twin and one non-blocking copy moves it before each replay;
- attention is :func:`engine.triton_attention.decode_attention`, which reads
  block tables and context lengths on the device;
- a batch of ``n`` rows runs in a bucket ``>= n``; the padding rows repeat row 0
  (same token, same slot, same context), so they write the very values row 0
  writes and touch no other sequence's cache;
- which bucket: each graph's replay is timed once after capture, and ``n`` rows
  take the smallest bucket ``>= n`` whose replay is within 3% of the fastest such
  bucket (:func:`bucket_table`). NOTE: on the H200 in float32 the 8-row graph of
  the tiny model replayed slower than the 16-, 24- and 32-row ones (cuBLAS picks
  its GEMM kernels by shape), so "smallest" alone made 5-8 rows the slowest steps.

Speculative verification runs through the same graphs: a sequence with ``k``
drafts after ``p`` cached tokens is ``k + 1`` decode rows sharing its block
table, at positions ``p .. p + k`` (its last committed token, then the drafts:
one :class:`DecodeRow` with ``drafts``). Every layer writes all rows' K/V into the cache before it
attends (``engine.model``), so row ``j`` attending over ``p + j + 1`` tokens is
exactly the causal attention of an eager verify step, with no new kernel. The
buckets therefore cover ``max_batch x (1 + max_depth)`` rows, up to
``max_rows`` (:func:`graph_buckets`).

Prefill chunks run through the same graphs too: a chunk of ``P`` prompt tokens
at positions ``s .. s + P - 1`` is ``P`` rows over the sequence's block table
(one :class:`DecodeRow` whose ``drafts`` carry the chunk's tokens after the
first), under the same write-then-attend order, so row ``j`` attends the
``s + j + 1`` tokens a causal prefill would; ``s`` is the sequence's
``num_computed``, so prefix-cache hits are simply not rows. The buckets also
cover the step's token budget (``max_tokens``, the engine's
``max_num_batched_tokens``) up to ``max_rows``, so every step that fits the
budget fits a graph: step 8 up to 256 rows, then step 64 (:func:`graph_buckets`), unless
``engine.graph_sizes`` names the sizes (chosen from the traffic: :func:`capture_sizes`).
Only steps beyond the largest bucket stay on the eager path
(:class:`engine.runner.ModelRunner` decides).

    graphs = CudaGraphDecoder(model, kv, max_batch=8, max_positions=2048, max_depth=4,
                              max_tokens=1024)
    logits = graphs.run([DecodeRow(token, position, block_table, drafts)])  # [k + 1, vocab]
    logits = graphs.run([DecodeRow.chunk(prompt[s:s + p], s, block_table)])  # [p, vocab]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import UnsupportedConfigError
from engine.kv_cache import KVCache
from engine.model import LlamaModel
from engine.triton_attention import DecodeMetadata, check_head_dim, is_available

logger = logging.getLogger(__name__)

COL_TOKEN, COL_POSITION, COL_SLOT, COL_CONTEXT, COL_SEGMENT, COL_TABLE = 0, 1, 2, 3, 4, 5
NUM_WARMUP = 1  # eager runs per bucket before capture (Triton compiles, cuBLAS picks kernels)
# each bucket's replay is timed at start-up over about this much device time, in at least
# 2 and at most 20 replays: graph replays vary by well under the 3% that picks a bucket, and
# 20 replays of each of 47 buckets (1-1,024 rows) took ~1.6 s of a 2.8 s reload on the H200
REPLAY_TIMING_MS = 4.0
REPLAY_TIMING_ITERS = (2, 20)
MAX_GRAPH_ROWS = 2048  # default cap on captured rows (covers max_num_batched_tokens <= 2048)
FINE_ROWS = 256  # buckets step by 8 up to here (decode and verify batches) ...
COARSE_STEP = 64  # ... then by this (steps carrying prefill chunks)


@dataclass(frozen=True)
class DecodeRow:
    """One sequence's rows in a step: ``token`` at ``position``, then ``drafts[j - 1]`` at
    ``position + j`` (``1 + len(drafts)`` rows), all over ``block_table``.

    For a decode or verify step ``token`` is the last committed token (not yet in the
    cache) and ``drafts`` the proposal; each row's logits score the token after it, so
    the ``k + 1`` rows are what verification reads. For a prefill chunk (:meth:`chunk`)
    ``drafts`` holds the chunk's tokens after the first, then the proposal if any.
    """

    token: int
    position: int  # tokens before this one; the context attended is position + 1
    block_table: Sequence[int]
    drafts: Sequence[int] = ()

    @property
    def num_rows(self) -> int:
        return 1 + len(self.drafts)

    @classmethod
    def chunk(cls, tokens: Sequence[int], position: int,
              block_table: Sequence[int]) -> DecodeRow:
        """``tokens`` (at least one) at ``position ..`` as consecutive rows."""
        if not tokens:
            raise ValueError("a chunk needs at least one token")
        return cls(tokens[0], position, block_table, tokens[1:])


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes to capture: powers of two up to 8, then multiples of 8, then ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch: expected >= 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, max_batch, 8))
    return sizes + [max_batch]


def graph_buckets(max_batch: int, max_depth: int = 0, max_rows: int = MAX_GRAPH_ROWS,
                  max_tokens: int = 0) -> list[int]:
    """Row counts to capture, covering ``max(max_batch x (1 + max_depth), max_tokens)`` rows
    up to ``max_rows``: :func:`decode_buckets` up to ``FINE_ROWS`` (or ``max_batch``), then
    every ``COARSE_STEP`` rows.

    ``max_tokens`` is the step's token budget (prefill chunks and drafts included). Steps
    beyond ``max_rows`` rows run eager; plain decode batches of up to ``max_batch`` rows are
    always covered (as before speculation used graphs).
    """
    if max_depth < 0 or max_rows < 1 or max_tokens < 0:
        raise ValueError(f"max_depth >= 0, max_rows >= 1 and max_tokens >= 0 expected, got "
                         f"{max_depth}, {max_rows}, {max_tokens}")
    top = max(max_batch, min(max(max_batch * (1 + max_depth), max_tokens), max_rows))
    fine = decode_buckets(min(top, max(max_batch, FINE_ROWS)))
    first = (fine[-1] // COARSE_STEP + 1) * COARSE_STEP
    coarse = list(range(first, top, COARSE_STEP)) + ([top] if top > fine[-1] else [])
    return fine + coarse


def capture_sizes(max_batch: int, max_depth: int = 0, max_rows: int = MAX_GRAPH_ROWS,
                  max_tokens: int = 0, sizes: Sequence[int] = ()) -> list[int]:
    """The row counts to capture: ``sizes`` (``engine.graph_sizes``, chosen from the
    traffic) ascending, or :func:`graph_buckets`' ladder when there are none."""
    if sizes:
        return sorted(set(sizes))
    return graph_buckets(max_batch, max_depth, max_rows, max_tokens)


REPLAY_MARGIN = 0.03  # a larger bucket must replay this much faster to be chosen


def bucket_table(buckets: Sequence[int], replay_ms: Mapping[int, float] | None = None,
                 margin: float = REPLAY_MARGIN) -> list[int]:
    """The bucket for each row count ``n`` in ``1 .. buckets[-1]`` (index ``n``; 0 unused).

    Without ``replay_ms``: the smallest bucket ``>= n``. With it (ms per replay of each
    bucket): the smallest bucket ``>= n`` whose time is within ``margin`` of the fastest
    bucket ``>= n``.
    """
    table = [buckets[0]]
    for n in range(1, buckets[-1] + 1):
        fit = [b for b in buckets if b >= n]
        if replay_ms:
            fastest = min(replay_ms[b] for b in fit)
            fit = [b for b in fit if replay_ms[b] <= fastest * (1.0 + margin)]
        table.append(fit[0])
    return table


def read_rows(num_rows: Sequence[int], num_read: Sequence[int]) -> list[int]:
    """Flat indices of the last ``num_read[i]`` of sequence i's ``num_rows[i]`` rows.

    A sampling sequence reads its last ``k + 1`` rows (its token and drafts, after any
    prompt rows of its chunk); a prefill chunk that does not finish its prompt reads none.
    """
    out: list[int] = []
    start = 0
    for n, r in zip(num_rows, num_read, strict=True):
        if not 0 <= r <= n:
            raise ValueError(f"read {r} of {n} rows")
        out.extend(range(start + n - r, start + n))
        start += n
    return out


def check_can_capture(model: LlamaModel) -> None:
    """Raise :class:`UnsupportedConfigError` naming why this model cannot use graphs."""
    if not str(model.device).startswith("cuda") or not torch.cuda.is_available():
        raise UnsupportedConfigError(f"execution='cuda_graph' needs a CUDA device; this engine "
                                     f"runs on {model.device!r}")
    if not is_available():
        raise UnsupportedConfigError("execution='cuda_graph' needs triton (pip install triton)")
    reason = check_head_dim(model.spec.head_dim)
    if reason is not None:
        raise UnsupportedConfigError(f"execution='cuda_graph': {reason}")


def fill_inputs(host: np.ndarray, rows: Sequence[DecodeRow], bucket: int,
                block_size: int) -> None:
    """Write ``rows`` into ``host[:bucket]`` (int32, columns COL_*); padding rows repeat row 0.

    Through numpy: a plain decode row is ~100 ns an assignment where torch indexing costs
    microseconds; a sequence's k + 1 verify rows are written as slices at once.
    """
    i = 0
    for seq, row in enumerate(rows):
        if row.drafts:
            _fill_verify_rows(host, i, row, block_size, seq)
            i += row.num_rows
            continue
        pos = row.position
        num_blocks = pos // block_size + 1  # blocks holding positions 0 .. pos
        host[i, COL_TOKEN] = row.token
        host[i, COL_POSITION] = pos
        host[i, COL_SLOT] = row.block_table[num_blocks - 1] * block_size + pos % block_size
        host[i, COL_CONTEXT] = pos + 1
        host[i, COL_SEGMENT] = seq
        host[i, COL_TABLE:COL_TABLE + num_blocks] = row.block_table[:num_blocks]
        i += 1
    if bucket > i:
        host[i:bucket] = host[0]


def _fill_verify_rows(host: np.ndarray, first: int, row: DecodeRow, block_size: int,
                      seq: int) -> None:
    """Rows ``first ..`` for ``row``'s token and drafts (or prompt chunk), all of sequence
    ``seq``; every row gets the blocks up to the last row's position (the kernels read only
    those below each row's context)."""
    n = row.num_rows
    positions = np.arange(row.position, row.position + n)  # [n]
    num_blocks = (row.position + n - 1) // block_size + 1
    table = np.asarray(row.block_table[:num_blocks], dtype=np.int32)  # [num_blocks]
    out = host[first:first + n]
    out[:, COL_TOKEN] = (row.token, *row.drafts)
    out[:, COL_POSITION] = positions
    out[:, COL_SLOT] = table[positions // block_size] * block_size + positions % block_size
    out[:, COL_CONTEXT] = positions + 1
    out[:, COL_SEGMENT] = seq
    out[:, COL_TABLE:COL_TABLE + num_blocks] = table


class RowDecoder:
    """The static buffers and the forward each graph captures, run uncaptured.

    :class:`CudaGraphDecoder` replays this forward from graphs; run plainly it is the
    same computation launch by launch, which the CPU tests run under Triton's
    interpreter (``TRITON_INTERPRET=1``) and ``bench/spec_depth.py --step-costs`` times.
    """

    def __init__(self, model: LlamaModel, kv: KVCache, buckets: Sequence[int],
                 max_positions: int) -> None:
        self.model = model
        self.kv = kv
        self.buckets = list(buckets)
        self.max_positions = max_positions
        self.max_blocks = -(-max_positions // kv.block_size)
        rows, width = self.buckets[-1], COL_TABLE + self.max_blocks
        on_cuda = str(model.device).startswith("cuda")
        self._host = torch.zeros(rows, width, dtype=torch.int32, pin_memory=on_cuda)
        self._inputs = torch.zeros(rows, width, dtype=torch.int32, device=model.device)
        self._host_np = self._host.numpy()
        # set once the last step's inputs left the pinned buffer (see run)
        self._copied = torch.cuda.Event() if on_cuda else None
        # NOTE: one output buffer for every bucket: a per-bucket output kept alive would
        # hold bucket x vocab floats per bucket (GiBs for a large vocabulary and many buckets).
        self._out = torch.zeros(rows, model.spec.vocab_size, dtype=torch.float32,
                                device=model.device)
        self._bucket_for = bucket_table(self.buckets)  # [rows + 1]: bucket per row count
        # steps whose every row is its own sequence (plain decode) run a forward of their
        # own when the model fuses RoPE and the K/V write into attention
        self.one_row_each = "fused_rope_attention" in model.variants
        self.num_one_row_each = 0  # steps run through those forwards

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def can_run(self, num_rows: int) -> bool:
        return 0 < num_rows <= self.buckets[-1]

    def run(self, rows: Sequence[DecodeRow], tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[sum of rows' num_rows, vocab]`` float32 on the device, rows in order.

        The tensor is a view of the static output: read it before the next run.
        ``tokens``: the rows' tokens as a device tensor ``[len(rows)]`` (rows without
        drafts), in place of each ``row.token``: ids a step sampled on the device, fed to
        the next step before the host has read them (:class:`engine.runner.ModelRunner`'s
        look-ahead).
        """
        n = sum(row.num_rows for row in rows)
        if not self.can_run(n):
            raise ValueError(f"{n} rows: no bucket in {self.buckets}")
        if tokens is not None and (n != len(rows) or tokens.shape != (n,)):
            raise ValueError(f"tokens {tuple(tokens.shape)} for {len(rows)} rows of {n}")
        bucket = self._bucket_for[n]
        # NOTE: the previous step's copy out of the pinned buffer may still be queued behind
        # its replay: a step of prompt chunks that sample nothing never syncs the host (the
        # H200 test of back-to-back 48-token chunks read the next step's inputs). Wait for it
        # (a no-op after a step that read its tokens) before rewriting the buffer.
        if self._copied is not None:
            self._copied.synchronize()
        fill_inputs(self._host_np, rows, bucket, self.kv.block_size)
        self._inputs[:bucket].copy_(self._host[:bucket], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if tokens is not None:
            self._inputs[:n, COL_TOKEN].copy_(tokens)
            if bucket > n:  # padding rows repeat row 0, its token included
                self._inputs[n:bucket, COL_TOKEN].copy_(tokens[:1].expand(bucket - n))
        one_row_each = self.one_row_each and n == len(rows)
        self.num_one_row_each += one_row_each
        self._launch(bucket, one_row_each)
        return self._out[:n]

    def output(self, num_rows: int) -> torch.Tensor:
        """The logits of the last run's first ``num_rows`` rows (what :meth:`run` returned)."""
        return self._out[:num_rows]

    def _launch(self, bucket: int, one_row_each: bool = False) -> None:
        self._forward(bucket, one_row_each)

    def _forward(self, bucket: int, one_row_each: bool = False) -> None:
        buf = self._inputs[:bucket]
        meta = DecodeMetadata(positions=buf[:, COL_POSITION].long(),
                              slot_mapping=buf[:, COL_SLOT].long(),
                              block_tables=buf[:, COL_TABLE:],
                              context_lens=buf[:, COL_CONTEXT], one_row_each=one_row_each,
                              segments=buf[:, COL_SEGMENT])
        # the token ids stay int32 (F.embedding takes them so): one cast kernel fewer a step
        out = self._out[:bucket]
        logits = self.model.forward(buf[:, COL_TOKEN], meta, self.kv,  # type: ignore[arg-type]
                                    out=out)
        if logits.data_ptr() != out.data_ptr():
            out.copy_(logits)


def _replay_ms(graph: torch.cuda.CUDAGraph, iters: int) -> float:
    """Device ms per replay of ``graph`` over ``iters`` back-to-back replays."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / iters


class IdsReadback:
    """Sampled ids ``[N]`` copied from the device into a pinned host buffer behind the work
    queued so far, so the host can queue more before it waits for them (:meth:`wait`)."""

    def __init__(self, max_rows: int, device: str | torch.device) -> None:
        on_cuda = str(device).startswith("cuda")
        self._host = torch.zeros(max_rows, dtype=torch.int64, pin_memory=on_cuda)
        self._done = torch.cuda.Event() if on_cuda else None
        self._stream = torch.cuda.Stream(torch.device(device)) if on_cuda else None
        self._num = 0

    def start(self, ids: torch.Tensor) -> None:
        """Copy ``ids`` out on a stream of its own, behind the work queued so far: the step
        stream goes on to the next step's inputs and replay without waiting for the copy
        (a device-to-host copy of a few bytes took ~1.6 us and its launch ~8 us of the
        stream's time at batch 1 on an H200)."""
        self._num = int(ids.shape[0])
        if self._stream is None:
            self._host[:self._num].copy_(ids)
            return
        self._stream.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(self._stream):
            self._host[:self._num].copy_(ids, non_blocking=True)
            assert self._done is not None
            self._done.record()
        ids.record_stream(self._stream)  # its memory stays until the copy has read it

    def wait(self) -> list[int]:
        if self._done is not None:
            self._done.synchronize()
        ids: list[int] = self._host[:self._num].tolist()
        return ids


class CudaGraphDecoder(RowDecoder):
    """Captured forwards for each bucket of rows; :meth:`run` fills inputs and replays one.

    ``capture_s``, ``graph_bytes`` (CUDA memory reserved by capturing) and ``replay_ms``
    (per bucket, dummy inputs) are logged at start-up and kept for reports.
    """

    def __init__(self, model: LlamaModel, kv: KVCache, max_batch: int, max_positions: int,
                 max_depth: int = 0, max_rows: int = MAX_GRAPH_ROWS,
                 max_tokens: int = 0, sizes: Sequence[int] = ()) -> None:
        check_can_capture(model)
        super().__init__(model, kv, capture_sizes(max_batch, max_depth, max_rows, max_tokens,
                                                  sizes), max_positions)
        self.max_batch = max_batch
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # one_row_each: the plain-decode forwards, for buckets of up to max_batch rows
        self._single: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0
        self.timing_s = 0.0  # seconds spent timing the buckets' replays
        self.graph_bytes = 0
        self._capture_all()
        self.replay_ms = self._time_replays()
        self._bucket_for = bucket_table(self.buckets, self.replay_ms)
        used = sorted(set(self._bucket_for[1:]))
        logger.info("graph replay ms per bucket %s; buckets used %s",
                    {b: round(t, 3) for b, t in self.replay_ms.items()}, used)

    def _launch(self, bucket: int, one_row_each: bool = False) -> None:
        graph = self._single.get(bucket) if one_row_each else None
        (graph or self._graphs[bucket]).replay()

    def decode_graph(self, bucket: int) -> torch.cuda.CUDAGraph:
        """The graph a plain decode step of ``bucket`` rows replays."""
        return self._single.get(bucket) or self._graphs[bucket]

    def _time_replays(self, budget_ms: float = REPLAY_TIMING_MS) -> dict[int, float]:
        """Device ms per replay of each bucket's graph on the capture's dummy inputs: one
        replay timed, then as many as fill ``budget_ms`` (:data:`REPLAY_TIMING_ITERS`).

        NOTE: the dummy rows attend one token; the projections, whose kernels are what
        differ between buckets, do not depend on the context.
        """
        t0 = time.perf_counter()
        lo, hi = REPLAY_TIMING_ITERS
        out: dict[int, float] = {}
        for bucket in self.buckets:
            graph = self.decode_graph(bucket)
            first = _replay_ms(graph, 1)
            iters = max(lo, min(hi, int(budget_ms / max(first, 1e-3))))
            out[bucket] = _replay_ms(graph, iters)
        self.timing_s = time.perf_counter() - t0
        return out

    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.model.device)
        # Dummy inputs: token 0 at position 0 in block 0. Warm-up runs write that slot,
        # which no sequence owns yet (graphs are built with a fresh cache).
        self._inputs.zero_()
        self._inputs[:, COL_CONTEXT] = 1
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=self.model.device)
        side.wait_stream(torch.cuda.current_stream())
        single = [b for b in self.buckets if b <= self.max_batch] if self.one_row_each else []
        with torch.cuda.stream(side):
            for bucket in self.buckets:
                for _ in range(NUM_WARMUP):
                    self._forward(bucket)
                    if bucket in single:
                        self._forward(bucket, True)
        torch.cuda.current_stream().wait_stream(side)
        for bucket in reversed(self.buckets):  # largest first: smaller ones reuse its pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bucket)
            self._graphs[bucket] = graph
            if bucket in single:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(bucket, True)
                self._single[bucket] = graph
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0
        self.graph_bytes = torch.cuda.memory_reserved(self.model.device) - reserved
        logger.info("captured %d CUDA graphs (rows %s) in %.2f s, %.1f MiB reserved",
                    len(self.buckets), self.buckets, self.capture_s, self.graph_bytes / 2**20)
