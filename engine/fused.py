"""Fused forward-pass kernels (Triton), their torch references, and the check that binds them.

A batch-1 decode step of a 1 B-parameter Llama on an H200 spends about as long in
~20 small kernels a layer (RMSNorm, RoPE as neg/cat/mul/add, two ``index_copy`` K/V
writes, SiLU, the product with up, residual adds) as in reading the weights. Each
variant here replaces a run of those by one Triton kernel:

- ``fused_norm``: the residual add and the next RMSNorm (``h += delta; x = rms(h) * w``);
- ``fused_rope_kv``: RoPE on the q and k heads (q in place) and the K/V-cache write of
  k and v at each token's slot;
- ``fused_silu``: ``silu(gate) * up`` from the ``[gate | up]`` projection;
- ``skinny_gemm``: every projection of at most 16 rows (decode at small batch) as one
  stream over its weight (:mod:`engine.skinny_gemm`), in place of cuBLAS;
- ``split_attention``: captured decode attention over slices of each row's context (as
  many as fill the device, up to 16), then merged
  (:func:`engine.triton_attention.decode_attention_split`);
- ``fused_rope_attention``: in decode steps whose every row is its own sequence (graphs
  of their own), RoPE and the K/V-cache write inside the attention kernel
  (:func:`engine.triton_attention.decode_attention_rope`): one kernel fewer a layer; with
  ``split_attention`` too, over slices of the context as that one;
- ``prefill_attention``: captured steps of many rows (prompt chunks) attend by tiles of
  one sequence's consecutive rows, each K/V tile read once per tile of rows, not once per
  row (:func:`engine.triton_attention.prefill_attention`);
- ``pdl``: every kernel here launched with programmatic dependent launch
  (:mod:`engine.launch`), checked by running the others' checks launched so;
- ``l2_prefetch``: each layer's o weight asked into L2 beside decode attention
  (:mod:`engine.prefetch`): it changes no value, so it has no check of its own.

Which ones a model uses is :class:`polyinfer.config.ForwardConfig`, part of the
compiled config, so a hot reload swaps them without reloading weights. Every variant
is checked against its reference on fresh random inputs at the model's shapes before
it serves (:func:`check_forward`, run by the engine on every build): the fused result
must lie within :func:`error_bound` of the reference, elementwise (the projections:
within :func:`engine.skinny_gemm.skinny_bound` of ``F.linear``). The kernels round
where torch rounds (:mod:`engine.fused_kernels`), so in practice they agree to an ulp.

    x, h = add_rms_norm(h, delta, weight, eps)           # [T, hidden] each
    q = rope_kv_write(qkv, cos, sin, positions, slots, k_cache, v_cache, nq, nkv)
    act = silu_mul(gate_up)                              # [T, 2 I] -> [T, I]
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from engine.errors import UnsupportedConfigError
from engine.launch import dependent_launches, pdl_args
from engine.skinny_gemm import MAX_ROWS as SKINNY_MAX_ROWS
from engine.skinny_gemm import (
    skinny_bound,
    skinny_gated,
    skinny_gated_bound,
    skinny_linear,
    skinny_norm_linear,
)

if TYPE_CHECKING:
    from engine.checkpoint import ModelSpec

logger = logging.getLogger(__name__)

VARIANTS = ("fused_norm", "fused_rope_kv", "fused_silu", "skinny_gemm", "split_attention",
            "fused_rope_attention", "prefill_attention")  # "pdl" changes how all launch
NORM_BLOCK_MAX = 16384  # widest hidden size one program normalizes
SILU_BLOCK = 1024  # columns per program of silu_mul


# -- the fused kernels, called like their references ------------------------------------------

def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(h + delta) * weight, h + delta)`` for ``h``, ``delta`` ``[T, hidden]``;
    without ``delta``, ``(rms_norm(h) * weight, h)``."""
    from engine.fused_kernels import add_rms_norm_kernel

    rows, cols = h.shape
    block = max(16, 1 << (cols - 1).bit_length())
    if block > NORM_BLOCK_MAX or h.stride(-1) != 1:
        raise ValueError(f"add_rms_norm: hidden {cols} (stride {h.stride(-1)}) unsupported")
    x = torch.empty_like(h)
    h_out = h if delta is None else torch.empty_like(h)
    if delta is not None:
        assert delta.shape == h.shape and delta.stride(-1) == 1
    src = h if delta is None else delta
    add_rms_norm_kernel[(rows,)](
        h, src, weight, x, h_out, h.stride(0), src.stride(0), x.stride(0), h_out.stride(0),
        cols, eps, HAS_DELTA=delta is not None, BLOCK=block,
        num_warps=4 if block <= 2048 else 8, **pdl_args(h.is_cuda))
    return x, h_out


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """RoPE on ``qkv`` ``[T, nq + 2 nkv, D]``'s q and k heads at ``positions`` ``[T]``; k and
    v written to the caches ``[Hkv, num_blocks, block_size, D]`` at flat ``slots`` ``[T]``.

    Returns the rotated q, ``[T, nq, D]`` (a view of ``qkv``, rotated in place). ``cos``
    and ``sin`` are the ``[max_positions, D]`` tables of :func:`engine.model.rope_table`.
    """
    from engine.fused_kernels import rope_kv_kernel

    tokens, heads, dim = qkv.shape
    assert heads == num_heads + 2 * num_kv_heads and qkv.stride(1) == dim
    assert qkv.stride(2) == 1 and cos.stride(1) == 1 and cos.stride() == sin.stride()
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if tokens:
        rope_kv_kernel[(tokens,)](
            qkv, cos, sin, positions, slots, k_cache, v_cache,
            qkv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), NQ=num_heads, NKV=num_kv_heads,
            HEADS_PAD=_pow2(num_heads + num_kv_heads), KV_PAD=_pow2(num_kv_heads), D=dim,
            BLOCK_SIZE=k_cache.shape[2], num_warps=4, **pdl_args(qkv.is_cuda))
    return qkv[:, :num_heads]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[T, 2 I]`` = ``[gate | up]``; returns ``[T, I]``."""
    from engine.fused_kernels import silu_mul_kernel

    rows, width = gate_up.shape
    cols = width // 2
    assert gate_up.stride(-1) == 1
    out = torch.empty(rows, cols, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        silu_mul_kernel[(rows, -(-cols // SILU_BLOCK))](
            gate_up, out, gate_up.stride(0), out.stride(0), cols, BLOCK=SILU_BLOCK, num_warps=4,
            **pdl_args(gate_up.is_cuda))
    return out


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# -- the torch references (the model's unfused path) ----------------------------------------

def add_rms_norm_reference(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if delta is not None:
        h = h + delta
    return F.rms_norm(h, (h.shape[-1],), weight, eps), h


def rope_kv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    return rope_kv_rows(qkv, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1), slots,
                        k_cache, v_cache, num_heads, num_kv_heads)


def rope_kv_rows(qkv: torch.Tensor, cos_rows: torch.Tensor, sin_rows: torch.Tensor,
                 slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """:func:`rope_kv_reference` on tables already gathered at the positions (``[T, 1, D]``:
    the model gathers them once a step for all layers)."""
    nq, nkv = num_heads, num_kv_heads
    half = qkv.shape[-1] // 2
    qk = qkv[:, : nq + nkv]  # RoPE on q and k heads together: [T, nq + nkv, D]
    rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
    qk = qk * cos_rows + rotated * sin_rows
    write_kv(k_cache, v_cache, slots, qk[:, nq:], qkv[:, nq + nkv:])
    return qk[:, :nq]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v ``[T, Hkv, D]`` at flat ``slots`` ``[T]`` of one layer's caches."""
    heads, dim = k_cache.shape[0], k_cache.shape[-1]
    k_cache.view(heads, -1, dim).index_copy_(1, slots, k.transpose(0, 1))
    v_cache.view(heads, -1, dim).index_copy_(1, slots, v.transpose(0, 1))


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# -- the check before serving ---------------------------------------------------------------

