"""Projections for CPU decode and verification steps: float32 math on bfloat16-stored weights.

At a few rows per step a projection only streams its weight matrix once, so
its cost is the weight bytes and the instruction overhead, not the FLOPs. The
bundled checkpoints are bfloat16 on disk: keeping that copy (every value is
exact, nothing is rounded) halves the bytes, and this C kernel widens sixteen
weights to float32 with one load, a shift and an AND, and accumulates in float32
with several independent FMA chains, two FMAs per broadcast of the input. On the 2-core box it runs the tiny target's 33
projections of one step 5-7x faster than oneDNN float32 at 1 row, 2x at 8-9,
1.4x at 16-24 and 1.2-1.4x at 32 (``bench/engine_step.py``); past ``SMALL_ROWS``
rows (prefill chunks) oneDNN's packed float32 GEMM takes over.

:class:`CpuProjection` holds both copies of one weight; :func:`project` picks
per call. Weights that are not exactly representable in bfloat16 (a float32
checkpoint) keep only the oneDNN copy, so results never depend on the kernel.
Without AVX2, a compiler, or with ``POLYINFER_CPU_GEMM=0``, the kernel is not
built (the reason is logged) and every call takes the oneDNN path.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

from engine.cbuild import load_library

logger = logging.getLogger(__name__)

DISABLE_ENV = "POLYINFER_CPU_GEMM"  # "0" keeps oneDNN for every row count
SMALL_ROWS = 32  # rows up to which the kernel beats oneDNN's packed float32 GEMM here
COLUMNS = 16  # output columns per kernel block (two AVX2 registers)
# NOTE: the row count oneDNN blocks its packed layout for; 8, 32 and 128 measured the
# same within noise for 1-512 rows on the 2-core box.
ONEDNN_BATCH_HINT = 32

SOURCE = r"""
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#define INLINE static inline __attribute__((always_inline))

/* y[r, 0:16] = x[r, :] . W[0:16, :] + bias, MR rows. w holds the block as [K][8] pairs of
   bfloat16: the low half of pair j is column j, the high half column 8 + j. A bfloat16 is
   the top half of a float32, so one shift (low) and one AND (high) widen 16 weights, and
   every broadcast of x feeds two FMAs. U accumulators per row and column half over
   interleaved k keep at least 8 FMA chains in flight. */
INLINE void block(const float *x, int64_t xs, int64_t K, const uint32_t *w, float *y,
                  int64_t ys, const float *bias, const int MR, const int U) {
    __m256 lo[6][4], hi[6][4];
    const __m256i top = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int r = 0; r < MR; r++)
        for (int u = 0; u < U; u++) {
            lo[r][u] = _mm256_setzero_ps();
            hi[r][u] = _mm256_setzero_ps();
        }
    int64_t k = 0;
    for (; k + U <= K; k += U)
        for (int u = 0; u < U; u++) {
            __m256i p = _mm256_loadu_si256((const __m256i *)(w + (k + u) * 8));
            __m256 wl = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
            __m256 wh = _mm256_castsi256_ps(_mm256_and_si256(p, top));
            for (int r = 0; r < MR; r++) {
                __m256 xb = _mm256_broadcast_ss(x + r * xs + k + u);
                lo[r][u] = _mm256_fmadd_ps(xb, wl, lo[r][u]);
                hi[r][u] = _mm256_fmadd_ps(xb, wh, hi[r][u]);
            }
        }
    for (; k < K; k++) {
        __m256i p = _mm256_loadu_si256((const __m256i *)(w + k * 8));
        __m256 wl = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
        __m256 wh = _mm256_castsi256_ps(_mm256_and_si256(p, top));
        for (int r = 0; r < MR; r++) {
            __m256 xb = _mm256_broadcast_ss(x + r * xs + k);
            lo[r][0] = _mm256_fmadd_ps(xb, wl, lo[r][0]);
            hi[r][0] = _mm256_fmadd_ps(xb, wh, hi[r][0]);
        }
    }
    __m256 bl = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    __m256 bh = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    for (int r = 0; r < MR; r++) {
        __m256 sl = lo[r][0], sh = hi[r][0];
        for (int u = 1; u < U; u++) {
            sl = _mm256_add_ps(sl, lo[r][u]);
            sh = _mm256_add_ps(sh, hi[r][u]);
        }
        _mm256_storeu_ps(y + r * ys, _mm256_add_ps(sl, bl));
        _mm256_storeu_ps(y + r * ys + 8, _mm256_add_ps(sh, bh));
    }
}

