"""A fused paged-attention kernel for CPU decode and verification steps (C, built at start-up).

The torch path in :mod:`engine.attention` copies every sequence's K/V blocks
into a padded tensor (``index_select``) before SDPA reads them again; at 32
decoding sequences that copy was about a third of the engine's CPU. This
kernel reads each K/V block once, straight from the paged cache through the
block table, with an online softmax (flash-decoding style), for every query
head of one KV head at a time. It serves short queries (decode, k + 1
verification rows) in float32 on the CPU; prefill chunks keep SDPA, whose
GEMMs are faster for long queries.

NOTE: plain C through ``ctypes`` rather than a torch C++ extension: gcc builds
it in well under a second (a ``load_inline`` extension compiles torch headers
for ~a minute on a small box), and ``ctypes`` releases the GIL during the
call, so the event loop runs while a step attends. The library is built once
per source/compiler/CPU into a cache directory; if there is no compiler or the
build fails, :func:`load_cpu_attention` logs why and returns None and the
engine keeps the torch path.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from engine.cbuild import load_library

logger = logging.getLogger(__name__)

DISABLE_ENV = "POLYINFER_CPU_ATTENTION"  # "0" keeps the torch path
MAX_BLOCK = 256  # tokens per KV block the kernel accepts (its score buffer)

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_BLOCK 256
#define INLINE static inline __attribute__((always_inline))

/* exp(x) for x <= 0 (scores minus their running max), branch-free so that gcc vectorizes
   a block's worth: 2^n * p(r), r = x - n ln2, |r| <= ln2 / 2; ~2 ulp, underflows to 0. */
INLINE float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_roundf(x * 1.44269504089f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = { .i = ((int32_t)n + 127) << 23 };
    return p * scale.f;
}

/* One KV head of one sequence: rows r = j * G + g (query j, head g of the group).
   Inlined with D = 64 as a constant so that an accumulator row lives in registers. */
INLINE void attend_head(const float *q, int64_t q_row_stride, const float *k_cache,
                        const float *v_cache, const int64_t *table, int64_t start, int64_t q_len,
                        int64_t hk, int64_t G, int64_t D, int64_t num_blocks, int64_t bs,
                        float scale, float *out, int64_t out_row_stride, float *acc,
                        float *m, float *l) {
    float sc[MAX_BLOCK];
    int64_t rows = q_len * G, ctx = start + q_len;
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        for (int64_t d = 0; d < D; d++) acc[r * D + d] = 0.0f;
    }
    for (int64_t b = 0; b * bs < ctx; b++) {
        const float *kb = k_cache + (hk * num_blocks + table[b]) * bs * D;
        const float *vb = v_cache + (hk * num_blocks + table[b]) * bs * D;
        for (int64_t j = 0; j < q_len; j++) {
            int64_t n = start + j + 1 - b * bs;  /* causal: keys 0 .. start + j */
            if (n <= 0) continue;
            if (n > bs) n = bs;
            for (int64_t g = 0; g < G; g++) {
                int64_t r = j * G + g;
                const float *qr = q + j * q_row_stride + (hk * G + g) * D;
                float bmax = -INFINITY;
                for (int64_t i = 0; i < n; i++) {
                    const float *kr = kb + i * D;
                    float s = 0.0f;
                    for (int64_t d = 0; d < D; d++) s += qr[d] * kr[d];
                    s *= scale;
                    sc[i] = s;
                    bmax = s > bmax ? s : bmax;
                }
                float mnew = m[r] > bmax ? m[r] : bmax;
                float alpha = exp_nonpos(m[r] - mnew);  /* m = -inf: clamped, ~1e-38 x 0 */
                float sum = 0.0f;
                for (int64_t i = 0; i < n; i++) {
                    sc[i] = exp_nonpos(sc[i] - mnew);
                    sum += sc[i];
                }
                l[r] = l[r] * alpha + sum;
                m[r] = mnew;
                float *a = acc + r * D;
                for (int64_t d = 0; d < D; d++) a[d] *= alpha;
                for (int64_t i = 0; i < n; i++) {
                    const float *vr = vb + i * D;
                    float p = sc[i];
                    for (int64_t d = 0; d < D; d++) a[d] += p * vr[d];
                }
            }
        }
    }
    for (int64_t j = 0; j < q_len; j++)
        for (int64_t g = 0; g < G; g++) {
            int64_t r = j * G + g;
            float inv = 1.0f / l[r];
            float *o = out + j * out_row_stride + (hk * G + g) * D;
            for (int64_t d = 0; d < D; d++) o[d] = acc[r * D + d] * inv;
        }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp_nonpos on 8 lanes, the same polynomial. */
INLINE __m256 exp_nonpos8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                   _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Four dot products of q (8 registers, D = 64) with keys k0..k3: one 4-way reduction. */
INLINE __m128 dot4(const __m256 *qv, const float *k0, const float *k1, const float *k2,
                   const float *k3) {
    __m256 a0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k0));
    __m256 a1 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k1));
    __m256 a2 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k2));
    __m256 a3 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k3));
    for (int c = 1; c < 8; c++) {
        a0 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k0 + 8 * c), a0);
        a1 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k1 + 8 * c), a1);
        a2 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k2 + 8 * c), a2);
        a3 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k3 + 8 * c), a3);
    }
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* One query row (D = 64) against n <= bs keys of one block: online-softmax update of
   (m, l, acc). Every row runs exactly this, whatever q_len and G are, so a row's
   result does not depend on how many rows share the step (decode == verification). */
INLINE void row_block_d64(const float *qr, const float *kb, const float *vb, int64_t n,
                          float scale, float *sc, float *acc, float *m, float *l) {
    __m256 qv[8];
    __m256 sv = _mm256_set1_ps(scale);
    for (int c = 0; c < 8; c++) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(qr + 8 * c), sv);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        _mm_storeu_ps(sc + i, dot4(qv, kb + i * 64, kb + (i + 1) * 64, kb + (i + 2) * 64,
                                   kb + (i + 3) * 64));
    for (; i < n; i++) {  /* a tail of 1-3 keys: the same 4-way reduction, key repeated */
        const float *kr = kb + i * 64;
        sc[i] = _mm_cvtss_f32(dot4(qv, kr, kr, kr, kr));
    }
    float bmax = -INFINITY;
    for (i = 0; i < n; i++) bmax = sc[i] > bmax ? sc[i] : bmax;
    float mnew = *m > bmax ? *m : bmax;
    __m256 mv = _mm256_set1_ps(mnew), sum8 = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 e = exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(sc + i), mv));
        _mm256_storeu_ps(sc + i, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = 0.0f;
    if (i < n) {  /* the last partial vector, padded with -inf (exp -> 0) */
        float pad[8];
        for (int t = 0; t < 8; t++) pad[t] = i + t < n ? sc[i + t] : -INFINITY;
        __m256 e = exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(pad), mv));
        _mm256_storeu_ps(pad, e);
        for (int t = 0; i + t < n; t++) sc[i + t] = pad[t];
        sum8 = _mm256_add_ps(sum8, e);
    }
    {
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum8), _mm256_extractf128_ps(sum8, 1));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        sum = _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
    }
    /* m = -inf on a row's first block: clamped, ~1e-38 x (l = 0, acc = 0) */
    float alpha = _mm256_cvtss_f32(exp_nonpos8(_mm256_set1_ps(*m - mnew)));
    *l = *l * alpha + sum;
    *m = mnew;
    __m256 av[8];
    __m256 alv = _mm256_set1_ps(alpha);
    for (int c = 0; c < 8; c++) av[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * c), alv);
    for (i = 0; i < n; i++) {
        __m256 p = _mm256_set1_ps(sc[i]);
        const float *vr = vb + i * 64;
        for (int c = 0; c < 8; c++) av[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * c), av[c]);
    }
    for (int c = 0; c < 8; c++) _mm256_storeu_ps(acc + 8 * c, av[c]);
}

static void attend_head_d64(const float *q, int64_t q_row_stride, const float *k_cache,
                            const float *v_cache, const int64_t *table, int64_t start,
                            int64_t q_len, int64_t hk, int64_t G, int64_t num_blocks, int64_t bs,
                            float scale, float *out, int64_t out_row_stride, float *acc,
                            float *m, float *l) {
    float sc[MAX_BLOCK];
    int64_t rows = q_len * G, ctx = start + q_len;
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        for (int64_t d = 0; d < 64; d++) acc[r * 64 + d] = 0.0f;
    }
    for (int64_t b = 0; b * bs < ctx; b++) {
        const float *kb = k_cache + (hk * num_blocks + table[b]) * bs * 64;
        const float *vb = v_cache + (hk * num_blocks + table[b]) * bs * 64;
        for (int64_t j = 0; j < q_len; j++) {
            int64_t n = start + j + 1 - b * bs;  /* causal: keys 0 .. start + j */
            if (n <= 0) continue;
            if (n > bs) n = bs;
            for (int64_t g = 0; g < G; g++) {
                int64_t r = j * G + g;
                row_block_d64(q + j * q_row_stride + (hk * G + g) * 64, kb, vb, n, scale, sc,
                              acc + r * 64, m + r, l + r);
            }
        }
    }
    for (int64_t j = 0; j < q_len; j++)
        for (int64_t g = 0; g < G; g++) {
            int64_t r = j * G + g;
            float inv = 1.0f / l[r];
            float *o = out + j * out_row_stride + (hk * G + g) * 64;
            for (int64_t d = 0; d < 64; d++) o[d] = acc[r * 64 + d] * inv;
        }
}
#else
static void attend_head_d64(const float *q, int64_t q_row_stride, const float *k_cache,
                            const float *v_cache, const int64_t *table, int64_t start,
                            int64_t q_len, int64_t hk, int64_t G, int64_t num_blocks, int64_t bs,
                            float scale, float *out, int64_t out_row_stride, float *acc,
                            float *m, float *l) {
    attend_head(q, q_row_stride, k_cache, v_cache, table, start, q_len, hk, G, 64, num_blocks,
                bs, scale, out, out_row_stride, acc, m, l);
}
#endif

static void attend_head_any(const float *q, int64_t q_row_stride, const float *k_cache,
                            const float *v_cache, const int64_t *table, int64_t start,
                            int64_t q_len, int64_t hk, int64_t G, int64_t D, int64_t num_blocks,
                            int64_t bs, float scale, float *out, int64_t out_row_stride,
                            float *acc, float *m, float *l) {
    attend_head(q, q_row_stride, k_cache, v_cache, table, start, q_len, hk, G, D, num_blocks,
                bs, scale, out, out_row_stride, acc, m, l);
}

/* q rows [T, H, D] with row stride q_row_stride; caches [Hkv, num_blocks, bs, D];
   tables [S, table_stride]; out [T, H * D] contiguous. Returns 0, -1 if a size is out of
   range, -2 if out of memory (then out is untouched). */
int paged_attention_f32(const float *q, int64_t q_row_stride, const float *k_cache,
                        const float *v_cache, const int64_t *tables, int64_t table_stride,
                        const int64_t *starts, const int64_t *q_lens, int64_t num_seqs,
                        int64_t num_heads, int64_t num_kv_heads, int64_t D, int64_t num_blocks,
                        int64_t bs, float scale, float *out) {
    int64_t G = num_heads / num_kv_heads;
    if (bs > MAX_BLOCK || G * num_kv_heads != num_heads) return -1;
    int64_t max_rows = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        if (q_lens[s] < 1) return -1;
        if (q_lens[s] * G > max_rows) max_rows = q_lens[s] * G;
    }
    float *work = malloc(sizeof(float) * max_rows * (D + 2));
    if (work == NULL) return -2;
    float *m = work + max_rows * D, *l = m + max_rows;
    int64_t row = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        for (int64_t hk = 0; hk < num_kv_heads; hk++) {
            const float *qs = q + row * q_row_stride;
            float *os = out + row * num_heads * D;
            if (D == 64)
                attend_head_d64(qs, q_row_stride, k_cache, v_cache, tables + s * table_stride,
                                starts[s], q_lens[s], hk, G, num_blocks, bs, scale, os,
                                num_heads * D, work, m, l);
            else
                attend_head_any(qs, q_row_stride, k_cache, v_cache, tables + s * table_stride,
                                starts[s], q_lens[s], hk, G, D, num_blocks, bs, scale, os,
                                num_heads * D, work, m, l);
        }
        row += q_lens[s];
    }
    free(work);
    return 0;
}
"""


