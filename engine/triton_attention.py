"""Graph-safe paged decode attention: one query token per sequence, a Triton kernel.

The eager path (:mod:`engine.attention`) builds its padding and masks on the
host for every step, which a captured CUDA graph cannot do. This kernel reads
everything that changes between steps from device tensors of fixed shape —
block tables ``[B, max_blocks]`` and context lengths ``[B]`` — and loops over
each sequence's context on the device, so one captured launch serves any
context length up to ``max_blocks * block_size``.

One program handles one (sequence, KV head) pair: the ``G = num_heads /
num_kv_heads`` query heads that share the KV head are one ``[G, D]`` tile
(padded to 16 rows for ``tl.dot``), and the context is read in tiles of
``TILE`` tokens with an online softmax, so K and V are read exactly once.

    meta = DecodeMetadata(positions, slot_mapping, block_tables, context_lens)
    out = decode_attention(q, k_cache, v_cache, meta, scale)  # q [B, H, D] -> [B, H * D]
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from engine.launch import pdl_args

TILE = 64  # context tokens per inner-loop iteration
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows
MAX_SPLITS = 16  # slices of a row's context in decode_attention_split (the merge reads all)
SPLIT_PROGRAMS = 256  # programs decode_attention_split aims for (the H200 has 132 SMs)
PREFILL_TILE = 64  # query rows (rows x query heads of a KV head) a prefill_attention tile


@dataclass(frozen=True)
class DecodeMetadata:
    """Step inputs of a decode-only batch, all on the device and of fixed shape.

    Plays the role of :class:`engine.attention.AttnMetadata` for the model's
    forward (``positions`` and ``slot_mapping`` are read the same way).
    """

    positions: torch.Tensor  # [B] long, position of each sequence's new token
    slot_mapping: torch.Tensor  # [B] long, flat KV slot the new token is written to
    block_tables: torch.Tensor  # [B, max_blocks] int32 (row stride may exceed max_blocks)
    context_lens: torch.Tensor  # [B] int32, tokens attended (new one included), >= 1
    # every row its own sequence (a decode step without drafts or prompt chunks): RoPE and
    # the K/V write may go inside attention (engine.forward.fused_rope_attention)
    one_row_each: bool = False
    # [B] int32: which sequence each row belongs to, a sequence's rows contiguous (its
    # prompt chunk, or its token and drafts); what prefill_attention tiles by
    segments: torch.Tensor | None = None


def is_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def check_head_dim(head_dim: int) -> str | None:
    """Why this kernel cannot serve ``head_dim``, or None if it can."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 16"
    return None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: DecodeMetadata, scale: float) -> torch.Tensor:
    """q ``[B, H, D]``; caches ``[Hkv, num_blocks, block_size, D]``. Returns ``[B, H * D]``.

    Launches one kernel and never reads a device value on the host, so it can be
    captured in a CUDA graph.
    """
    from engine.triton_decode_kernel import decode_kernel  # Triton only when decoding on GPU

    num_seqs, num_heads, head_dim = q.shape
    num_kv, _, block_size, _ = k_cache.shape
    assert k_cache.stride(-1) == 1 and q.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    group = num_heads // num_kv
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    tables, lens = meta.block_tables, meta.context_lens
    decode_kernel[(num_seqs, num_kv)](
        q, k_cache, v_cache, out, tables, lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), tables.stride(0), lens.stride(0), scale,
        BLOCK_SIZE=block_size, G=group, G_PAD=max(MIN_DOT_ROWS, 1 << (group - 1).bit_length()),
        D=head_dim, TILE_T=TILE, IEEE=q.dtype == torch.float32, **pdl_args(q.is_cuda))
    return out.view(num_seqs, num_heads * head_dim)


