"""The Triton kernels behind :mod:`engine.fused` (kept apart so a CPU engine never imports Triton).

Each kernel rounds its intermediate results to the output dtype wherever the torch
reference rounds them (a bf16 op in torch computes in float32 and rounds once per op),
so a fused step differs from the reference only where float32 arithmetic itself is
ordered differently (the RMSNorm reduction, ``exp``).
"""

import triton
import triton.language as tl


@triton.jit
def _wait_prior(USE_GDC: tl.constexpr):
    """Under programmatic dependent launch (engine.launch): wait until the kernel before has
    completed and its writes are visible, then let the next kernel's programs launch."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _round(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to ``dtype`` and back, as a torch op in ``dtype`` stores it."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def add_rms_norm_kernel(h_ptr, delta_ptr, w_ptr, x_ptr, h_out_ptr,
                        stride_h, stride_delta, stride_x, stride_h_out, num_cols, eps,
                        HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
                        USE_GDC: tl.constexpr = False):
    """One row: ``h_out = h + delta`` (when HAS_DELTA), ``x = rms_norm(h_out) * w``."""
    _wait_prior(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < num_cols
    dtype = x_ptr.dtype.element_ty
    h = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=ok, other=0.0)
        h = _round(h + delta.to(tl.float32), dtype)
        tl.store(h_out_ptr + row * stride_h_out + cols, h.to(dtype), mask=ok)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / num_cols + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * stride_x + cols, (h * rstd * w).to(dtype), mask=ok)


@triton.jit
def rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_ptr, v_ptr,
                   stride_t, stride_table, stride_kh, stride_kb, stride_ks,
                   NQ: tl.constexpr, NKV: tl.constexpr, HEADS_PAD: tl.constexpr,
                   KV_PAD: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   USE_GDC: tl.constexpr = False):
    """One token: RoPE on its q and k heads (q in place in ``qkv``, k into the cache) and
    its v heads copied into the cache at its slot."""
    _wait_prior(USE_GDC)
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = D // 2
    dtype = qkv_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HALF)
    is_qk = heads < NQ + NKV
    lo = qkv_ptr + t * stride_t + heads[:, None] * D + d[None, :]  # [HEADS_PAD, HALF]
    x1 = tl.load(lo, mask=is_qk[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(lo + HALF, mask=is_qk[:, None], other=0.0).to(tl.float32)
    table = pos * stride_table
    cos1 = tl.load(cos_ptr + table + d).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + table + HALF + d).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + table + d).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + table + HALF + d).to(tl.float32)[None, :]
    # the reference: x * cos + cat(-x2, x1) * sin, each product rounded, then the sum
    out1 = (_round(x1 * cos1, dtype) + _round(-x2 * sin1, dtype)).to(dtype)
    out2 = (_round(x2 * cos2, dtype) + _round(x1 * sin2, dtype)).to(dtype)
    is_q = heads < NQ
    tl.store(lo, out1, mask=is_q[:, None])
    tl.store(lo + HALF, out2, mask=is_q[:, None])
    cache = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks
    is_k = (heads >= NQ) & is_qk
    k_at = k_ptr + cache + (heads - NQ)[:, None] * stride_kh + d[None, :]
    tl.store(k_at, out1, mask=is_k[:, None])
    tl.store(k_at + HALF, out2, mask=is_k[:, None])
    kv_heads = tl.arange(0, KV_PAD)
    dd = tl.arange(0, D)
    is_v = kv_heads < NKV
    v = tl.load(qkv_ptr + t * stride_t + (NQ + NKV + kv_heads)[:, None] * D + dd[None, :],
                mask=is_v[:, None], other=0.0)
    tl.store(v_ptr + cache + kv_heads[:, None] * stride_kh + dd[None, :], v, mask=is_v[:, None])


@triton.jit
def silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, num_cols,
                    BLOCK: tl.constexpr, USE_GDC: tl.constexpr = False):
    """One tile of one row: ``silu(gate) * up`` from ``[gate | up]``."""
    _wait_prior(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < num_cols
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + num_cols + cols, mask=ok, other=0.0)
    act = _round(gate / (1.0 + tl.exp(-gate)), dtype)  # F.silu rounds to the dtype
    tl.store(out_ptr + row * stride_out + cols, (act * up.to(tl.float32)).to(dtype), mask=ok)


@triton.jit
def skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, delta_ptr, nw_ptr, h_out_ptr,
                       num_rows, N, K, k_per_split, stride_x, stride_w, stride_out,
                       stride_split, stride_delta, stride_h_out, eps,
                       HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, EVEN: tl.constexpr,
                       IEEE: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
                       HAS_DELTA: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_GDC: tl.constexpr = False):
    """``out[:rows, cols] = x @ w[cols].T`` over one K slice (program axis 1).

    ``x`` ``[rows <= BLOCK_M, K]``, ``w`` ``[N, K]`` (a projection's weight, streamed once).
    PARTIAL: float32 partial sums of slice ``s`` to ``out + s * stride_split`` (summed by
    :func:`split_sum_kernel`); else the dtype result (plus bias). EVEN: N % BLOCK_N == 0 and
    every slice a whole number of BLOCK_K, so the weight loads carry no mask.
    GATED: ``w`` is ``[gate | up]``, ``[2 N, K]``; the program also sums ``up``'s rows
    ``N + cols`` and stores ``silu(gate) * up`` (PARTIAL: both sums, up's at ``N + cols``),
    rounded where ``silu_mul_kernel`` rounds.
    NORM: ``x`` is the residual stream ``h`` and the product is of ``rms_norm(h + delta) *
    nw`` (HAS_DELTA: ``h + delta``, rounded, also stored to ``h_out`` by the programs of
    the first column tile): the squares are summed in the same pass over K and the row's
    ``rsqrt`` scales the sums at the end, so the norm costs no kernel of its own
    (PARTIAL: each slice's sum of squares at column ``N`` (GATED: ``2 N``) of its rows).
    """
    _wait_prior(USE_GDC)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    col_ok = cols < N
    k_start = pid_k * k_per_split
    dtype = x_ptr.dtype.element_ty
    x_at = x_ptr + rows[:, None] * stride_x + tl.arange(0, BLOCK_K)[None, :]
    d_at = delta_ptr + rows[:, None] * stride_delta + tl.arange(0, BLOCK_K)[None, :]
    h_at = h_out_ptr + rows[:, None] * stride_h_out + tl.arange(0, BLOCK_K)[None, :]
    w_at = w_ptr + cols[:, None].to(tl.int64) * stride_w + tl.arange(0, BLOCK_K)[None, :]
    up_at = w_at + N.to(tl.int64) * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    squares = tl.zeros([BLOCK_M], tl.float32)
    for k in range(k_start, k_start + k_per_split, BLOCK_K):
        k_ok = (k + tl.arange(0, BLOCK_K)) < K
        x_ok = row_ok[:, None] & k_ok[None, :]
        if EVEN:
            x = tl.load(x_at + k, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_at + k)  # [BLOCK_N, BLOCK_K]
            if GATED:
                w_up = tl.load(up_at + k)
        else:
            x = tl.load(x_at + k, mask=x_ok, other=0.0)
            w = tl.load(w_at + k, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if GATED:
                w_up = tl.load(up_at + k, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            h = x.to(tl.float32)
            if HAS_DELTA:
                h = _round(h + tl.load(d_at + k, mask=x_ok, other=0.0).to(tl.float32), dtype)
                if pid_n == 0:
                    tl.store(h_at + k, h.to(dtype), mask=x_ok)
            squares += tl.sum(h * h, axis=1)
            nw = tl.load(nw_ptr + k + tl.arange(0, BLOCK_K), mask=k_ok, other=0.0)
            x = (h * nw.to(tl.float32)[None, :]).to(dtype)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            if GATED:
                acc_up += tl.dot(x, tl.trans(w_up), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
            if GATED:
                acc_up += tl.dot(x, tl.trans(w_up))
    out_at = rows[:, None] * stride_out + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_k * stride_split + out_at, acc, mask=ok)
        if GATED:
            tl.store(out_ptr + pid_k * stride_split + N + out_at, acc_up, mask=ok)
        if NORM:
            if pid_n == 0:
                ss_col = 2 * N if GATED else N
                tl.store(out_ptr + pid_k * stride_split + rows * stride_out + ss_col, squares,
                         mask=row_ok)
    else:
        if NORM:
            rstd = tl.rsqrt(squares / K + eps)[:, None]
            acc = acc * rstd
            acc_up = acc_up * rstd
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc = _silu_times(acc, acc_up, dtype)
        tl.store(out_ptr + out_at, acc.to(dtype), mask=ok)


@triton.jit
def _silu_times(gate, up, dtype: tl.constexpr):
    """``silu(gate) * up`` of float32 projection sums, each rounded to ``dtype`` first (the
    projection's output), then as ``silu_mul_kernel`` rounds."""
    gate = _round(gate, dtype)
    act = _round(gate / (1.0 + tl.exp(-gate)), dtype)
    return act * _round(up, dtype)


@triton.jit
def split_sum_kernel(part_ptr, b_ptr, out_ptr, N, K, stride_split, stride_part, stride_out,
                     eps, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                     NORM: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr = False):
    """One tile of one row: the SPLIT partial sums of :func:`skinny_gemm_kernel`, in order
    (GATED: gate's and up's, then ``silu(gate) * up``; NORM: scaled by the row's rsqrt of
    its summed squares)."""
    _wait_prior(USE_GDC)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    acc_up = tl.zeros([BLOCK], tl.float32)
    squares = 0.0
    for s in tl.static_range(SPLIT):
        at = part_ptr + s * stride_split + row * stride_part
        acc += tl.load(at + cols, mask=ok, other=0.0)
        if GATED:
            acc_up += tl.load(at + N + cols, mask=ok, other=0.0)
        if NORM:
            squares += tl.load(at + (2 * N if GATED else N))
    if NORM:
        rstd = tl.rsqrt(squares / K + eps)
        acc = acc * rstd
        acc_up = acc_up * rstd
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if GATED:
        acc = _silu_times(acc, acc_up, dtype)
    tl.store(out_ptr + row * stride_out + cols, acc.to(dtype), mask=ok)


@triton.jit
def l2_prefetch_kernel(ptr, num_bytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Ask the L2 cache for ``num_bytes`` from ``ptr`` (16-byte aligned, a multiple of 16):
    each lane one ``CHUNK``-byte bulk prefetch (Hopper's ``cp.async.bulk.prefetch.L2``),
    which moves no data into the SM and returns at once."""
    at = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = tl.minimum(num_bytes - at, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr.to(tl.pointer_type(tl.int8)) + at, size], dtype=tl.int32,
        is_pure=False, pack=1)


@triton.jit
def argmax_part_kernel(x_ptr, val_ptr, idx_ptr, num_cols, stride_x, num_parts,
                       BLOCK: tl.constexpr):
    """One ``BLOCK`` of one row: its largest value and the first column holding it."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < num_cols, other=float("-inf"))
    best, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * num_parts + part, best)
    tl.store(idx_ptr + row * num_parts + part, part * BLOCK + at)


@triton.jit
def argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, num_parts, PARTS: tl.constexpr):
    """One row: the first column of its largest value, from its blocks' in column order."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, PARTS)
    v = tl.load(val_ptr + row * num_parts + p, mask=p < num_parts, other=float("-inf"))
    _, j = tl.max(v, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * num_parts + j).to(tl.int64))