class CpuPagedAttention:
    """The loaded kernel: ``attend(q, k_cache, v_cache, ...)`` for float32 CPU tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.paged_attention_f32
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64,
                       ctypes.c_float, ptr]
        fn.restype = ctypes.c_int
        self._fn = fn

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, starts: torch.Tensor, q_lens: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q ``[T, H, D]`` (rows of the sequences in order); caches ``[Hkv, NB, BS, D]``;
        block_tables ``[S, nb]``, starts / q_lens ``[S]`` int64. Returns ``[T, H * D]``."""
        rows, num_heads, head_dim = q.shape
        num_kv, num_blocks, block_size, _ = k_cache.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.dtype == torch.float32
        out = torch.empty(rows, num_heads * head_dim, dtype=torch.float32)
        rc = self._fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                      block_tables.data_ptr(), block_tables.stride(0), starts.data_ptr(),
                      q_lens.data_ptr(), starts.numel(), num_heads, num_kv, head_dim,
                      num_blocks, block_size, scale, out.data_ptr())
        if rc != 0:
            raise ValueError(f"paged attention kernel refused shapes q={tuple(q.shape)} "
                             f"cache={tuple(k_cache.shape)}")
        return out


def cpu_attention_for(device: str | torch.device, dtype: torch.dtype,
                      block_size: int) -> CpuPagedAttention | None:
    """The kernel where it applies (float32 on the CPU) and builds; None otherwise."""
    if torch.device(device).type != "cpu" or dtype != torch.float32 or block_size > MAX_BLOCK:
        return None
    return load_cpu_attention()


def load_cpu_attention() -> CpuPagedAttention | None:
    """Build (once per source, compiler and CPU) and load the kernel; None, logged, if not.

    A built library is reused from the cache directory, so later calls cost a
    ``dlopen`` of an already-loaded file.
    """
    lib, reason = load_library("paged_attention", SOURCE, DISABLE_ENV)
    if lib is None:
        logger.warning("CPU paged-attention kernel unavailable (%s): decode attention uses the "
                       "torch path", reason)
        return None
    return CpuPagedAttention(lib)
