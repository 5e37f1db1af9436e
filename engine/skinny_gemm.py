"""Projections of a few rows (decode at small batch) as one pass over the weight, in Triton.

At batch 1-8 a decode step's projections are matrix-vector products: each weight is read
once and the arithmetic is nothing, so the step can go no faster than the weight bytes
over the memory bandwidth. cuBLAS picks kernels for these shapes that stream the 1B
Llama's q|k|v and o weights at 1.5-2.2 TB/s of the H200's 4.2 (bench/RESULTS.md, GPU
decode). :func:`skinny_linear` tiles the output columns (``BLOCK_N`` weight rows a
program), pads the few input rows to one 16-row ``tl.dot`` tile, and for short, wide
weights splits K over more programs (float32 partial sums, then one kernel that adds
them in a fixed order: the result does not depend on the launch).

:class:`SkinnyGemm` chooses the launch per weight shape by timing the candidates (and
cuBLAS, which it keeps where it is faster) on the device, once per model build; a hot
reload hands the choices on. It is the ``skinny_gemm`` forward variant
(``engine.forward.skinny_gemm``), checked like the others against ``F.linear`` on fresh
random inputs at the model's projection shapes (:func:`skinny_bound`).

    gemm = SkinnyGemm.for_shapes([(3072, 2048), (2048, 2048)], "cuda", torch.bfloat16)
    y = gemm(x, w)            # x [rows, K], w [N, K] -> [rows, N]; > MAX_ROWS rows: F.linear
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.launch import dependent_launches, pdl_args

logger = logging.getLogger(__name__)

MAX_ROWS = 16  # rows one program's tl.dot tile holds; more rows go to F.linear
SUM_BLOCK = 1024  # columns per program of the split-K sum
SMEM_BYTES = 160 << 10  # shared memory a launch's pipelined tiles may take (H100/H200: 227 KiB)


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch of :func:`skinny_linear`; ``block_n == 0`` means ``F.linear`` (cuBLAS)."""

    block_n: int = 16  # weight rows (output columns) per program
    block_k: int = 128  # K per loop step
    split: int = 1  # programs along K (> 1: float32 partials, then split_sum_kernel)
    num_stages: int = 4  # Triton's software pipelining depth of the weight loads
    num_warps: int = 4


CUBLAS = SkinnyConfig(block_n=0)
DEFAULT = SkinnyConfig(block_n=64, block_k=256, split=2)  # untuned (the interpreter)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  cfg: SkinnyConfig = DEFAULT, gated: bool = False) -> torch.Tensor:
    """``x @ w.T + bias`` for ``x`` ``[rows <= MAX_ROWS, K]``, ``w`` ``[N, K]``: ``[rows, N]``.

    ``gated``: ``w`` is ``[gate | up]`` (``[2 I, K]``, no bias) and the result
    ``silu(gate) * up``, ``[rows, I]``, in the same pass (:func:`skinny_gated`).
    """
    rows = x.shape[0]
    if cfg.block_n == 0 or rows > MAX_ROWS or rows == 0:
        out = F.linear(x, w, bias)
        return _silu_mul(out) if gated else out
    return _launch(x, w, bias, cfg, gated)


@dataclass(frozen=True)
class NormInput:
    """What :func:`skinny_norm_linear` normalizes in its projection's pass."""

    delta: torch.Tensor | None  # [rows, K] added to the residual stream first, or None
    weight: torch.Tensor  # [K] RMSNorm weight
    h_out: torch.Tensor  # [rows, K] where h + delta goes (h itself without delta)
    eps: float