#define MAX_MR 6  /* rows per block: 12 accumulators + 2 weights + a broadcast in 16 registers */
#define ROWS(R, U) case R: block(xr, xs, K, w, yr, ys, bb, R, U); break;

/* y [M, N] (row stride ys) = x [M, K] (row stride xs) @ W.T + bias; W packed as
   [N / 16][K][8] pairs of bfloat16 (see block). Every column block is read from memory
   once; row blocks (at most MAX_MR rows each) after the first find it in L1. Returns 1 if
   N is not a multiple of 16. */
int linear_bf16w(const float *x, int64_t xs, int64_t M, int64_t K, const uint32_t *packed,
                 int64_t N, const float *bias, float *y, int64_t ys) {
    if (N % 16) return 1;
    for (int64_t nb = 0; nb < N / 16; nb++) {
        const uint32_t *w = packed + nb * K * 8;
        const float *bb = bias ? bias + nb * 16 : 0;
        int64_t blocks = (M + MAX_MR - 1) / MAX_MR;  /* balanced: 9 rows = 5 + 4, not 6 + 3 */
        for (int64_t b = 0, m0 = 0; b < blocks; b++) {
            int64_t left = blocks - b, rows = (M - m0 + left - 1) / left;
            const float *xr = x + m0 * xs;
            float *yr = y + m0 * ys + nb * 16;
            switch (rows) {
                ROWS(1, 4) ROWS(2, 2) ROWS(3, 2) ROWS(4, 1) ROWS(5, 1) ROWS(6, 1)
            }
            m0 += rows;
        }
    }
    return 0;
}
#else
#error "the bfloat16-weight projection kernel needs AVX2 and FMA"
#endif
"""


class CpuGemm:
    """The loaded kernel: ``linear(x, packed, n, bias)`` for float32 rows."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.linear_bf16w
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64]
        fn.restype = ctypes.c_int
        self._fn = fn

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int,
               bias: torch.Tensor | None) -> torch.Tensor:
        """x ``[M, K]`` float32 (unit stride along K) -> ``[M, n]``."""
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        rc = self._fn(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], packed.data_ptr(), n,
                      None if bias is None else bias.data_ptr(), y.data_ptr(), n)
        if rc != 0:
            raise ValueError(f"projection kernel refused {n} output columns")
        return y


@dataclass(frozen=True)
class CpuProjection:
    """One float32 weight ``[n, k]``, packed for oneDNN and (when exact) for the kernel."""

    onednn: torch.Tensor
    # [n / 16, k, 8, 2] int16 bit patterns: [b, k, j] = (column 16b + j, 16b + 8 + j)
    bf16: torch.Tensor | None
    n: int
    k: int
    kernel: CpuGemm | None

    @classmethod
    def pack(cls, w: torch.Tensor, kernel: CpuGemm | None) -> CpuProjection:
        n, k = w.shape
        bf16 = None
        if kernel is not None and n % COLUMNS == 0:
            half = w.to(torch.bfloat16)
            if torch.equal(half.float(), w):  # exact: the kernel computes the same products
                bf16 = (half.view(torch.int16).view(n // COLUMNS, 2, COLUMNS // 2, k)
                        .permute(0, 3, 2, 1).contiguous())
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_BATCH_HINT)
        return cls(onednn, bf16, n, k, kernel if bf16 is not None else None)


def project(x: torch.Tensor, w: CpuProjection, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for a 2-D float32 ``x``: the kernel for few rows, oneDNN otherwise."""
    if w.kernel is not None and x.shape[0] <= SMALL_ROWS and x.dim() == 2:
        if x.stride(1) != 1:
            x = x.contiguous()
        return w.kernel.linear(x, w.bf16, w.n, bias)  # type: ignore[arg-type]
    return torch.ops.mkldnn._linear_pointwise(x, w.onednn, bias, "none", [], "")


def load_cpu_gemm() -> CpuGemm | None:
    """Build (once per source, compiler and CPU) and load the kernel; None, logged, if not."""
    lib, reason = load_library("linear_bf16w", SOURCE, DISABLE_ENV)
    if lib is None:
        logger.info("bfloat16-weight projection kernel unavailable (%s): projections use "
                    "oneDNN float32", reason)
        return None
    return CpuGemm(lib)
