"""The Triton kernel behind :func:`engine.triton_attention.decode_attention`.

Kept apart so that importing the engine on a CPU never imports Triton.
"""

import triton
import triton.language as tl

from engine.fused_kernels import _round, _wait_prior


@triton.jit
def _attend_range(lo, hi, q, k_ptr, v_ptr, tables_ptr, b, kvh, stride_kh, stride_kb,
                  stride_ks, stride_tb, scale, BLOCK_SIZE: tl.constexpr,
                  G_PAD: tl.constexpr, D: tl.constexpr, TILE_T: tl.constexpr,
                  IEEE: tl.constexpr):
    """Online softmax of ``q [G_PAD, D]`` over context positions ``[lo, hi)`` of sequence
    ``b``'s KV head ``kvh``: the running max ``m``, sum ``den`` [G_PAD] and unnormalized
    ``acc`` [G_PAD, D], float32 (``m`` -inf where the range is empty)."""
    return _attend(lo, hi, hi, q, k_ptr, v_ptr, tables_ptr, b, kvh, stride_kh, stride_kb,
                   stride_ks, stride_tb, scale, BLOCK_SIZE, G_PAD, D, TILE_T, IEEE,
                   PER_ROW=False)


@triton.jit
def _attend(lo, hi, lim, q, k_ptr, v_ptr, tables_ptr, b, kvh, stride_kh, stride_kb,
            stride_ks, stride_tb, scale, BLOCK_SIZE: tl.constexpr, G_PAD: tl.constexpr,
            D: tl.constexpr, TILE_T: tl.constexpr, IEEE: tl.constexpr,
            PER_ROW: tl.constexpr):
    """:func:`_attend_range`; ``PER_ROW``: query row ``i`` masked to the positions below
    ``lim[i]`` as well (:func:`_attend_rows`)."""
    d = tl.arange(0, D)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    den = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for start in range(lo, hi, TILE_T):
        t = start + tl.arange(0, TILE_T)
        t_ok = t < hi
        blk = tl.load(tables_ptr + b * stride_tb + t // BLOCK_SIZE, mask=t_ok, other=0)
        row = kvh * stride_kh + blk.to(tl.int64) * stride_kb + (t % BLOCK_SIZE) * stride_ks
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=t_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if PER_ROW:
            s = tl.where(t[None, :] < lim[:, None], s * scale, float("-inf"))
        else:
            s = tl.where(t_ok[None, :], s * scale, float("-inf"))  # [G_PAD, TILE_T]
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=t_ok[:, None], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    return m, den, acc


@triton.jit
def decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr,
                  stride_qb, stride_qh, stride_kh, stride_kb, stride_ks,
                  stride_ob, stride_oh, stride_tb, stride_lb, scale,
                  BLOCK_SIZE: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                  D: tl.constexpr, TILE_T: tl.constexpr, IEEE: tl.constexpr,
                  USE_GDC: tl.constexpr = False):
    _wait_prior(USE_GDC)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(lens_ptr + b * stride_lb)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    g_ok = g < G
    heads = kvh * G + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None], other=0.0)  # [G_PAD, D]
    m, den, acc = _attend_range(0, ctx, q, k_ptr, v_ptr, tables_ptr, b, kvh,
                                stride_kh, stride_kb, stride_ks, stride_tb, scale,
                                BLOCK_SIZE, G_PAD, D, TILE_T, IEEE)
    out = acc / den[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def decode_split_kernel(q_ptr, k_ptr, v_ptr, part_ptr, stats_ptr, tables_ptr, lens_ptr,
                        stride_qb, stride_qh, stride_kh, stride_kb, stride_ks,
                        stride_tb, stride_lb, scale,
                        BLOCK_SIZE: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                        D: tl.constexpr, TILE_T: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
                        USE_GDC: tl.constexpr = False):
    """:func:`decode_kernel` over one of ``NUM_SPLITS`` slices of the row's context (axis
    2), each a whole number of ``TILE_T`` tiles: unnormalized ``acc`` to ``part [B, H,
    NUM_SPLITS, D]``, the running max and sum to ``stats [B, H, NUM_SPLITS, 2]`` (float32);
    a slice past the context writes max -inf."""
    _wait_prior(USE_GDC)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b * stride_lb)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    g_ok = g < G
    heads = kvh * G + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None], other=0.0)  # [G_PAD, D]
    span = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), TILE_T) * TILE_T  # the slices follow ctx
    lo = split * span
    hi = tl.minimum(lo + span, ctx)
    m, den, acc = _attend_range(lo, hi, q, k_ptr, v_ptr, tables_ptr, b, kvh,
                                stride_kh, stride_kb, stride_ks, stride_tb, scale,
                                BLOCK_SIZE, G_PAD, D, TILE_T, IEEE)
    at = (b * (G * tl.num_programs(1)) + heads) * NUM_SPLITS + split  # [G_PAD]
    tl.store(part_ptr + at[:, None] * D + d[None, :], acc, mask=g_ok[:, None])
    tl.store(stats_ptr + at * 2, m, mask=g_ok)
    tl.store(stats_ptr + at * 2 + 1, den, mask=g_ok)