def skinny_norm_linear(h: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor,
                       eps: float, w: torch.Tensor, bias: torch.Tensor | None = None,
                       cfg: SkinnyConfig = DEFAULT, gated: bool = False,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(skinny_linear(rms_norm(h + delta) * norm_weight, w, bias), h + delta)`` with the
    residual add and the norm in the projection's own kernel (``cfg`` cuBLAS: the fused
    norm kernel, then ``F.linear``).

    NOTE: the kernel sums ``(h * norm_weight) @ w.T`` and the squares of ``h`` in one pass
    and scales by the row's ``rsqrt`` at the end, so its input is rounded before the
    scaling where the reference rounds after it: one more rounding of each input, far
    inside :func:`skinny_bound`'s four ulps of the summed terms.

    ``out``: a ``[rows, N]`` buffer (float32, say) the result goes to, each value rounded
    to ``h``'s dtype first, as ``y.float()`` would give it (the LM head into a step's
    logits: no cast kernel, no copy).
    """
    rows = h.shape[0]
    if cfg.block_n == 0 or rows > MAX_ROWS or rows == 0 or h.stride(-1) != 1:
        x, h_out = _add_rms_norm(h, delta, norm_weight, eps)
        y = skinny_linear(x, w, bias, cfg, gated)
        return (y if out is None else out.copy_(y)), h_out
    if delta is not None:
        assert delta.shape == h.shape and delta.stride(-1) == 1
    h_out = h if delta is None else torch.empty_like(h)
    return _launch(h, w, bias, cfg, gated, NormInput(delta, norm_weight, h_out, eps),
                   out), h_out


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, cfg: SkinnyConfig,
            gated: bool, norm: NormInput | None = None,
            into: torch.Tensor | None = None) -> torch.Tensor:
    from engine.fused_kernels import skinny_gemm_kernel, split_sum_kernel

    rows, k = x.shape
    n = w.shape[0] // 2 if gated else w.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert w.shape[1] == k and w.stride(-1) == 1 and not (gated and bias is not None)
    k_per_split = -(-k // (cfg.split * cfg.block_k)) * cfg.block_k
    split = -(-k // k_per_split)
    even = n % cfg.block_n == 0 and k % k_per_split == 0
    # the split-K sum rounds to its output's dtype: a buffer of another dtype gets a copy
    direct = into is not None and split == 1 and into.stride(-1) == 1
    out = into if direct else torch.empty(rows, n, dtype=x.dtype, device=x.device)
    assert out is not None
    width = (2 * n if gated else n) + (1 if norm is not None else 0)  # partials, squares
    part = out if split == 1 else torch.empty(split, rows, width, dtype=torch.float32,
                                              device=x.device)
    grid = (-(-n // cfg.block_n), split)
    # NOTE: Triton keeps num_stages - 1 tiles of x and the weight(s) in shared memory; in
    # float32 the default launch asked for 240 KiB of the H200's 227 (gated: two weight
    # tiles a stage), so the stages shrink where they would not fit
    tile = (MAX_ROWS + (2 if gated else 1) * cfg.block_n) * cfg.block_k * x.element_size()
    stages = max(1, min(cfg.num_stages, 1 + SMEM_BYTES // tile))
    delta = norm.delta if norm is not None and norm.delta is not None else x
    skinny_gemm_kernel[grid](
        x, w, bias if bias is not None else w, part, delta,
        norm.weight if norm is not None else w, norm.h_out if norm is not None else x,
        rows, n, k, k_per_split, x.stride(0), w.stride(0), part.stride(-2),
        part.stride(0) if split > 1 else 0, delta.stride(0),
        norm.h_out.stride(0) if norm is not None else 0, norm.eps if norm is not None else 0.0,
        HAS_BIAS=bias is not None and split == 1, PARTIAL=split > 1, EVEN=even,
        IEEE=x.dtype == torch.float32, GATED=gated, NORM=norm is not None,
        HAS_DELTA=norm is not None and norm.delta is not None, BLOCK_M=MAX_ROWS,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_stages=stages, num_warps=cfg.num_warps,
        **pdl_args(x.is_cuda))
    if split > 1:
        split_sum_kernel[(rows, -(-n // SUM_BLOCK))](
            part, bias if bias is not None else w, out, n, k, part.stride(0), part.stride(1),
            out.stride(0), norm.eps if norm is not None else 0.0, SPLIT=split,
            HAS_BIAS=bias is not None, GATED=gated, NORM=norm is not None, BLOCK=SUM_BLOCK,
            num_warps=4, **pdl_args(x.is_cuda))
    return out if into is None or direct else into.copy_(out)


def skinny_gated(x: torch.Tensor, w: torch.Tensor, cfg: SkinnyConfig = DEFAULT) -> torch.Tensor:
    """``silu(gate) * up`` of ``x @ w.T`` for ``w`` = ``[gate | up]`` ``[2 I, K]``: the MLP's
    first projection and its activation as one kernel (no ``[rows, 2 I]`` intermediate,
    one launch fewer a layer). Rounded as ``F.linear`` then ``engine.fused.silu_mul``."""
    return skinny_linear(x, w, None, cfg, gated=True)


def _on_triton(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    from engine.fused import silu_mul, silu_mul_reference

    return silu_mul(gate_up) if _on_triton(gate_up) else silu_mul_reference(gate_up)


def _add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from engine.fused import add_rms_norm, add_rms_norm_reference

    return (add_rms_norm if _on_triton(h) else add_rms_norm_reference)(h, delta, weight, eps)


def skinny_gated_bound(reference: torch.Tensor, x: torch.Tensor, w: torch.Tensor
                       ) -> torch.Tensor:
    """The bound :func:`skinny_gated` must meet against ``silu_mul(F.linear(x, w))``.

    The two projections' bounds (:func:`skinny_bound`, ``b_g`` and ``b_u``) carried through
    ``silu(g) * u`` (``|silu'| <= 1.1``): ``1.1 b_g (|u| + b_u) + (|silu(g)| + 1.1 b_g) b_u``,
    plus two ulps of the result (each side rounds silu and the product once).
    """
    from engine.fused import error_bound

    gate_up = F.linear(x, w)  # [rows, 2 I] in the dtype, as the reference computes it
    bound = skinny_bound(gate_up, x, w)
    gate, up = gate_up.float().chunk(2, dim=-1)
    b_g, b_u = bound.chunk(2, dim=-1)
    carried = 1.1 * b_g * (up.abs() + b_u) + (F.silu(gate).abs() + 1.1 * b_g) * b_u
    return error_bound(reference) + 1.25 * carried


def skinny_bound(reference: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The elementwise bound :func:`skinny_linear` must meet against ``F.linear``.

    ``atol + rtol * max(|ref|, l2) + sqrt(K) 2^-21 l2``, where ``l2`` is the L2 norm of
    the K products an output sums (``sqrt(x^2 @ w^2.T)``: the size of a sum of K terms of
    either sign, so outputs that cancel keep a bound). Both sides accumulate in float32,
    in different orders: the last term is eight times that order's typical effect. rtol
    is four units in the last place for the 16-bit dtypes: each side rounds its result
    once, and cuBLAS may keep its own split-K partials in the 16-bit type (torch's
    ``allow_bf16_reduced_precision_reduction``); 2^-18 in float32.
    """
    xf, wf = x.float(), w.float()
    l2 = torch.sqrt(F.linear(xf * xf, wf * wf))
    rtol = 2.0**-18 if reference.dtype == torch.float32 else 4.0 * torch.finfo(reference.dtype).eps
    order = x.shape[-1] ** 0.5 * 2.0**-21
    return 1e-6 + rtol * torch.maximum(reference.float().abs(), l2) + order * l2


def candidates(n: int, k: int) -> list[SkinnyConfig]:
    """The launches :class:`SkinnyGemm` times for a ``[n, k]`` weight."""
    out = []
    for block_n in (16, 32):
        for block_k in (128, 256):
            for split in (1, 2, 4):
                if k // split < block_k or k % (split * block_k):
                    continue
                if split > 1 and -(-n // block_n) >= 1024:  # already many programs
                    continue
                out.append(SkinnyConfig(block_n, block_k, split))
    return out


Key = tuple  # (N, K) of a weight, or (N, K, kind): kind "gated", "norm" or "norm+gated"


class SkinnyGemm:
    """:func:`skinny_linear` with a launch per weight shape ``(N, K)``; called as ``F.linear``.

    :meth:`gated` and :meth:`norm_linear` are the same projections with their neighbours
    fused in (the SiLU after gate|up; the residual add and RMSNorm before), each tuned
    on its own key (``(N, K, kind)``), cuBLAS with the separate kernels a candidate.

    On a CUDA device :meth:`tune` times every candidate and cuBLAS on random inputs of the
    shape (8 rows: a tile holds 16, so the time hardly depends on the rows), back to back
    in a CUDA graph (:func:`graph_time_ms`), and keeps the fastest; elsewhere (Triton's
    interpreter) the default launch serves every shape.
    """

    def __init__(self, device: str | torch.device, dtype: torch.dtype,
                 configs: dict[Key, SkinnyConfig] | None = None, pdl: bool = False,
                 tuned: dict[bool, dict[Key, SkinnyConfig]] | None = None) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.pdl = pdl
        # the choices with and without PDL (engine.launch): a Triton launch that overlaps
        # its neighbour's tail can beat cuBLAS where a plain one does not, so each is timed
        # as the model's graph will run it; kept side by side, so a reload that turns PDL
        # on or off tunes only what it has not seen
        self.tuned = {flag: dict(known) for flag, known in (tuned or {}).items()}
        self.configs = self.tuned.setdefault(pdl, {})
        self.configs.update(configs or {})

    @classmethod
    def for_shapes(cls, shapes: Iterable[Key], device: str | torch.device,
                   dtype: torch.dtype, share: SkinnyGemm | None = None,
                   pdl: bool = False) -> SkinnyGemm:
        """Tuned for weight ``shapes`` (launched with PDL when ``pdl``); a ``share`` on the
        same device and dtype lends its choices (a hot reload tunes nothing it already
        knows)."""
        known = None
        if share is not None and share.device == torch.device(device) and share.dtype == dtype:
            known = share.tuned
        gemm = cls(device, dtype, pdl=pdl, tuned=known)
        gemm.tune(shapes)
        return gemm

    def __call__(self, x: torch.Tensor, w: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] > MAX_ROWS or x.dim() != 2:
            return F.linear(x, w, bias)
        return skinny_linear(x, w, bias, self._config((w.shape[0], w.shape[1])))

    def gated(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``w`` = ``[gate | up]``: :func:`skinny_gated` with the
        launch tuned for it (cuBLAS then the fused SiLU kernel where that is faster)."""
        if x.shape[0] > MAX_ROWS or x.dim() != 2:
            return _silu_mul(F.linear(x, w))
        return skinny_linear(x, w, None, self._config((w.shape[0], w.shape[1], "gated")),
                             gated=True)

    def norm_linear(self, h: torch.Tensor, delta: torch.Tensor | None,
                    norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
                    bias: torch.Tensor | None = None, gated: bool = False,
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`skinny_norm_linear` with the launch tuned for it (cuBLAS: the fused norm
        kernel, then the projection, as without it); ``out`` as there."""
        if h.shape[0] > MAX_ROWS or h.dim() != 2:
            x, h_out = _add_rms_norm(h, delta, norm_weight, eps)
            y = _silu_mul(F.linear(x, w)) if gated else F.linear(x, w, bias)
            return (y if out is None else out.copy_(y)), h_out
        kind = "norm+gated" if gated else "norm"
        cfg = self._config((w.shape[0], w.shape[1], kind))
        return skinny_norm_linear(h, delta, norm_weight, eps, w, bias, cfg, gated, out)

    def _config(self, key: Key) -> SkinnyConfig:
        cfg = self.configs.get(key)
        return cfg if cfg is not None else self._tune_one(key)

    def tune(self, shapes: Iterable[Key]) -> None:
        todo = [s for s in dict.fromkeys(shapes) if s not in self.configs]
        if not todo:
            return
        t0 = time.perf_counter()
        for key in todo:
            self._tune_one(key)
        logger.info("skinny_gemm tuned %d shapes in %.1f s%s: %s", len(todo),
                    time.perf_counter() - t0, " (PDL)" if self.pdl else "",
                    {s: self.configs[s] for s in todo})

    def _tune_one(self, key: Key) -> SkinnyConfig:
        """The fastest launch for ``key``: weight ``[n, k]``, its kind if any."""
        if self.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
            self.configs[key] = DEFAULT
            return DEFAULT
        n, k = key[0], key[1]
        kind = key[2] if len(key) > 2 else ""
        gated = "gated" in kind
        g = torch.Generator(device=self.device).manual_seed(n * 7919 + k)
        x = torch.randn(8, k, device=self.device, generator=g).to(self.dtype)
        delta = torch.randn(8, k, device=self.device, generator=g).to(self.dtype)
        nw = torch.randn(k, device=self.device, generator=g).to(self.dtype)
        weights = [torch.randn(n, k, device=self.device, generator=g).to(self.dtype)
                   for _ in range(_num_copies(n * k * x.element_size(), self.device))]

        def call(w: torch.Tensor, c: SkinnyConfig) -> object:
            if "norm" in kind:
                return skinny_norm_linear(x, delta, nw, 1e-5, w, None, c, gated)
            return skinny_linear(x, w, None, c, gated)

        timed = {}
        for c in [CUBLAS, *candidates(n // 2 if gated else n, k)]:
            try:
                with dependent_launches(self.pdl):
                    timed[c] = graph_time_ms(lambda w, c=c: call(w, c), weights)
            except Exception as e:  # a launch this device cannot hold (Triton OutOfResources)
                logger.debug("skinny_gemm %s %s: %s", key, c, e)
        best = min(timed, key=timed.__getitem__)
        logger.info("skinny_gemm %s: best %s %.4f ms, cuBLAS %.4f ms", key, best,
                    timed[best], timed[CUBLAS])
        self.configs[key] = best
        return best


TUNE_CALLS = 24  # back-to-back calls per timed graph


def _num_copies(weight_bytes: int, device: torch.device) -> int:
    """Weight copies to cycle through so that a call finds its weight in HBM, not in L2
    (the whole model is 40x the H200's L2): together at least twice the L2, 2 to 8."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    return max(2, min(8, -(-2 * l2 // weight_bytes)))


def graph_time_ms(fn, weights: list[torch.Tensor], calls: int = TUNE_CALLS) -> float:  # type: ignore[no-untyped-def]
    """Device ms per call of ``fn(weight)``, captured in a CUDA graph as ``calls`` calls back
    to back over ``weights`` in turn, as the model's graph runs its projections.

    NOTE: timed one call at a time (events around it, the L2 flushed before), the gated
    gate|up kernel beat cuBLAS + the SiLU kernel, and in the model's graph it replayed
    28 us a step slower (H200, bench/RESULTS.md): launch gaps and the L2 are not those
    of a graph.
    """
    for w in weights:
        fn(w)  # compiles, picks cuBLAS's kernel
    side = torch.cuda.Stream(device=weights[0].device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(weights[0])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[1]


def time_ms(fn, iters: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Median device ms of ``fn``, the L2 cache flushed before each call (weights come from
    HBM in a real step: the whole model is 40x the L2)."""
    flush = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]
