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
        return logits.argmax(dim=1)
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
    return torch.where(zero, probs.argmax(dim=1), picked)
