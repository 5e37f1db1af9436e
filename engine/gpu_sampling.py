"""Sampling where the logits are: one host sync per step, to read the sampled ids.

The eager runner copies ``[N, vocab]`` logits to the host and samples there
(``polyinfer.sampling.sample``). On an accelerator that copy and the small CPU
kernels after it cost more than a whole decode step of a small model, so this
module samples on the logits' device with the same distribution code
(:func:`polyinfer.sampling.process_logits`) and the same uniforms
(:func:`polyinfer.sampling.uniforms`: one per sampled row, drawn from the
request's generator when it has one), so a seeded request draws the same
numbers on either path. The only device-to-host transfer is the final ``[N]``
token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from polyinfer.sampling import SamplingParams, process_logits, uniforms


def sample_on_device(logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[int]:
    """[N, vocab] logits (any device) -> N token ids; greedy rows take the argmax."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=1).tolist()
    probs = process_logits(logits, params)  # [N, vocab] float32; greedy rows one-hot
    # NOTE: greedy rows are one-hot, so any u picks their argmax; every row takes one
    # uniform only if it samples, as polyinfer.sampling does.
    rows = [i for i, p in enumerate(params) if not p.greedy]
    u = torch.zeros(len(params))
    u[rows] = uniforms([1] * len(rows), [params[i] for i in rows])
    return inverse_cdf(probs, u.to(probs.device, non_blocking=True)).tolist()


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