@dataclass(frozen=True)
class ForwardShape:
    """The shapes a model runs its kernels at (from its :class:`engine.checkpoint.ModelSpec`)."""

    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float = 1e-5
    rope_theta: float = 10000.0
    vocab: int = 0  # the LM head's rows; 0: its projection is not checked

    @classmethod
    def of(cls, spec: ModelSpec) -> ForwardShape:
        return cls(spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads,
                   spec.head_dim, spec.rms_norm_eps, spec.rope_theta, spec.vocab_size)

    def projections(self) -> list[tuple[int, int]]:
        """Weight shapes ``(N, K)`` of the model's projections: q|k|v, o, gate|up, down, head."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        out = [(q + 2 * kv, self.hidden), (self.hidden, q), (2 * self.intermediate, self.hidden),
               (self.hidden, self.intermediate)]
        return out + ([(self.vocab, self.hidden)] if self.vocab else [])


@dataclass(frozen=True)
class KernelCheck:
    """One variant against its reference on fresh random inputs."""

    variant: str  # a ForwardConfig field
    num_rows: int  # tokens in the checked batch
    max_abs_err: float  # largest |fused - reference| over every output
    worst_ratio: float  # largest |fused - reference| / error_bound(reference); <= 1 passes

    @property
    def ok(self) -> bool:
        return self.worst_ratio <= 1.0


def error_bound(reference: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The elementwise bound a fused output must meet: ``atol + rtol * max(|reference|, scale)``.

    ``scale`` is the magnitude of the terms an output sums, where they can cancel (RoPE's
    ``x1 cos - x2 sin``): two ulps of the terms, not of their difference.

    rtol is two units in the last place for the 16-bit dtypes (bf16 2^-6, fp16 2^-9):
    each side rounds once per op, so the two may land on neighbouring values, and a
    product of two such neighbours on the next one. In float32 it is 2^-18 (~4e-6):
    the RMSNorm reduction is summed in another order and Triton's rsqrt and exp are
    approximations good to a few ulps. atol 1e-6 covers outputs that cancel to ~0.
    """
    rtol = 2.0**-18 if reference.dtype == torch.float32 else 2.0 * torch.finfo(reference.dtype).eps
    size = reference.float().abs()
    if scale is not None:
        size = torch.maximum(size, scale)
    return 1e-6 + rtol * size


