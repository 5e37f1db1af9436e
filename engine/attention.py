"""Attention over a flat batch of variable-length query slices with a paged KV cache.

Every scheduled sequence contributes ``q_len`` query tokens at positions
``start .. start + q_len - 1`` (a prefill chunk, one decode token, or k + 1
tokens for speculative verification — the same code path). Their keys and
values are written into cache slots first; then each sequence's whole context
is gathered block-by-block from its block table and attended with SDPA.

NOTE: sequences are split into two groups, short queries (decode and
verification, ``q_len <= short_q``) first and long ones (prefill chunks) after,
so that padding every query in a group to the longest one never pads 31
decode rows up to a 512-token prefill chunk. Within a group, grouped-query
attention folds the ``G = num_heads / num_kv_heads`` query heads of one KV head
into the query-length axis, so K and V are never repeated.

NOTE: on the CPU in float32, when :mod:`engine.cpu_attention` built, the short
group is one unpadded group attended by that fused kernel straight from the
paged cache (no gather copy, no mask); prefill chunks keep the SDPA path.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.cpu_attention import CpuPagedAttention


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of a step: ``q_len`` new tokens after ``start`` cached ones."""

    q_len: int
    start: int  # tokens of this sequence already in the KV cache
    block_table: Sequence[int]  # KV blocks holding positions 0 .. start + q_len - 1


@dataclass(frozen=True)
class AttnGroup:
    """Sequences attended together, padded to a common query length ``max_q``."""

    rows: tuple[int, int]  # [begin, end) rows of the flat token batch
    pad_idx: torch.Tensor | None  # [rows] destination in the padded [B * max_q]; None if unpadded
    num_seqs: int  # B
    max_q: int
    block_tables: torch.Tensor  # [B, num_blocks] long
    # [B, 1, G * max_q, num_blocks * block_size] bool, True = attend; None: kernel group
    mask: torch.Tensor | None
    starts: torch.Tensor | None = None  # [B] long, cached tokens per sequence (kernel group)
    q_lens: torch.Tensor | None = None  # [B] long, query rows per sequence (kernel group)


@dataclass(frozen=True)
class AttnMetadata:
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long, flat KV slot of each new token
    groups: tuple[AttnGroup, ...]
    kernel: CpuPagedAttention | None = None  # attends the groups whose mask is None


def order_short_first(q_lens: Sequence[int], short_q: int,
                      contexts: Sequence[int] | None = None) -> list[int]:
    """Indices of sequences with short queries first, then long ones.

    With ``contexts`` (cached + new tokens per sequence) the short ones are sorted by
    context length, which lets :func:`build_metadata` split them into groups that pad
    less; otherwise the order is stable.
    """
    short = [i for i, n in enumerate(q_lens) if n <= short_q]
    if contexts is not None:
        short.sort(key=lambda i: contexts[i])
    long = [i for i, n in enumerate(q_lens) if n > short_q]
    return short + long


def build_metadata(slices: Sequence[SeqSlice], block_size: int, num_q_per_kv: int,
                   short_q: int, device: str | torch.device = "cpu",
                   kernel: CpuPagedAttention | None = None) -> AttnMetadata:
    """Positions, slot mapping and attention groups; ``slices`` must be short-first ordered.

    Built on the CPU (small integer tensors), then moved to ``device`` in one go.
    With ``kernel`` (CPU only) the short queries form one group that it attends.
    """
    q_lens = [s.q_len for s in slices]
    starts = torch.tensor([s.start for s in slices], dtype=torch.long)
    q_lens_t = torch.tensor(q_lens, dtype=torch.long)
    num_blocks = max(len(s.block_table) for s in slices)
    tables = torch.tensor([list(s.block_table) + [0] * (num_blocks - len(s.block_table))
                           for s in slices], dtype=torch.long)  # [S, num_blocks]
    seq_of_token = torch.repeat_interleave(torch.arange(len(slices)), q_lens_t)  # [T]
    offsets = torch.cumsum(q_lens_t, 0) - q_lens_t  # [S] first row of each sequence
    within = torch.arange(int(q_lens_t.sum())) - offsets[seq_of_token]  # [T]
    positions = starts[seq_of_token] + within
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    split = sum(1 for n in q_lens if n <= short_q)
    if torch.device(device).type != "cpu":
        kernel = None
    groups = []
    if kernel is not None and split:
        groups.append(_kernel_group(slices, split, tables, starts, q_lens_t, block_size))
    short = [] if kernel is not None else _split_by_context(slices, 0, split, block_size)
    for lo, hi in (*short, (split, len(slices))):
        if hi > lo:
            groups.append(_group(slices, lo, hi, tables, offsets, positions, within,
                                 block_size, num_q_per_kv))
    meta = AttnMetadata(positions, slots, tuple(groups), kernel)
    return meta if torch.device(device).type == "cpu" else _to_device(meta, device)


