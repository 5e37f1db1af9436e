"""Token sampling shared by plain decoding and speculative verification.

The engine's non-speculative sampler is :func:`sample`; speculative verification
(:mod:`specdec.verify`, which may not import the engine) builds the target distribution with the same
:func:`process_logits` and draws its final token with the same
:func:`sample_from_probs`. So both paths sample from one distribution by
construction, and with depth 0 they consume a request's generator identically::

    probs = process_logits(logits, params)     # [N, vocab] float32: temperature, top-k, top-p
    tokens = sample_from_probs(probs, params)  # [N] int64

Greedy rows (``temperature == 0``) become a point mass on the argmax, which the
rejection sampler handles like any other distribution (accept iff the draft
token is the argmax).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class SamplingError(ValueError):
    """Sampling parameters out of range, or logits that do not line up with them."""


@dataclass(frozen=True, eq=False)
class SamplingParams:
    """How one request samples; ``generator`` makes a seeded request reproducible."""

    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # tokens kept, 0 = the whole vocabulary
    generator: torch.Generator | None = None  # per-request RNG; None = torch's default RNG

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise SamplingError(f"temperature: expected >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p: expected a fraction in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise SamplingError(f"top_k: expected >= 0 (0 = off), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def seeded(cls, seed: int, temperature: float = 1.0, top_p: float = 1.0,
               top_k: int = 0) -> SamplingParams:
        generator = torch.Generator()
        generator.manual_seed(seed)
        return cls(temperature, top_p, top_k, generator)


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: [N, vocab] logits -> [N, vocab] float32 probs."""
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise SamplingError(
            f"logits: expected [{len(params)}, vocab], got {tuple(logits.shape)}")
    logits = logits.float()
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if not greedy_rows:
        return _softmax_truncated(logits, params)
    if len(greedy_rows) == len(params):
        return _one_hot_argmax(logits)
    probs = torch.empty_like(logits)
    greedy = torch.tensor(greedy_rows, device=logits.device)
    probs[greedy] = _one_hot_argmax(logits[greedy])
    rows = [i for i, p in enumerate(params) if not p.greedy]
    index = torch.tensor(rows, device=logits.device)
    probs[index] = _softmax_truncated(logits[index], [params[i] for i in rows])
    return probs


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(logits)
    return out.scatter_(1, logits.argmax(dim=1, keepdim=True), 1.0)


def _softmax_truncated(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    temperatures = {p.temperature for p in params}
    if len(temperatures) == 1:
        scaled = logits / temperatures.pop()  # [n, vocab]
    else:
        temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype,
                                   device=logits.device)
        scaled = logits / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                             device=logits.device)
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype,
                             device=logits.device)
        scaled = _mask_top_k_top_p(scaled, top_k, top_p)
    return torch.softmax(scaled, dim=1)


def _mask_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside the top-k, then outside the top-p nucleus of what is left."""
    ordered, order = scaled.sort(dim=1, descending=True)  # [n, vocab]
    ranks = torch.arange(scaled.shape[1], device=scaled.device).unsqueeze(0)
    ordered = ordered.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    sorted_probs = torch.softmax(ordered, dim=1)
    mass_before = sorted_probs.cumsum(dim=1) - sorted_probs
    # NOTE: a token stays if the tokens ranked above it hold less than top_p, so the
    # most likely token always stays.
    ordered = ordered.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, ordered)


def sample_from_probs(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """One token per row from [N, vocab] probabilities; greedy rows take the argmax.

    Inverse-CDF sampling: one uniform per row (drawn from the row's generator
    when it has one), so a seeded request's stream advances by one number per
    sampled token whichever path samples it.
    """
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return probs.argmax(dim=1)  # [N]
    u = uniforms([1] * len(rows), [params[i] for i in rows]).to(probs.device)
    if len(rows) == len(params):
        return _inverse_cdf(probs, u)
    tokens = probs.argmax(dim=1)  # [N]
    index = torch.tensor(rows, device=probs.device)
    tokens[index] = _inverse_cdf(probs[index], u)
    return tokens


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row-wise draw: the first token whose cumulative mass exceeds u * total."""
    cdf = probs.cumsum(dim=1)  # [n, vocab]
    target = (u * cdf[:, -1]).unsqueeze(1)  # [n, 1]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    picked.clamp_(max=probs.shape[1] - 1)
    # NOTE: rounding can put target at the very top of the cdf, past the last token with
    # mass; never return a zero-probability token, take the most likely one instead.
    zero = probs.gather(1, picked.unsqueeze(1)).squeeze(1) <= 0
    if bool(zero.any()):
        picked[zero] = probs[zero].argmax(dim=1)
    return picked


def sample(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The plain (non-speculative) sampler: [N, vocab] logits -> [N] tokens."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=1)
    return sample_from_probs(process_logits(logits, params), params)


def uniforms(counts: Sequence[int], params: Sequence[SamplingParams]) -> torch.Tensor:
    """``counts[i]`` uniforms in [0, 1) for each row, concatenated; drawn from each row's generator.

    Drawn on the CPU (per-request generators are CPU generators), so a seeded
    request gets the same numbers on any device.
    """
    total = sum(counts)
    out = torch.rand(total) if any(p.generator is None for p in params) else torch.empty(total)
    start = 0
    for count, p in zip(counts, params, strict=True):
        if p.generator is not None and count:
            out[start : start + count] = torch.rand(count, generator=p.generator)
        start += count
    return out
