"""One engine decode step, torch attention path vs the fused CPU kernel, side by side.

Builds the bundled tiny-target model, fills a paged KV cache with scattered
blocks, and times (CPU time of this process, best of ``--repeats``) one decode
step at each batch size with ``--context`` cached tokens per sequence, and the
attention alone over all layers:

    python bench/engine_step.py --batch 8 32 --context 300

Prints milliseconds per step and the ratio torch path / kernel (higher = the
kernel is faster), then a whole step (kernel attention) with plain F.linear
weights vs the engine's CPU float32 default (weights packed for oneDNN, and
engine.cpu_gemm's bfloat16-weight kernel for steps of up to 16 rows), and the
projections alone. One intra-op thread, as the engine's lanes use.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.attention import SeqSlice, build_metadata, paged_attention  # noqa: E402
from engine.checkpoint import ModelSpec, load_weights, read_spec  # noqa: E402
from engine.cpu_attention import CpuPagedAttention, load_cpu_attention  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.model import LlamaModel  # noqa: E402
from polyinfer.config import TINY_TARGET  # noqa: E402

BLOCK = 16


def best_cpu_ms(fn: Callable[[], object], iters: int, repeats: int) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(iters):
            fn()
        best = min(best, (time.process_time() - t0) / iters)
    return best * 1e3


def step_fn(model: LlamaModel, kv: KVCache, slices: list[SeqSlice], ids: torch.Tensor,
            q: torch.Tensor, kernel: CpuPagedAttention | None) -> Callable[[], object]:
    """One whole decode step: metadata, then the forward over every layer."""
    group = model.spec.num_heads // model.spec.num_kv_heads
    return lambda: model.forward(ids, build_metadata(slices, BLOCK, group, 8, kernel=kernel), kv)


def attention_fn(model: LlamaModel, kv: KVCache, slices: list[SeqSlice], ids: torch.Tensor,
                 q: torch.Tensor, kernel: CpuPagedAttention | None) -> Callable[[], object]:
    """Paged attention alone, once per layer, over fixed metadata."""
    group = model.spec.num_heads // model.spec.num_kv_heads
    meta = build_metadata(slices, BLOCK, group, 8, kernel=kernel)
    return lambda: [paged_attention(q, kv.k[i], kv.v[i], meta, model.scale)
                    for i in range(model.num_layers)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    kernel = load_cpu_attention()
    if kernel is None:
        raise SystemExit("the CPU attention kernel did not build (see the log)")
    spec = read_spec(TINY_TARGET)
    model = LlamaModel(spec, load_weights(TINY_TARGET, spec.num_layers))
    per_seq = -(-(args.context + 1) // BLOCK)
    kv = model.new_kv_cache(max(args.batch) * per_seq + 1, BLOCK)
    gen = torch.Generator().manual_seed(0)
    kv.k.normal_(generator=gen)
    kv.v.normal_(generator=gen)
    perm = torch.randperm(kv.num_blocks, generator=gen).tolist()
    print("| batch | step torch ms | step kernel ms | ratio | attention torch ms "
          "| attention kernel ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    for b in args.batch:
        slices = decode_slices(b, args.context, perm, per_seq)
        ids = torch.randint(0, spec.vocab_size, (b,), generator=gen)
        q = torch.randn(b, spec.num_heads, spec.head_dim, generator=gen)
        print_row(b, args, [(make(model, kv, slices, ids, q, None),
                             make(model, kv, slices, ids, q, kernel))
                            for make in (step_fn, attention_fn)])
    linear_table(args, spec, kv, perm, per_seq, kernel, gen)


def linear_table(args: argparse.Namespace, spec: ModelSpec, kv: KVCache, perm: list[int],
                 per_seq: int, kernel: CpuPagedAttention, gen: torch.Generator) -> None:
    """Plain vs packed projection weights: a whole step, and the projections alone."""
    weights = load_weights(TINY_TARGET, spec.num_layers)
    plain = LlamaModel(spec, weights, pack_weights=False)
    packed = LlamaModel(spec, weights)
    if not packed.packed:
        print("\nweights not packed on this machine (see engine.model.packing_disabled_reason)")
        return
    print("\n| batch | step F.linear ms | step packed/kernel ms | ratio "
          "| projections F.linear ms | projections packed/kernel ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    for b in args.batch:
        slices = decode_slices(b, args.context, perm, per_seq)
        ids = torch.randint(0, spec.vocab_size, (b,), generator=gen)
        print_row(b, args, [(make(plain, kv, slices, ids, None, kernel),
                             make(packed, kv, slices, ids, None, kernel))
                            for make in (step_fn, projections_fn)])


def decode_slices(batch: int, context: int, perm: list[int], per_seq: int) -> list[SeqSlice]:
    """One decode row per sequence, each over its own scattered KV blocks."""
    return [SeqSlice(1, context, perm[i * per_seq:(i + 1) * per_seq]) for i in range(batch)]


def print_row(batch: int, args: argparse.Namespace,
              pairs: list[tuple[Callable[[], object], Callable[[], object]]]) -> None:
    """CPU ms of each (slow, fast) pair and their ratio, as one table row."""
    row = []
    for slow_fn, fast_fn in pairs:
        slow = best_cpu_ms(slow_fn, args.iters, args.repeats)
        fast = best_cpu_ms(fast_fn, args.iters, args.repeats)
        row += [f"{slow:.2f}", f"{fast:.2f}", f"{slow / fast:.2f}x"]
    print(f"| {batch} | " + " | ".join(row) + " |", flush=True)


def projections_fn(model: LlamaModel, kv: KVCache, slices: list[SeqSlice], ids: torch.Tensor,
                   q: torch.Tensor | None, kernel: CpuPagedAttention | None) -> Callable[[], object]:
    """Every projection of one step (q|k|v, o, gate|up, down per layer, and the LM head)."""
    x = torch.randn(len(slices), model.spec.hidden_size)
    wide = torch.randn(len(slices), model.spec.intermediate_size)
    heads = torch.randn(len(slices), model.spec.num_heads * model.spec.head_dim)

    def run() -> None:
        with torch.inference_mode():
            for layer in model.layers:
                model.linear(x, layer.qkv, layer.qkv_bias)
                model.linear(heads, layer.o)
                model.linear(x, layer.gate_up)
                model.linear(wide, layer.down)
            model.linear(x, model.lm_head)
    return run


if __name__ == "__main__":
    main()
