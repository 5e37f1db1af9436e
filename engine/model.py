"""A Llama-family decoder (Llama, Qwen2) in plain torch, over a flat batch with a paged KV cache.

RMSNorm, RoPE (unscaled, any ``rope_theta``), grouped-query attention, SwiGLU,
tied or untied embeddings, optional q/k/v bias (Qwen2). Projections are fused
(q|k|v and gate|up) at load time so one step runs few, large kernels.

The same class serves the target model and (through specdec) a draft model:
build it from a checkpoint's in-memory weights, give it a :class:`KVCache`
from :meth:`LlamaModel.new_kv_cache`, and call :meth:`LlamaModel.forward` with
:class:`~engine.attention.AttnMetadata` built from the sequences' slices.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine import fused
from engine.attention import AttnMetadata, paged_attention
from engine.checkpoint import ModelSpec
from engine.cpu_gemm import CpuGemm, CpuProjection, load_cpu_gemm, project
from engine.errors import CheckpointError, UnsupportedConfigError
from engine.kv_cache import KVCache
from engine.launch import dependent_launches, pdl_disabled_reason
from engine.prefetch import L2Prefetcher, prefetch_disabled_reason
from engine.skinny_gemm import SkinnyGemm
from engine.triton_attention import (
    DecodeMetadata,
    decode_attention,
    decode_attention_rope,
    decode_attention_split,
    is_available,
    prefill_attention,
)

if TYPE_CHECKING:
    from polyinfer.config import ForwardConfig

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PACK_ENV = "POLYINFER_CPU_PACKED_LINEAR"  # "0" keeps F.linear on plain weights
PREFETCH_MAX_ROWS = 16  # engine.forward.l2_prefetch acts on steps of at most this many rows
# engine.forward.prefill_attention takes captured steps of at least this many rows (below,
# decode rows dominate and each row is its own tile); untuned
PREFILL_MIN_ROWS = 128

Linear = Callable[..., torch.Tensor]  # (x, weight, bias=None) -> x @ weight.T + bias
Weight = torch.Tensor | CpuProjection  # a projection's weight as self.linear takes it


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Weight  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    o: Weight  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Weight  # [2 * intermediate, hidden]
    down: Weight  # [hidden, intermediate]


def _get(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return weights[name]
    except KeyError as e:
        raise CheckpointError(f"checkpoint has no tensor {name!r}") from e


def _layer(weights: dict[str, torch.Tensor], i: int, spec: ModelSpec,
           cast: dict[str, object]) -> LayerWeights:
    p = f"model.layers.{i}."

    def w(name: str) -> torch.Tensor:
        return _get(weights, p + name).to(**cast)  # type: ignore[call-overload]

    bias = None
    if spec.qkv_bias:
        bias = torch.cat([w(f"self_attn.{x}_proj.bias") for x in "qkv"]).contiguous()
    return LayerWeights(
        input_norm=w("input_layernorm.weight"),
        qkv=torch.cat([w(f"self_attn.{x}_proj.weight") for x in "qkv"]).contiguous(),
        qkv_bias=bias,
        o=w("self_attn.o_proj.weight"),
        post_norm=w("post_attention_layernorm.weight"),
        gate_up=torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]).contiguous(),
        down=w("mlp.down_proj.weight"),
    )


def rope_table(spec: ModelSpec, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[max_positions, head_dim]`` in float32, computed as transformers does."""
    return rope_table_for(spec.head_dim, spec.rope_theta, max_positions)


def rope_table_for(dim: int, theta: float,
                   max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _dense_half(h: torch.Tensor, delta: torch.Tensor, norm: torch.Tensor, gate_up: Weight,
                down: Weight, eps: float,
                linear: Linear = F.linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, SwiGLU(RMSNorm(h + delta))): the dense half of a layer, the part worth
    compiling; its residual add is the next layer's (or the final one)."""
    h = h + delta
    x = F.rms_norm(h, (h.shape[-1],), norm, eps)
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return h, linear(F.silu(gate) * up, down)


def forward_disabled_reason(variants: tuple[str, ...], device: str,
                            execution: str) -> str | None:
    """Why fused kernels ``variants`` cannot run here, or None when they can."""
    if not variants:
        return None
    if execution == "compiled":
        return "execution='compiled' fuses its own kernels"
    if not is_available():
        return "they need triton (pip install triton)"
    if not str(device).startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"they need a CUDA device (or TRITON_INTERPRET=1, Triton's slow CPU "
                f"interpreter); this engine runs on {device!r}")
    return None