Impl = Callable[..., Any]  # a kernel or its reference, called the same way
# a check's outputs: fused, reference, and per output its bound (None: error_bound(ref))
Case = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None]]


def check_forward(variants: Sequence[str], shape: ForwardShape, device: str | torch.device,
                  dtype: torch.dtype, num_rows: int = 5, seed: int | None = None,
                  impls: Mapping[str, Impl] | None = None) -> list[KernelCheck]:
    """Each of ``variants`` (names from :data:`VARIANTS`) against its torch reference.

    ``impls`` replaces a variant's fused kernel (a test plants a faulty one there).
    ``seed=None`` draws a fresh seed, so every check sees new inputs.
    """
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
    g = torch.Generator(device="cpu").manual_seed(seed)
    impls = impls or {}
    out = []
    for name in variants:
        case = _CASES[name]
        fused = impls.get(name, _FUSED[name])
        got, want, bounds = case(fused, _REFERENCE[name], shape, num_rows, g, device, dtype)
        out.append(_compare(name, num_rows, got, want, bounds))
    return out


def verify_variants(variants: Sequence[str], spec: ModelSpec, device: str | torch.device,
                    dtype: torch.dtype, impls: Mapping[str, Impl] | None = None
                    ) -> list[KernelCheck]:
    """:func:`check_forward` at ``spec``'s shapes, twice (1 row, as in batch-1 decode, and 37
    rows; the projections at 16, the most ``skinny_gemm`` takes); raises
    :class:`UnsupportedConfigError` naming any kernel outside its bound. ``impls``: the
    kernels as the model will call them (its tuned projections)."""
    shape = ForwardShape.of(spec)
    # pdl: the others, launched dependently; l2_prefetch changes no value (engine.prefetch)
    kernels = [v for v in variants if v not in ("pdl", "l2_prefetch")]
    with dependent_launches("pdl" in variants):
        checks = [c for n in (1, 37)
                  for c in check_forward(kernels, shape, device, dtype, n, impls=impls)]
    for c in checks:
        logger.info("forward variant %s, %d rows: max |err| %.3g, %.2f of its bound",
                    c.variant, c.num_rows, c.max_abs_err, c.worst_ratio)
    failed = [c for c in checks if not c.ok]
    if failed:
        c = failed[0]
        raise UnsupportedConfigError(
            f"engine.forward.{c.variant}: the fused kernel differs from the torch reference by "
            f"up to {c.max_abs_err:.3g} ({c.worst_ratio:.1f}x the bound) on random inputs at "
            f"this model's shapes; the variant is refused")
    return checks