@triton.jit
def decode_combine_kernel(part_ptr, stats_ptr, out_ptr, stride_ob, stride_oh,
                          D: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr,
                          USE_GDC: tl.constexpr = False):
    """One (sequence, head): the slices of :func:`decode_split_kernel` merged by their maxima
    (slices past the context, max -inf, weigh nothing)."""
    _wait_prior(USE_GDC)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D)
    s_ok = s < NUM_SPLITS
    at = (b * tl.num_programs(1) + h) * NUM_SPLITS + s  # [S_PAD]
    m = tl.load(stats_ptr + at * 2, mask=s_ok, other=float("-inf"))
    den = tl.load(stats_ptr + at * 2 + 1, mask=s_ok, other=0.0)
    top = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)  # [S_PAD]
    acc = tl.load(part_ptr + at[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(den * w, 0)  # [D]
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def decode_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_ptr, v_ptr, out_ptr,
                       part_ptr, stats_ptr,
                       tables_ptr, lens_ptr, stride_t, stride_table, stride_kh, stride_kb,
                       stride_ks, stride_ob, stride_oh, stride_tb, stride_lb, scale,
                       NQ: tl.constexpr, NKV: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                       TILE_T: tl.constexpr, IEEE: tl.constexpr, NUM_SPLITS: tl.constexpr = 1,
                       USE_GDC: tl.constexpr = False):
    """:func:`decode_kernel` from the q|k|v projection ``[B, NQ + 2 NKV, D]`` of a step whose
    every row is its own sequence: RoPE on the program's G q heads (kept in registers) and
    its k head, the new k and v written to the caches at the row's slot, then attention
    over the context, the new token included (a CTA barrier orders its own writes before
    its reads; no other program writes a slot this row reads, since no row shares a
    sequence with another, padding rows aside, which write row 0's very values).
    Rounded as :func:`engine.fused_kernels.rope_kv_kernel`.

    ``NUM_SPLITS`` > 1: the context cut as :func:`decode_split_kernel` cuts it (axis 2),
    partials to ``part``/``stats`` for :func:`decode_combine_kernel`; only the program
    whose slice holds the new token writes it to the caches (and reads it back), every
    other slice lies before it."""
    _wait_prior(USE_GDC)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    dtype = k_ptr.dtype.element_ty
    ctx = tl.load(lens_ptr + b * stride_lb)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    partner = (d + HALF) % D  # rotate_half: cat(-x2, x1)
    sign = tl.where(d < HALF, -1.0, 1.0)
    cos = tl.load(cos_ptr + pos * stride_table + d).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_table + d).to(tl.float32)
    g_ok = g < G
    heads = kvh * G + g
    row = qkv_ptr + b.to(tl.int64) * stride_t
    x = tl.load(row + heads[:, None] * D + d[None, :], mask=g_ok[:, None], other=0.0)
    xp = tl.load(row + heads[:, None] * D + partner[None, :], mask=g_ok[:, None], other=0.0)
    q = (_round(x.to(tl.float32) * cos[None, :], dtype)
         + _round(sign[None, :] * xp.to(tl.float32) * sin[None, :], dtype)).to(dtype)
    k_at = row + (NQ + kvh) * D
    k_new = (_round(tl.load(k_at + d).to(tl.float32) * cos, dtype)
             + _round(sign * tl.load(k_at + partner).to(tl.float32) * sin, dtype)).to(dtype)
    v_new = tl.load(row + (NQ + NKV + kvh) * D + d)
    cache = kvh * stride_kh + (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks
    split = tl.program_id(2)
    span = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), TILE_T) * TILE_T  # as decode_split_kernel
    lo = split * span
    hi = tl.minimum(lo + span, ctx)
    own = d < tl.where((ctx - 1) // span == split, D, 0)  # in the new token's slice: all d
    tl.store(k_ptr + cache + d, k_new, mask=own)
    tl.store(v_ptr + cache + d, v_new, mask=own)
    tl.debug_barrier()
    m, den, acc = _attend_range(lo, hi, q, k_ptr, v_ptr, tables_ptr, b, kvh,
                                stride_kh, stride_kb, stride_ks, stride_tb, scale,
                                BLOCK_SIZE, G_PAD, D, TILE_T, IEEE)
    if NUM_SPLITS == 1:
        out = acc / den[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        at = (b * (G * NKV) + heads) * NUM_SPLITS + split  # [G_PAD]
        tl.store(part_ptr + at[:, None] * D + d[None, :], acc, mask=g_ok[:, None])
        tl.store(stats_ptr + at * 2, m, mask=g_ok)
        tl.store(stats_ptr + at * 2 + 1, den, mask=g_ok)


@triton.jit
def _attend_rows(hi, lim, q, k_ptr, v_ptr, tables_ptr, b, kvh, stride_kh, stride_kb,
                 stride_ks, stride_tb, scale, BLOCK_SIZE: tl.constexpr, M: tl.constexpr,
                 D: tl.constexpr, TILE_T: tl.constexpr, IEEE: tl.constexpr):
    """:func:`_attend_range` over ``[0, hi)`` of row ``b``'s block table for ``M`` query rows
    ``q [M, D]``, row ``i`` masked to the positions below ``lim[i]`` (>= 1 each, so every
    row meets a position in the first tile and its running max is finite from there)."""
    return _attend(0, hi, lim, q, k_ptr, v_ptr, tables_ptr, b, kvh, stride_kh, stride_kb,
                   stride_ks, stride_tb, scale, BLOCK_SIZE, M, D, TILE_T, IEEE,
                   PER_ROW=True)


@triton.jit
def prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, seg_ptr, num_rows,
                   stride_qb, stride_qh, stride_kh, stride_kb, stride_ks,
                   stride_ob, stride_oh, stride_tb, stride_lb, stride_sb, scale,
                   BLOCK_SIZE: tl.constexpr, G: tl.constexpr, BM: tl.constexpr,
                   M: tl.constexpr, D: tl.constexpr, TILE_T: tl.constexpr,
                   IEEE: tl.constexpr, USE_GDC: tl.constexpr = False):
    """``BM`` consecutive rows x the ``G`` query heads of one KV head (axis 1) as one ``[M,
    D]`` tile (``M >= BM * G``): the rows of one sequence (``seg``, contiguous) read each K/V
    tile of its context once for all of them, each row masked to its own context (causal).
    A tile holding several sequences' rows runs them one after another."""
    _wait_prior(USE_GDC)
    r0 = tl.program_id(0) * BM
    kvh = tl.program_id(1)
    mi = tl.arange(0, M)
    row = r0 + mi // G  # [M]
    head = kvh * G + mi % G
    in_tile = (mi < BM * G) & (row < num_rows)
    seg = tl.load(seg_ptr + row * stride_sb, mask=in_tile, other=-1)
    d = tl.arange(0, D)
    end = tl.minimum(r0 + BM, num_rows)
    s = r0
    while s < end:
        # the run of rows from s that share its sequence (padding rows repeat row 0's: a
        # run of their own after the others, never joined to row 0's)
        other = in_tile & (row > s) & (seg != tl.load(seg_ptr + s * stride_sb))
        nxt = tl.min(tl.where(other, row, end), 0)
        active = in_tile & (row >= s) & (row < nxt)
        lim = tl.load(lens_ptr + row * stride_lb, mask=active, other=1)
        hi = tl.max(tl.where(active, lim, 0), 0)
        q = tl.load(q_ptr + row[:, None] * stride_qb + head[:, None] * stride_qh + d[None, :],
                    mask=active[:, None], other=0.0)  # [M, D]
        _, den, acc = _attend_rows(hi, lim, q, k_ptr, v_ptr, tables_ptr, s, kvh,
                                   stride_kh, stride_kb, stride_ks, stride_tb, scale,
                                   BLOCK_SIZE, M, D, TILE_T, IEEE)
        out = acc / den[:, None]
        tl.store(out_ptr + row[:, None] * stride_ob + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=active[:, None])
        s = nxt