def packing_disabled_reason(device: str, dtype: torch.dtype, execution: str) -> str | None:
    """Why this model keeps plain F.linear weights, or None when it packs them for oneDNN.

    On the CPU in float32, weights reordered once into oneDNN's blocked layout make every
    projection 15-35% faster than F.linear at 1-512 rows on the 2-core box, and steps of
    a few rows go through :mod:`engine.cpu_gemm`'s kernel on the exact bfloat16 copy
    (``bench/engine_step.py``).
    """
    if not str(device).startswith("cpu") or dtype != torch.float32:
        return "packed weights are for float32 on the CPU"
    if execution != "eager":
        return f"execution={execution!r} traces its own kernels"
    if os.environ.get(PACK_ENV, "1") == "0":
        return f"{PACK_ENV}=0"
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "this torch build has no oneDNN linear"
    return None


def _pack_layer(layer: LayerWeights, kernel: CpuGemm | None) -> LayerWeights:
    def pack(w: Weight) -> CpuProjection:
        return CpuProjection.pack(w, kernel)  # type: ignore[arg-type]

    return replace(layer, qkv=pack(layer.qkv), o=pack(layer.o), gate_up=pack(layer.gate_up),
                   down=pack(layer.down))


class LlamaModel:
    """Inference-only forward pass; weights cast from a (kept) on-disk copy to ``dtype``.

    ``execution="compiled"`` runs the dense half of every layer through
    ``torch.compile`` (dynamic shapes, so one graph serves every batch size;
    the first steps pay the compile). ``attention="naive"`` replaces SDPA by an
    explicit matmul-softmax-matmul (a reference, and a fallback for dtypes
    SDPA handles badly). ``variants``: which fused kernels of :mod:`engine.fused` replace
    their torch ops (every step, every path). ``share``: a model built earlier from the same weights
    (a hot reload); its device weights are reused when dtype, device, layer count
    and packing agree, so a reload neither casts nor packs again.
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], dtype: str = "float32",
                 device: str = "cpu", max_positions: int | None = None,
                 execution: str = "eager", attention: str = "sdpa",
                 pack_weights: bool = True, variants: ForwardConfig | None = None,
                 share: LlamaModel | None = None) -> None:
        if execution == "cuda_graph" or attention == "triton":
            if not str(device).startswith("cuda"):
                raise UnsupportedConfigError(f"execution={execution!r} attention={attention!r} "
                                             f"needs a CUDA device; this engine runs on {device!r}")
        if attention == "triton":
            raise UnsupportedConfigError("attention='triton' is not implemented for every step "
                                         "shape; execution='cuda_graph' uses it for decode")
        enabled = variants.enabled if variants is not None else ()
        reason = forward_disabled_reason(enabled, device, execution)
        if reason is not None:
            raise UnsupportedConfigError(f"engine.forward {list(enabled)}: {reason}")
        if "pdl" in enabled and (why := pdl_disabled_reason(device)) is not None:
            raise UnsupportedConfigError(f"engine.forward.pdl: {why}")
        if "l2_prefetch" in enabled and (why := prefetch_disabled_reason(device)) is not None:
            raise UnsupportedConfigError(f"engine.forward.l2_prefetch: {why}")
        self.execution = execution
        self.spec = spec
        self.naive_attention = attention == "naive"
        self.variants = enabled
        self.prefetch = L2Prefetcher(device) if "l2_prefetch" in enabled else None
        self._dense = _dense_half
        if execution == "compiled":
            self._dense = torch.compile(_dense_half, dynamic=True)
        self._add_norm = (fused.add_rms_norm if "fused_norm" in enabled
                          else fused.add_rms_norm_reference)
        self._silu_mul = (fused.silu_mul if "fused_silu" in enabled
                          else fused.silu_mul_reference)
        self.dtype = DTYPES[dtype]
        self.device = device
        self.num_layers = sum(1 for k in weights if k.endswith(".input_layernorm.weight"))
        cast: dict[str, object] = {"dtype": self.dtype, "device": device}
        reason = (packing_disabled_reason(device, self.dtype, execution) if pack_weights
                  else "pack_weights=False")
        if reason is None and "skinny_gemm" in enabled:
            reason = "skinny_gemm streams plain weights"
        self.weights_key = (self.dtype, str(device), self.num_layers, reason is None)
        self.embed: torch.Tensor
        self.layers: list[LayerWeights]
        self.norm: torch.Tensor
        self.lm_head: Weight
        self.linear: Linear
        self.packed: bool
        if share is not None and share.weights_key == self.weights_key:  # a hot reload
            self.embed, self.layers, self.norm = share.embed, share.layers, share.norm
            self.lm_head, self.linear, self.packed = share.lm_head, share.linear, share.packed
        else:
            self._cast_weights(weights, cast, reason)
        self.skinny: SkinnyGemm | None = None
        self._project: Linear = self.linear  # the projections' product (self.linear or skinny)
        # the last tuned launches, handed on by every reload (one without the variant too)
        self.skinny_tuned: SkinnyGemm | None = share.skinny_tuned if share else None
        if "skinny_gemm" in enabled:
            self.skinny = SkinnyGemm.for_shapes(self._projection_shapes(), device, self.dtype,
                                                share=self.skinny_tuned,
                                                pdl="pdl" in self.variants)
            self._project = self.skinny_tuned = self.skinny
        cos, sin = rope_table(spec, max(max_positions or 0, spec.max_position_embeddings))
        self.cos = cos.to(**cast)  # type: ignore[call-overload]
        self.sin = sin.to(**cast)  # type: ignore[call-overload]
        self.scale = spec.head_dim ** -0.5

    def _cast_weights(self, weights: dict[str, torch.Tensor], cast: dict[str, object],
                      reason: str | None) -> None:
        """The device copies of the weights; projections packed for oneDNN unless ``reason``."""
        spec = self.spec
        self.embed = _get(weights, "model.embed_tokens.weight").to(**cast)  # type: ignore
        self.layers = [_layer(weights, i, spec, cast) for i in range(self.num_layers)]
        self.norm = _get(weights, "model.norm.weight").to(**cast)  # type: ignore
        head = weights.get("lm_head.weight") if not spec.tie_word_embeddings else None
        self.lm_head = head.to(**cast) if head is not None else self.embed  # type: ignore
        self.linear = F.linear
        self.packed = False
        if reason is None:
            try:
                kernel = load_cpu_gemm()
                self.layers = [_pack_layer(layer, kernel) for layer in self.layers]
                self.lm_head = CpuProjection.pack(self.lm_head, kernel)  # type: ignore[arg-type]
                self.linear, self.packed = project, True
            except RuntimeError as e:  # an unusual CPU or build: plain weights still work
                reason = f"oneDNN could not pack the weights: {e}"
                self.layers = [_layer(weights, i, spec, cast) for i in range(self.num_layers)]
                self.lm_head = head.to(**cast) if head is not None else self.embed  # type: ignore
        if reason is not None:
            logger.debug("projections use F.linear: %s", reason)

    def _projection_shapes(self) -> list[tuple]:
        """``(N, K)`` of every projection weight (one layer's four, the LM head), and the
        ``(N, K, kind)`` of those that run with their neighbours fused (_norm_project)."""
        layer = self.layers[0]
        weights = [layer.qkv, layer.o, layer.gate_up, layer.down, self.lm_head]
        shapes: list[tuple] = [(int(w.shape[0]), int(w.shape[1]))  # type: ignore[union-attr]
                               for w in weights]
        silu = "fused_silu" in self.variants
        if "fused_norm" in self.variants:  # see _norm_project and _forward's LM head
            shapes += [(*shapes[0], "norm"), (*shapes[2], "norm+gated" if silu else "norm"),
                       (*shapes[4], "norm")]
        elif silu:
            shapes.append((*shapes[2], "gated"))
        return shapes

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        return KVCache(self.num_layers, num_blocks, block_size, self.spec.num_kv_heads,
                       self.spec.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttnMetadata | DecodeMetadata, kv: KVCache,
                logit_rows: torch.Tensor | None = None, hidden_only: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids ``[T]`` -> float32 logits ``[N, vocab]`` for rows ``logit_rows`` (all if None).

        ``hidden_only``: the last layer's hidden states ``[N, hidden]`` instead, for a caller
        that computes :meth:`logits` only for the rows it turns out to need (verification).
        ``out``: a float32 ``[T, vocab]`` buffer the logits of every row are written to (a
        captured step's output), directly by the LM head where its kernel can.
        """
        with dependent_launches("pdl" in self.variants):
            return self._forward(input_ids, meta, kv, logit_rows, hidden_only, out)

    def _forward(self, input_ids: torch.Tensor, meta: AttnMetadata | DecodeMetadata,
                 kv: KVCache, logit_rows: torch.Tensor | None,
                 hidden_only: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)  # [T, hidden]
        rope = None  # cos, sin [T, 1, D] at the positions, for the unfused RoPE
        if "fused_rope_kv" not in self.variants:
            rope = self.cos[meta.positions].unsqueeze(1), self.sin[meta.positions].unsqueeze(1)
        delta: torch.Tensor | None = None  # the last block's output, not yet added to h
        # the prefetch pays where the step is memory-bound (a few rows: replay -9 to -12 us at
        # batch 1 and 8 on the H200); at 64 rows it cost 0.1-0.4% of the replay
        pf = self.prefetch if input_ids.shape[0] <= PREFETCH_MAX_ROWS else None
        for i, layer in enumerate(self.layers):
            qkv, h = self._norm_project(h, delta, layer.input_norm, layer.qkv, layer.qkv_bias)
            if pf is not None:  # o's weight into L2 while attention reads only the cache
                pf.fetch(layer.o)  # type: ignore[arg-type]
            delta = self._attention(qkv, layer, i, meta, kv, rope)
            h, delta = self._dense_block(h, delta, layer)
        if pf is not None:
            pf.join()
        assert delta is not None
        if (logit_rows is None and not hidden_only and self.skinny is not None
                and "fused_norm" in self.variants):
            # the last residual add and the final norm in the LM head's kernel
            logits, _ = self.skinny.norm_linear(h, delta, self.norm, self.spec.rms_norm_eps,
                                                self.lm_head, out=out)  # type: ignore[arg-type]
            return logits.float()
        h = h + delta
        if logit_rows is not None:
            h = h.index_select(0, logit_rows)
        if hidden_only:
            return h
        logits = self.logits(h)
        return logits if out is None else out.copy_(logits)

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[N, hidden]`` -> float32 logits ``[N, vocab]``."""
        with dependent_launches("pdl" in self.variants):
            h = F.rms_norm(h, (h.shape[-1],), self.norm, self.spec.rms_norm_eps)
            return self._project(h, self.lm_head).float()

    def _dense_block(self, h: torch.Tensor, delta: torch.Tensor,
                     layer: LayerWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, the MLP's output on it): the MLP's residual add is left to the caller."""
        eps = self.spec.rms_norm_eps
        if not self.variants:  # the reference ops, compiled as one region when asked
            return self._dense(h, delta, layer.post_norm, layer.gate_up, layer.down, eps,
                               self.linear)
        act, h = self._norm_project(h, delta, layer.post_norm, layer.gate_up, mlp=True)
        return h, self._project(act, layer.down)

    def _norm_project(self, h: torch.Tensor, delta: torch.Tensor | None, norm: torch.Tensor,
                      weight: Weight, bias: torch.Tensor | None = None, mlp: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the projection of ``rms_norm(h + delta) * norm``, ``h + delta``); ``mlp``: of
        gate|up, then ``silu(gate) * up`` ``[T, intermediate]``.

        With ``skinny_gemm``, the neighbours go into the projection's kernel where tuning
        finds that faster: the add and norm (``fused_norm``), the SiLU (``fused_silu``).
        """
        eps = self.spec.rms_norm_eps
        gated = mlp and self.skinny is not None and "fused_silu" in self.variants
        if self.skinny is not None and "fused_norm" in self.variants:
            y, h = self.skinny.norm_linear(h, delta, norm, eps, weight, bias,  # type: ignore[arg-type]
                                           gated)
        else:
            x, h = self._add_norm(h, delta, norm, eps)
            y = (self.skinny.gated(x, weight) if gated  # type: ignore[union-attr, arg-type]
                 else self._project(x, weight, bias))
        return (self._silu_mul(y) if mlp and not gated else y), h

    def _attention(self, qkv: torch.Tensor, layer: LayerWeights, i: int,
                   meta: AttnMetadata | DecodeMetadata, kv: KVCache,
                   rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The attention block's output from its q|k|v projection ``[T, (nq + 2 nkv) D]``."""
        spec = self.spec
        nq, nkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        qkv = qkv.view(-1, nq + 2 * nkv, d)
        if (isinstance(meta, DecodeMetadata) and meta.one_row_each
                and "fused_rope_attention" in self.variants):  # RoPE + K/V write inside
            out = decode_attention_rope(qkv, self.cos, self.sin, kv.k[i], kv.v[i], meta,
                                        self.scale, nq, nkv,
                                        0 if "split_attention" in self.variants else 1)
            return self._project(out, layer.o)
        if rope is None:  # q rotated in place in qkv; k, v written to the cache: [T, nq, D]
            q = fused.rope_kv_write(qkv, self.cos, self.sin, meta.positions, meta.slot_mapping,
                                    kv.k[i], kv.v[i], nq, nkv)
        else:
            q = fused.rope_kv_rows(qkv, *rope, meta.slot_mapping, kv.k[i], kv.v[i], nq, nkv)
        if isinstance(meta, DecodeMetadata):  # a captured decode step (engine.cuda_graph)
            if (meta.segments is not None and q.shape[0] >= PREFILL_MIN_ROWS
                    and "prefill_attention" in self.variants):
                out = prefill_attention(q, kv.k[i], kv.v[i], meta, self.scale)
                return self._project(out, layer.o)
            attend = (decode_attention_split if "split_attention" in self.variants
                      else decode_attention)
            out = attend(q, kv.k[i], kv.v[i], meta, self.scale)
        else:
            out = paged_attention(q, kv.k[i], kv.v[i], meta, self.scale, self.naive_attention)
        return self._project(out, layer.o)