def _compare(name: str, num_rows: int, got: Sequence[torch.Tensor],
             want: Sequence[torch.Tensor], bounds: Sequence[torch.Tensor | None]) -> KernelCheck:
    max_err, worst = 0.0, 0.0
    for a, b, bound in zip(got, want, bounds, strict=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            return KernelCheck(name, num_rows, float("inf"), float("inf"))
        err = (a.float() - b.float()).abs()
        if not bool(torch.isfinite(a.float()).all()):
            return KernelCheck(name, num_rows, float("inf"), float("inf"))
        max_err = max(max_err, float(err.max()))
        worst = max(worst, float((err / (error_bound(b) if bound is None else bound)).max()))
    return KernelCheck(name, num_rows, max_err, worst)


def _rand(g: torch.Generator, device: str | torch.device, dtype: torch.dtype, *shape: int,
          scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def _norm_case(fused: Impl, ref: Impl, s: ForwardShape, n: int, g: torch.Generator,
               device: str | torch.device, dtype: torch.dtype
               ) -> Case:
    h, delta = _rand(g, device, dtype, n, s.hidden), _rand(g, device, dtype, n, s.hidden)
    w = _rand(g, device, dtype, s.hidden, scale=0.1) + 1
    got = [*fused(h, delta, w, s.eps), fused(h, None, w, s.eps)[0]]
    want = [*ref(h, delta, w, s.eps), ref(h, None, w, s.eps)[0]]
    return got, want, [None] * 3


def _rope_case(fused: Impl, ref: Impl, s: ForwardShape, n: int, g: torch.Generator,
               device: str | torch.device, dtype: torch.dtype
               ) -> Case:
    from engine.model import rope_table_for

    block_size, num_blocks, max_positions = 16, 4 + 2 * n, 4096
    cos, sin = (t.to(device=device, dtype=dtype)
                for t in rope_table_for(s.head_dim, s.rope_theta, max_positions))
    heads = s.num_heads + 2 * s.num_kv_heads
    qkv = _rand(g, device, dtype, n, heads, s.head_dim)
    positions = torch.randint(0, max_positions, (n,), generator=g).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n].to(device)
    cache = _rand(g, device, dtype, 2, s.num_kv_heads, num_blocks, block_size, s.head_dim)
    outs: list[list[torch.Tensor]] = []
    for impl in (fused, ref):
        k, v, x = cache[0].clone(), cache[1].clone(), qkv.clone()
        q = impl(x, cos, sin, positions, slots, k, v, s.num_heads, s.num_kv_heads)
        outs.append([q, k, v])
    scales = _rope_scales(qkv, cos, sin, positions, slots, cache, s)
    return outs[0], outs[1], [error_bound(b, scale) for b, scale in zip(outs[1], scales,
                                                                         strict=True)]


def _rope_scales(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor,
                 s: ForwardShape) -> list[torch.Tensor | None]:
    """|x| |cos| + |rotated x| |sin| for q and k (the terms RoPE sums), |v| for v."""
    nq, nkv, half = s.num_heads, s.num_kv_heads, s.head_dim // 2
    x = qkv.float().abs()
    qk = x[:, : nq + nkv]
    rotated = torch.cat([qk[..., half:], qk[..., :half]], dim=-1)
    terms = (qk * cos.float().abs()[positions].unsqueeze(1)
             + rotated * sin.float().abs()[positions].unsqueeze(1))
    k, v = cache[0].float().abs(), cache[1].float().abs()
    write_kv(k, v, slots, terms[:, nq:], x[:, nq + nkv:])
    return [terms[:, :nq], k, v]


def _silu_case(fused: Impl, ref: Impl, s: ForwardShape, n: int, g: torch.Generator,
               device: str | torch.device, dtype: torch.dtype
               ) -> Case:
    gate_up = _rand(g, device, dtype, n, 2 * s.intermediate, scale=3.0)
    return [fused(gate_up)], [ref(gate_up)], [None]


def _skinny_case(fused: Impl, ref: Impl, s: ForwardShape, n: int, g: torch.Generator,
                 device: str | torch.device, dtype: torch.dtype) -> Case:
    """Every projection shape at ``min(n, 16)`` rows (the first also with a bias), weights
    at the scale of a trained model's (0.02) drawn on the device (the LM head is large)."""
    rows = min(n, SKINNY_MAX_ROWS)
    dev = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31 - 1, (),
                                                                       generator=g)))
    got: list[torch.Tensor] = []
    want: list[torch.Tensor] = []
    bounds: list[torch.Tensor | None] = []
    for i, (out_dim, in_dim) in enumerate(s.projections()):
        x = torch.randn(rows, in_dim, generator=dev, device=device).to(dtype)
        w = (torch.randn(out_dim, in_dim, generator=dev, device=device) * 0.02).to(dtype)
        bias = None
        if i == 0:
            bias = (torch.randn(out_dim, generator=dev, device=device) * 0.1).to(dtype)
        for b in (None, bias) if bias is not None else (None,):
            ref_out = ref(x, w, b)
            got.append(fused(x, w, b))
            want.append(ref_out)
            bounds.append(skinny_bound(ref_out, x, w))
        if i == 2:  # gate|up, also with its SiLU in the same kernel (SkinnyGemm.gated)
            gated = getattr(fused, "gated", skinny_gated)
            ref_act = silu_mul_reference(ref(x, w, None))
            got.append(gated(x, w))
            want.append(ref_act)
            bounds.append(skinny_gated_bound(ref_act, x, w))
        if i in (0, 2):  # with the residual add and RMSNorm before (SkinnyGemm.norm_linear)
            case = _norm_projection_case(fused, ref, x, w, bias if i == 0 else None, i == 2,
                                         dev, s.eps)
            got += case[0]
            want += case[1]
            bounds += case[2]
        del w
    return got, want, bounds


