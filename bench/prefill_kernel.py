"""Attention of a captured prompt chunk: ``prefill_attention`` against ``decode_attention``.

One layer of the Llama-3.2-1B shape (32 query heads, 8 KV heads, head_dim 64, bf16), a
paged cache of 16-token blocks in random order; a chunk of R rows of one sequence after P
cached tokens (row j attends P + j + 1 tokens), and the same with the chunk split over
several sequences. Prints device us per call of each kernel (CUDA events, median of 5
timings of 20 calls), the ratio, and the largest difference between their outputs.

    python bench/prefill_kernel.py [--rows 256 1024 2048] [--cached 1000]

Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.triton_attention import (  # noqa: E402
    DecodeMetadata,
    decode_attention,
    prefill_attention,
)

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 64, 16


def case(rows: int, cached: int, seqs: int, g: torch.Generator) -> tuple:
    """``seqs`` sequences of ``rows // seqs`` chunk rows each, after ``cached`` tokens."""
    per = rows // seqs
    width = -(-(cached + per) // BLOCK)
    num_blocks = seqs * width
    k = torch.randn(KV_HEADS, num_blocks, BLOCK, DIM, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(KV_HEADS, num_blocks, BLOCK, DIM, generator=g).to("cuda", torch.bfloat16)
    q = torch.randn(per * seqs, HEADS, DIM, generator=g).to("cuda", torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=g).view(seqs, width).to(torch.int32)
    tables = perm.repeat_interleave(per, 0)
    lens = torch.arange(cached + 1, cached + per + 1, dtype=torch.int32).repeat(seqs)
    segs = torch.arange(seqs, dtype=torch.int32).repeat_interleave(per)
    pos = (lens - 1).long().cuda()
    meta = DecodeMetadata(pos, pos, tables.cuda(), lens.cuda(), segments=segs.cuda())
    return q, k, v, meta


def timed_us(fn, *args) -> float:  # type: ignore[no-untyped-def]
    fn(*args)
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn(*args)
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / 20)
    return statistics.median(runs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--cached", type=int, default=1000)
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 4])
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    scale = DIM ** -0.5
    print("| rows | sequences | cached | decode_attention us | prefill_attention us | ratio | "
          "max |diff| |\n|---|---|---|---|---|---|---|")
    for rows in args.rows:
        for seqs in args.seqs:
            q, k, v, meta = case(rows, args.cached, seqs, g)
            want = decode_attention(q, k, v, meta, scale)
            got = prefill_attention(q, k, v, meta, scale)
            diff = float((want.float() - got.float()).abs().max())
            dec = timed_us(decode_attention, q, k, v, meta, scale)
            pre = timed_us(prefill_attention, q, k, v, meta, scale)
            print(f"| {rows} | {seqs} | {args.cached} | {dec:.1f} | {pre:.1f} | "
                  f"{dec / pre:.2f}x | {diff:.3g} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
