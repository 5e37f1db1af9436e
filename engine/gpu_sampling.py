"""Sampling where the logits are: one host sync per step, to read the sampled ids.

The eager runner copies ``[N, vocab]`` logits to the host and samples there
(``polyinfer.sampling.sample``). On an accelerator that copy and the small CPU
kernels after it cost more than a whole decode step of a small model, so this
module samples on the logits' device with the same distribution code
(:func:`polyinfer.sampling.process_logits`), the same uniforms for unseeded
rows and the same keyed draws for seeded ones
(:func:`polyinfer.sampling.keyed_sample`, its noise made on the CPU), so a seeded
request draws the same tokens on either path. The only device-to-host transfer
is the final ``[N]`` token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from polyinfer.sampling import (
    Row,
    SamplingParams,
    process_logits,
    seeded_point_masses,
    uniforms,
)

ARGMAX_BLOCK = 4096  # columns per program of the two-pass argmax
ARGMAX_MIN_COLS = 16384  # narrower rows: torch's own argmax is as fast


def argmax_rows(x: torch.Tensor, interpret: bool = False) -> torch.Tensor:
    """``x.argmax(dim=1)`` for ``x`` ``[N, V]`` float32: the first column of each row's
    largest value, as int64 ``[N]``.

    On a CUDA device a wide row (a vocabulary) is cut into ``ARGMAX_BLOCK``-column blocks,
    one program each, then merged per row: torch reduces one row in one block of threads,
    27 us for a 128,256-token vocabulary at batch 1 on an H200, against ~1.5 us of
    bandwidth (bench/RESULTS.md, GPU decode). Ties go to the first column in both passes,
    as torch's. ``interpret``: the two passes on any device (Triton's interpreter, for
    the tests). NOTE: a NaN is not a maximum here (torch's argmax returns a NaN's column).
    """
    rows, cols = x.shape
    if not ((x.is_cuda or interpret) and cols >= ARGMAX_MIN_COLS and rows
            and x.dtype == torch.float32 and x.stride(-1) == 1):
        return x.argmax(dim=1)
    from engine.fused_kernels import argmax_merge_kernel, argmax_part_kernel

    parts = -(-cols // ARGMAX_BLOCK)
    val = torch.empty(rows, parts, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, parts, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    argmax_part_kernel[(rows, parts)](x, val, idx, cols, x.stride(0), parts,
                                      BLOCK=ARGMAX_BLOCK, num_warps=4)
    argmax_merge_kernel[(rows,)](val, idx, out, parts, PARTS=max(2, 1 << (parts - 1).bit_length()),
                                 num_warps=1)
    return out


def sample_on_device(logits: torch.Tensor, params: Sequence[SamplingParams],
                     rows: Sequence[Row] | None = None) -> list[int]:
    """[N, vocab] logits (any device) -> N token ids; greedy rows take the argmax."""
    ids: list[int] = sample_ids(logits, params, rows).tolist()
    return ids


def sample_ids(logits: torch.Tensor, params: Sequence[SamplingParams],
               rows: Sequence[Row] | None = None) -> torch.Tensor:
    """:func:`sample_on_device`'s ids as a tensor ``[N]`` on the logits' device, not yet
    read back (a caller can feed them to the next step before the host sees them)."""
    if all(p.greedy and not p.adjusts for p in params):
        return argmax_rows(logits)
    probs = process_logits(logits, params, rows)  # [N, vocab] float32; greedy rows one-hot
    probs = seeded_point_masses(probs, params, rows)  # and keyed rows on their keyed sample
    # NOTE: point-mass rows pick their token with any u; only drawn rows take a uniform,
    # as polyinfer.sampling does.
    drawn = [i for i, p in enumerate(params) if not p.greedy and not p.keyed]
    u = torch.zeros(len(params))
    u[drawn] = uniforms(len(drawn))
    return inverse_cdf(probs, u.to(probs.device, non_blocking=True))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row-wise draw from [N, vocab] probs with uniforms u [N]; never a zero-mass token.

    Same rule as ``polyinfer.sampling._inverse_cdf``, with the zero-mass fallback
    done by ``torch.where`` instead of a host-side branch.
    """
    cdf = probs.cumsum(dim=1)  # [N, vocab]
    target = (u * cdf[:, -1]).unsqueeze(1)  # [N, 1]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    picked.clamp_(max=probs.shape[1] - 1)
    zero = probs.gather(1, picked.unsqueeze(1)).squeeze(1) <= 0
    return torch.where(zero, argmax_rows(probs), picked)