def _norm_projection_case(fused: Impl, ref: Impl, h: torch.Tensor, w: torch.Tensor,
                          bias: torch.Tensor | None, gated: bool, dev: torch.Generator,
                          eps: float) -> Case:
    """``norm_linear(h, delta, norm, w)`` against the reference add + RMSNorm + ``ref``
    (then SiLU when ``gated``), with a delta and (not gated) without: the projection within
    its bound of the reference's input, the residual exact."""
    norm_linear = getattr(fused, "norm_linear", None)
    if norm_linear is None:
        def norm_linear(h, delta, nw, eps, w, bias, gated):  # type: ignore[no-untyped-def]
            return skinny_norm_linear(h, delta, nw, eps, w, bias, gated=gated)
    nw = (torch.randn(h.shape[1], generator=dev, device=h.device) * 0.1 + 1).to(h.dtype)
    delta = torch.randn(h.shape, generator=dev, device=h.device).to(h.dtype)
    got: list[torch.Tensor] = []
    want: list[torch.Tensor] = []
    bounds: list[torch.Tensor | None] = []
    for d in (delta,) if gated else (delta, None):
        y, h_out = norm_linear(h, d, nw, eps, w, bias, gated)
        x_ref, h_ref = add_rms_norm_reference(h, d, nw, eps)
        y_ref = ref(x_ref, w, bias)
        if gated:
            y_ref = silu_mul_reference(y_ref)
        got += [y, h_out]
        want += [y_ref, h_ref]
        bounds += [skinny_gated_bound(y_ref, x_ref, w) if gated
                   else skinny_bound(y_ref, x_ref, w), None]
    return got, want, bounds


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               meta: Any, scale: float) -> torch.Tensor:
    """Softmax attention of each row over its gathered context, in float32: ``[B, H * D]``
    in ``q``'s dtype (the reference of ``split_attention``)."""
    num_kv, _, block_size, dim = k_cache.shape
    group = q.shape[1] // num_kv
    out = []
    for i, n in enumerate(meta.context_lens.tolist()):
        blocks = meta.block_tables[i, :-(-n // block_size)].long()
        k = k_cache[:, blocks].reshape(num_kv, -1, dim)[:, :n].float()
        v = v_cache[:, blocks].reshape(num_kv, -1, dim)[:, :n].float()
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [H, n, D]
        w = torch.softmax(q[i].float().unsqueeze(1) @ k.transpose(1, 2) * scale, dim=-1)
        out.append((w @ v).reshape(-1))
    return torch.stack(out).to(q.dtype)


def _split_attention_case(fused: Impl, ref: Impl, s: ForwardShape, n: int, g: torch.Generator,
                          device: str | torch.device, dtype: torch.dtype) -> Case:
    """``n`` rows (at most 8) with contexts of 1 to 600 tokens over random blocks of a
    640-position table (three 256-token slices); bound: two ulps of the largest |v|."""
    from engine.triton_attention import DecodeMetadata

    rows, block_size, width = min(n, 8), 16, 40
    num_blocks = rows * width
    k_cache = _rand(g, device, dtype, s.num_kv_heads, num_blocks, block_size, s.head_dim)
    v_cache = _rand(g, device, dtype, s.num_kv_heads, num_blocks, block_size, s.head_dim)
    q = _rand(g, device, dtype, rows, s.num_heads, s.head_dim)
    tables = torch.randperm(num_blocks, generator=g).view(rows, width).to(torch.int32)
    lens = torch.randint(1, 601, (rows,), generator=g).to(torch.int32)
    lens[0] = 600  # every slice used once
    positions = (lens - 1).long().to(device)
    meta = DecodeMetadata(positions, positions, tables.to(device), lens.to(device))
    scale = s.head_dim ** -0.5
    want = ref(q, k_cache, v_cache, meta, scale)
    size = torch.full_like(want, float(v_cache.float().abs().max()), dtype=torch.float32)
    return [fused(q, k_cache, v_cache, meta, scale)], [want], [error_bound(want, size)]


def _prefill_attention_case(fused: Impl, ref: Impl, s: ForwardShape, n: int, g: torch.Generator,
                            device: str | torch.device, dtype: torch.dtype) -> Case:
    """``n`` rows (3 to 96) as sequences of 1 to 40 consecutive rows (a decode row, prompt
    chunks, tiles holding several sequences and a sequence over several tiles), contexts up
    to 640 tokens, then 5 padding rows repeating row 0; bound: two ulps of the largest |v|."""
    from engine.triton_attention import DecodeMetadata

    block_size, width = 16, 40
    total = min(max(n, 3), 96)
    lengths, left = [1], total - 1
    while left > 0:
        lengths.append(min(left, int(torch.randint(1, 41, (1,), generator=g))))
        left -= lengths[-1]
    num_blocks = len(lengths) * width
    perm = torch.randperm(num_blocks, generator=g).view(len(lengths), width).to(torch.int32)
    tables, lens, segs = [], [], []
    for i, length in enumerate(lengths):
        start = int(torch.randint(0, width * block_size - length + 1, (1,), generator=g))
        for j in range(length):
            tables.append(perm[i])
            lens.append(start + j + 1)
            segs.append(i)
    for _ in range(5):  # padding rows, as engine.cuda_graph.fill_inputs writes them
        tables.append(tables[0])
        lens.append(lens[0])
        segs.append(segs[0])
    rows = len(lens)
    k_cache = _rand(g, device, dtype, s.num_kv_heads, num_blocks, block_size, s.head_dim)
    v_cache = _rand(g, device, dtype, s.num_kv_heads, num_blocks, block_size, s.head_dim)
    q = _rand(g, device, dtype, rows, s.num_heads, s.head_dim)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    positions = (lens_t - 1).long().to(device)
    meta = DecodeMetadata(positions, positions, torch.stack(tables).to(device),
                          lens_t.to(device),
                          segments=torch.tensor(segs, dtype=torch.int32).to(device))
    scale = s.head_dim ** -0.5
    want = ref(q, k_cache, v_cache, meta, scale)
    size = torch.full_like(want, float(v_cache.float().abs().max()), dtype=torch.float32)
    return [fused(q, k_cache, v_cache, meta, scale)], [want], [error_bound(want, size)]


def _prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: Any, scale: float) -> torch.Tensor:
    from engine.triton_attention import prefill_attention

    return prefill_attention(q, k_cache, v_cache, meta, scale)


def _rope_attention_case(fused: Impl, ref: Impl, s: ForwardShape, n: int, g: torch.Generator,
                         device: str | torch.device, dtype: torch.dtype) -> Case:
    """``min(n, 8)`` rows, each its own sequence, contexts of 1 to 600 tokens (the new token
    last, its slot in the row's table): the attention output (two ulps of the largest |v|,
    as ``split_attention``), and both caches after the write (two ulps of RoPE's terms);
    the context in one slice and in three (with ``split_attention`` too)."""
    from engine.model import rope_table_for
    from engine.triton_attention import DecodeMetadata

    rows, block_size, width = min(n, 8), 16, 40
    num_blocks = rows * width
    cos, sin = (t.to(device=device, dtype=dtype)
                for t in rope_table_for(s.head_dim, s.rope_theta, width * block_size))
    cache = _rand(g, device, dtype, 2, s.num_kv_heads, num_blocks, block_size, s.head_dim)
    qkv = _rand(g, device, dtype, rows, s.num_heads + 2 * s.num_kv_heads, s.head_dim)
    tables = torch.randperm(num_blocks, generator=g).view(rows, width).to(torch.int32)
    lens = torch.randint(1, 601, (rows,), generator=g).to(torch.int32)
    lens[0] = 600
    pos = (lens - 1).long()
    slots = tables[torch.arange(rows), pos // block_size].long() * block_size + pos % block_size
    meta = DecodeMetadata(pos.to(device), slots.to(device), tables.to(device), lens.to(device),
                          one_row_each=True)
    scale = s.head_dim ** -0.5
    outs = []
    for impl, splits in ((ref, 1), (fused, 1), (fused, 3)):
        k, v = cache[0].clone(), cache[1].clone()
        out = impl(qkv.clone(), cos, sin, k, v, meta, scale, s.num_heads, s.num_kv_heads,
                   splits)
        outs.append([out, k, v])
    want = outs[0][0]
    size = torch.full_like(want, float(cache[1].float().abs().max()), dtype=torch.float32)
    _, k_scale, v_scale = _rope_scales(qkv, cos, sin, meta.positions, meta.slot_mapping,
                                       cache, s)
    bounds: list[torch.Tensor | None] = [error_bound(want, size),
                                         error_bound(outs[0][1], k_scale),
                                         error_bound(outs[0][2], v_scale)]
    return outs[1] + outs[2], outs[0] * 2, bounds * 2


def rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any, scale: float,
                   num_heads: int, num_kv_heads: int, num_splits: int = 1) -> torch.Tensor:
    from engine.triton_attention import decode_attention_rope

    return decode_attention_rope(qkv, cos, sin, k_cache, v_cache, meta, scale, num_heads,
                                 num_kv_heads, num_splits)


def rope_attention_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any,
                             scale: float, num_heads: int, num_kv_heads: int,
                             num_splits: int = 1) -> torch.Tensor:
    """RoPE + the K/V write (:func:`rope_kv_reference`), then float32 attention (any
    ``num_splits``: the reference has no slices)."""
    q = rope_kv_reference(qkv, cos, sin, meta.positions, meta.slot_mapping, k_cache, v_cache,
                          num_heads, num_kv_heads)
    return decode_attention_reference(q, k_cache, v_cache, meta, scale)


def _split_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any,
                     scale: float) -> torch.Tensor:
    from engine.triton_attention import decode_attention_split

    return decode_attention_split(q, k_cache, v_cache, meta, scale)


_FUSED: dict[str, Impl] = {"fused_norm": add_rms_norm, "fused_rope_kv": rope_kv_write,
                           "fused_silu": silu_mul, "skinny_gemm": skinny_linear,
                           "split_attention": _split_attention,
                           "fused_rope_attention": rope_attention,
                           "prefill_attention": _prefill_attention}
_REFERENCE: dict[str, Impl] = {"fused_norm": add_rms_norm_reference,
                               "fused_rope_kv": rope_kv_reference,
                               "fused_silu": silu_mul_reference, "skinny_gemm": F.linear,
                               "split_attention": decode_attention_reference,
                               "fused_rope_attention": rope_attention_reference,
                               "prefill_attention": decode_attention_reference}
_CASES = {"fused_norm": _norm_case, "fused_rope_kv": _rope_case, "fused_silu": _silu_case,
          "skinny_gemm": _skinny_case, "split_attention": _split_attention_case,
          "fused_rope_attention": _rope_attention_case,
          "prefill_attention": _prefill_attention_case}
