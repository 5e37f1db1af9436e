"""The Triton kernel behind :func:`engine.triton_attention.decode_attention`.

Kept apart so that importing the engine on a CPU never imports Triton.
"""

import triton
import triton.language as tl


@triton.jit
def decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr,
                  stride_qb, stride_qh, stride_kh, stride_kb, stride_ks,
                  stride_ob, stride_oh, stride_tb, stride_lb, scale,
                  BLOCK_SIZE: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                  D: tl.constexpr, TILE_T: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(lens_ptr + b * stride_lb)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    g_ok = g < G
    heads = kvh * G + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None], other=0.0)  # [G_PAD, D]
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    den = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for start in range(0, ctx, TILE_T):
        t = start + tl.arange(0, TILE_T)
        t_ok = t < ctx
        blk = tl.load(tables_ptr + b * stride_tb + t // BLOCK_SIZE, mask=t_ok, other=0)
        row = kvh * stride_kh + blk.to(tl.int64) * stride_kb + (t % BLOCK_SIZE) * stride_ks
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=t_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
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
    out = acc / den[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
