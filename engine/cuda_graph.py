"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

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
- a batch of ``n`` rows runs in the smallest bucket ``>= n``; the padding rows
  repeat row 0 (same token, same slot, same context), so they write the very
  values row 0 writes and touch no other sequence's cache.

Prefill, speculative verification and batches beyond the largest bucket stay
on the eager path (:class:`engine.runner.ModelRunner` decides).

    graphs = CudaGraphDecoder(model, kv, max_batch=8, max_positions=2048)
    logits = graphs.run([DecodeRow(token, position, block_table), ...])  # [n, vocab]
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import UnsupportedConfigError
from engine.kv_cache import KVCache
from engine.model import LlamaModel
from engine.triton_attention import DecodeMetadata, check_head_dim, is_available

logger = logging.getLogger(__name__)

COL_TOKEN, COL_POSITION, COL_SLOT, COL_CONTEXT, COL_TABLE = 0, 1, 2, 3, 4
NUM_WARMUP = 2  # eager runs per bucket before capture (Triton compiles, cuBLAS picks kernels)


@dataclass(frozen=True)
class DecodeRow:
    """One sequence's decode token: ``token`` at ``position`` over ``block_table``."""

    token: int
    position: int  # tokens before this one; the context attended is position + 1
    block_table: Sequence[int]


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes to capture: powers of two up to 8, then multiples of 8, then ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch: expected >= 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, max_batch, 8))
    return sizes + [max_batch]


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

    Through numpy: ~100 ns an assignment where torch indexing costs microseconds.
    """
    for i, row in enumerate(rows):
        pos = row.position
        num_blocks = pos // block_size + 1  # blocks holding positions 0 .. pos
        host[i, COL_TOKEN] = row.token
        host[i, COL_POSITION] = pos
        host[i, COL_SLOT] = row.block_table[num_blocks - 1] * block_size + pos % block_size
        host[i, COL_CONTEXT] = pos + 1
        host[i, COL_TABLE:COL_TABLE + num_blocks] = row.block_table[:num_blocks]
    if bucket > len(rows):
        host[len(rows):bucket] = host[0]


class CudaGraphDecoder:
    """Captured decode forwards for each bucket; :meth:`run` fills inputs and replays one."""

    def __init__(self, model: LlamaModel, kv: KVCache, max_batch: int,
                 max_positions: int) -> None:
        check_can_capture(model)
        self.model = model
        self.kv = kv
        self.buckets = decode_buckets(max_batch)
        self.max_blocks = -(-max_positions // kv.block_size)
        width = COL_TABLE + self.max_blocks
        self._host = torch.zeros(self.buckets[-1], width, dtype=torch.int32, pin_memory=True)
        self._inputs = torch.zeros(self.buckets[-1], width, dtype=torch.int32,
                                   device=model.device)
        self._host_np = self._host.numpy()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # bucket -> static [bucket, vocab] output
        self._capture_all()

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def can_run(self, num_rows: int) -> bool:
        return 0 < num_rows <= self.buckets[-1]

    def run(self, rows: Sequence[DecodeRow]) -> torch.Tensor:
        """Logits ``[len(rows), vocab]`` float32 on the device.

        The tensor is a view of the graph's static output: read it before the next run.
        """
        n = len(rows)
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        self._fill_host(rows, bucket)
        self._inputs[:bucket].copy_(self._host[:bucket], non_blocking=True)
        self._graphs[bucket].replay()
        return self._logits[bucket][:n]

    def _fill_host(self, rows: Sequence[DecodeRow], bucket: int) -> None:
        # NOTE: the pinned buffer is safe to rewrite: the previous step's copy finished
        # before its sampled ids were read on the host.
        fill_inputs(self._host_np, rows, bucket, self.kv.block_size)

    def _forward(self, bucket: int) -> torch.Tensor:
        buf = self._inputs[:bucket]
        meta = DecodeMetadata(positions=buf[:, COL_POSITION].long(),
                              slot_mapping=buf[:, COL_SLOT].long(),
                              block_tables=buf[:, COL_TABLE:],
                              context_lens=buf[:, COL_CONTEXT])
        return self.model.forward(buf[:, COL_TOKEN].long(), meta, self.kv)  # type: ignore[arg-type]

    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        # Dummy inputs: token 0 at position 0 in block 0. Warm-up runs write that slot,
        # which no sequence owns yet (graphs are built with a fresh cache).
        self._inputs.zero_()
        self._inputs[:, COL_CONTEXT] = 1
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=self.model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bucket in self.buckets:
                for _ in range(NUM_WARMUP):
                    self._forward(bucket)
        torch.cuda.current_stream().wait_stream(side)
        for bucket in reversed(self.buckets):  # largest first: smaller ones reuse its pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[bucket] = self._forward(bucket)
            self._graphs[bucket] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch %s) in %.2f s", len(self.buckets),
                    self.buckets, time.perf_counter() - t0)