def _kernel_group(slices: Sequence[SeqSlice], hi: int, tables: torch.Tensor,
                  starts: torch.Tensor, q_lens: torch.Tensor, block_size: int) -> AttnGroup:
    """Sequences ``[0, hi)`` unpadded: the kernel walks each one's own context."""
    num_blocks = max(-(-(s.start + s.q_len) // block_size) for s in slices[:hi])
    return AttnGroup(rows=(0, int(q_lens[:hi].sum())), pad_idx=None, num_seqs=hi,
                     max_q=int(q_lens[:hi].max()),
                     block_tables=tables[:hi, :num_blocks].contiguous(), mask=None,
                     starts=starts[:hi].contiguous(), q_lens=q_lens[:hi].contiguous())


def _to_device(meta: AttnMetadata, device: str | torch.device) -> AttnMetadata:
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    groups = tuple(dataclasses.replace(
        g, pad_idx=None if g.pad_idx is None else move(g.pad_idx),
        block_tables=move(g.block_tables), mask=None if g.mask is None else move(g.mask))
        for g in meta.groups)
    return AttnMetadata(move(meta.positions), move(meta.slot_mapping), groups)


MIN_SPLIT_SEQS = 8  # below this, one more SDPA call costs more than the padding it saves


def _split_by_context(slices: Sequence[SeqSlice], lo: int, hi: int,
                      block_size: int) -> list[tuple[int, int]]:
    """Cut [lo, hi) in two where that gathers at least a quarter fewer KV blocks.

    Every sequence in a group is gathered up to the group's longest context, so a
    batch mixing 100- and 1,000-token contexts copies mostly padding.
    """
    if hi - lo < MIN_SPLIT_SEQS:
        return [(lo, hi)]
    blocks = [-(-(s.start + s.q_len) // block_size) for s in slices[lo:hi]]
    prefix_max = list(itertools.accumulate(blocks, max))
    suffix_max = list(itertools.accumulate(reversed(blocks), max))[::-1]
    n = len(blocks)
    best, cut = n * prefix_max[-1], 0
    for c in range(1, n):
        cost = c * prefix_max[c - 1] + (n - c) * suffix_max[c]
        if cost < best:
            best, cut = cost, c
    if cut == 0 or best > 0.75 * n * prefix_max[-1]:
        return [(lo, hi)]
    return [(lo, lo + cut), (lo + cut, hi)]


def _group(slices: Sequence[SeqSlice], lo: int, hi: int, tables: torch.Tensor,
           offsets: torch.Tensor, positions: torch.Tensor, within: torch.Tensor,
           block_size: int, num_q_per_kv: int) -> AttnGroup:
    q_lens = [s.q_len for s in slices[lo:hi]]
    max_q, num_seqs = max(q_lens), hi - lo
    begin = int(offsets[lo])
    end = begin + sum(q_lens)
    ctx = max(s.start + s.q_len for s in slices[lo:hi])
    num_blocks = -(-ctx // block_size)
    pad_idx = None
    q_pos = positions[begin:end]
    if any(n != max_q for n in q_lens):
        local = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(q_lens))
        pad_idx = local * max_q + within[begin:end]
        q_pos = torch.zeros(num_seqs * max_q, dtype=torch.long).index_copy_(0, pad_idx, q_pos)
    keys = torch.arange(num_blocks * block_size)
    mask = keys.view(1, 1, -1) <= q_pos.view(num_seqs, max_q, 1)  # [B, max_q, L]
    mask = mask.unsqueeze(1).expand(num_seqs, num_q_per_kv, max_q, keys.numel())
    return AttnGroup(rows=(begin, end), pad_idx=pad_idx, num_seqs=num_seqs, max_q=max_q,
                     block_tables=tables[lo:hi, :num_blocks].contiguous(),
                     mask=mask.reshape(num_seqs, 1, num_q_per_kv * max_q, -1))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttnMetadata, scale: float, naive: bool = False) -> torch.Tensor:
    """q: [T, H, D]; caches: [Hkv, num_blocks, block_size, D]. Returns [T, H * D]."""
    outs = [_attend_group(q[g.rows[0]:g.rows[1]], k_cache, v_cache, g, scale, naive)
            if g.mask is not None else _attend_kernel(q[g.rows[0]:g.rows[1]], k_cache, v_cache,
                                                      g, scale, meta.kernel)
            for g in meta.groups]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: AttnGroup,
                   scale: float, kernel: CpuPagedAttention | None) -> torch.Tensor:
    assert kernel is not None and g.starts is not None and g.q_lens is not None
    return kernel.attend(q, k_cache, v_cache, g.block_tables, g.starts, g.q_lens, scale)


def _naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, Hkv, G * mq, L)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: AttnGroup,
                  scale: float, naive: bool) -> torch.Tensor:
    rows, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[0]
    qpg = num_heads // num_kv
    b, mq = g.num_seqs, g.max_q
    assert g.mask is not None
    if g.pad_idx is not None:
        q = q.new_zeros(b * mq, num_heads, head_dim).index_copy_(0, g.pad_idx, q)
    # (B, mq, Hkv, G, D) -> (B, Hkv, G * mq, D): fold query heads sharing a KV head.
    qg = q.view(b, mq, num_kv, qpg, head_dim).permute(0, 2, 3, 1, 4).reshape(
        b, num_kv, qpg * mq, head_dim)
    length = g.block_tables.shape[1] * k_cache.shape[2]
    blocks = g.block_tables.view(-1)
    # index_select copies whole blocks (memcpy); advanced indexing is ~4x slower here.
    k = k_cache.index_select(1, blocks).view(num_kv, b, length, head_dim).transpose(0, 1)
    v = v_cache.index_select(1, blocks).view(num_kv, b, length, head_dim).transpose(0, 1)
    if naive:
        o = _naive_attention(qg, k, v, g.mask, scale)
    else:
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=scale)
    # (B, Hkv, G * mq, D) -> (B, mq, Hkv, G, D) -> rows
    o = o.view(b, num_kv, qpg, mq, head_dim).permute(0, 3, 1, 2, 4).reshape(
        b * mq, num_heads * head_dim)
    if g.pad_idx is not None:
        o = o.index_select(0, g.pad_idx)
    return o