def prefill_tile_rows(group: int) -> int:
    """Rows per program of :func:`prefill_attention`: 64 query rows (rows x the ``group``
    query heads of a KV head) a tile, at least one row."""
    return max(1, PREFILL_TILE // group)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: DecodeMetadata, scale: float) -> torch.Tensor:
    """:func:`decode_attention` for steps whose sequences have many rows (prompt chunks):
    a program takes :func:`prefill_tile_rows` consecutive rows of one sequence and reads
    each K/V tile of its context once for all of them, each row masked to its own
    context, where ``decode_attention`` reads a row's whole context once per row (a
    2,048-row chunk of a 1,000-token prompt: 2,048 passes over the same K/V a layer).

    Needs ``meta.segments``. Any rows: a tile holding rows of several sequences runs
    them in turn, so decode rows are served too, one tile's worth at a time.
    """
    from engine.triton_decode_kernel import prefill_kernel

    assert meta.segments is not None
    num_rows, num_heads, head_dim = q.shape
    num_kv, _, block_size, _ = k_cache.shape
    assert k_cache.stride(-1) == 1 and q.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    group = num_heads // num_kv
    rows = prefill_tile_rows(group)
    tile = max(MIN_DOT_ROWS, 1 << (rows * group - 1).bit_length())
    out = torch.empty(num_rows, num_heads, head_dim, dtype=q.dtype, device=q.device)
    tables, lens, seg = meta.block_tables, meta.context_lens, meta.segments
    prefill_kernel[(-(-num_rows // rows), num_kv)](
        q, k_cache, v_cache, out, tables, lens, seg, num_rows,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), tables.stride(0), lens.stride(0), seg.stride(0), scale,
        BLOCK_SIZE=block_size, G=group, BM=rows, M=tile, D=head_dim, TILE_T=TILE,
        IEEE=q.dtype == torch.float32, **pdl_args(q.is_cuda))
    return out.view(num_rows, num_heads * head_dim)


def split_count(num_seqs: int, num_kv: int, max_context: int) -> int:
    """Slices per (sequence, KV head) for :func:`decode_attention_split`: enough programs to
    occupy the device (:data:`SPLIT_PROGRAMS`), at most :data:`MAX_SPLITS` and at most one
    slice per ``TILE`` tokens of the longest context a launch can see."""
    want = -(-SPLIT_PROGRAMS // max(1, num_seqs * num_kv))
    return max(1, min(MAX_SPLITS, want, -(-max_context // TILE)))


def decode_attention_split(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: DecodeMetadata, scale: float,
                           num_splits: int | None = None) -> torch.Tensor:
    """:func:`decode_attention` with each row's context split over ``num_splits`` programs
    (default :func:`split_count`), then merged by a second kernel (flash-decoding).

    NOTE: one (sequence, KV head) program walks its whole context in ``decode_attention``,
    so at batch 1 a 2,000-token context is 8 programs of 32 dependent tiles each, and even
    a 300-token one 8 programs of 5. The slices are cut from each row's own context length
    on the device (whole tiles each; slices past the context return at once), so a
    captured graph serves any context and the programs follow the real lengths, not the
    longest a graph can hold.
    """
    from engine.triton_decode_kernel import decode_combine_kernel, decode_split_kernel

    num_seqs, num_heads, head_dim = q.shape
    num_kv, _, block_size, _ = k_cache.shape
    assert k_cache.stride(-1) == 1 and q.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    group = num_heads // num_kv
    tables, lens = meta.block_tables, meta.context_lens
    if num_splits is None:
        num_splits = split_count(num_seqs, num_kv, tables.shape[1] * block_size)
        if num_splits == 1:  # enough rows to occupy the device: no merge to pay for
            return decode_attention(q, k_cache, v_cache, meta, scale)
    assert num_splits >= 1
    part = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                       device=q.device)
    stats = torch.empty(num_seqs, num_heads, num_splits, 2, dtype=torch.float32,
                        device=q.device)
    decode_split_kernel[(num_seqs, num_kv, num_splits)](
        q, k_cache, v_cache, part, stats, tables, lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.stride(0), lens.stride(0), scale,
        BLOCK_SIZE=block_size, G=group, G_PAD=max(MIN_DOT_ROWS, 1 << (group - 1).bit_length()),
        D=head_dim, TILE_T=TILE, NUM_SPLITS=num_splits,
        IEEE=q.dtype == torch.float32, **pdl_args(q.is_cuda))
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    decode_combine_kernel[(num_seqs, num_heads)](
        part, stats, out, out.stride(0), out.stride(1), D=head_dim, NUM_SPLITS=num_splits,
        S_PAD=max(2, 1 << (num_splits - 1).bit_length()), **pdl_args(q.is_cuda))
    return out.view(num_seqs, num_heads * head_dim)


def decode_attention_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMetadata,
                          scale: float, num_heads: int, num_kv_heads: int,
                          num_splits: int = 1) -> torch.Tensor:
    """RoPE, the K/V-cache write and :func:`decode_attention` in one kernel, for a step in
    which every row is its own sequence (``meta.one_row_each``): ``qkv`` ``[B, nq + 2 nkv,
    D]`` (q|k|v of each row's new token, unrotated), ``cos``/``sin`` the ``[positions, D]``
    tables. Returns ``[B, nq * D]``; k and v land at ``meta.slot_mapping``.

    NOTE: a row of a verify step or a prefill chunk attends over tokens that other rows of
    the same step write, which no ordering inside one kernel provides; such steps keep
    the RoPE kernel before attention (graphs of their own, :mod:`engine.cuda_graph`).

    ``num_splits`` > 1: each row's context in that many slices, merged after, as
    :func:`decode_attention_split` does (0: its :func:`split_count`).
    """
    from engine.triton_decode_kernel import decode_combine_kernel, decode_rope_kernel

    num_seqs, heads, head_dim = qkv.shape
    num_kv, _, block_size, _ = k_cache.shape
    assert heads == num_heads + 2 * num_kv_heads and num_kv == num_kv_heads
    assert qkv.stride(2) == 1 and qkv.stride(1) == head_dim and cos.stride() == sin.stride()
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    group = num_heads // num_kv
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    tables, lens = meta.block_tables, meta.context_lens
    if num_splits == 0:
        num_splits = split_count(num_seqs, num_kv, tables.shape[1] * block_size)
    part = stats = out  # unused with one slice
    if num_splits > 1:
        part = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                           device=qkv.device)
        stats = torch.empty(num_seqs, num_heads, num_splits, 2, dtype=torch.float32,
                            device=qkv.device)
    decode_rope_kernel[(num_seqs, num_kv, num_splits)](
        qkv, cos, sin, meta.positions, meta.slot_mapping, k_cache, v_cache, out, part, stats,
        tables, lens,
        qkv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), tables.stride(0), lens.stride(0), scale,
        NQ=num_heads, NKV=num_kv_heads, BLOCK_SIZE=block_size, G=group,
        G_PAD=max(MIN_DOT_ROWS, 1 << (group - 1).bit_length()), D=head_dim, TILE_T=TILE,
        IEEE=qkv.dtype == torch.float32, NUM_SPLITS=num_splits, **pdl_args(qkv.is_cuda))
    if num_splits > 1:
        decode_combine_kernel[(num_seqs, num_heads)](
            part, stats, out, out.stride(0), out.stride(1), D=head_dim, NUM_SPLITS=num_splits,
            S_PAD=max(2, 1 << (num_splits - 1).bit_length()), **pdl_args(qkv.is_cuda))
    return out.view(num_seqs, num_heads * head_dim)
