"""Token sampling shared by plain decoding and speculative verification.

The engine's non-speculative sampler is :func:`sample`; speculative verification
(:mod:`specdec.verify`, which may not import the engine) builds the target distribution with the same
:func:`process_logits` and draws its final token with the same
:func:`sample_from_probs`. So both paths sample from one distribution by
construction::

    probs = process_logits(logits, params, rows)     # [N, vocab] float32: penalties, bias,
                                                     # min_tokens, temperature, top-k, top-p
    tokens = sample_from_probs(probs, params, rows)  # [N] int64

``rows`` (one :class:`Row` per logits row) is what a row's distribution depends on
beyond its logits: the tokens before it (penalties, ``min_tokens``) and its
position in the sequence. Greedy rows (``temperature == 0``) become a point mass
on the argmax, which the rejection sampler handles like any other distribution
(accept iff the draft token is the argmax).

Seeded rows draw by the Gumbel-max rule (as an exponential race) with noise keyed
by ``(seed, position)``
(:func:`keyed_sample`): the token at position t is a function of the seed, t and
the distribution at t only, never of how many numbers were drawn before. NOTE:
a per-request generator advanced by each draw made the text depend on the
speculative depth (rejection sampling spends uniforms on accept tests); keyed
draws make a seeded request's text the same at every depth and with speculation
off, with drafts accepted where they equal the keyed sample (specdec.verify).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


class SamplingError(ValueError):
    """Sampling parameters out of range, or logits that do not line up with them."""


@dataclass(frozen=True, eq=False)
class SamplingParams:
    """How one request samples; ``seed`` makes it reproducible (:func:`keyed_sample`)."""

    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # tokens kept, 0 = the whole vocabulary
    seed: int | None = None  # keyed draws (see the module docstring); None = torch's RNG
    min_p: float = 0.0  # drop tokens below min_p * the most likely one's probability
    presence_penalty: float = 0.0  # OpenAI: subtracted once from each token already output
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # vLLM's: logits of prompt and output tokens / r (or * r)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # ``min_tokens_ban`` is masked until this many tokens are output
    min_tokens_ban: frozenset[int] = field(default_factory=frozenset)  # EOS + stop token ids

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise SamplingError(f"temperature: expected >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p: expected a fraction in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise SamplingError(f"top_k: expected >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingError(f"min_p: expected a fraction in [0, 1], got {self.min_p!r}")
        if not self.repetition_penalty > 0.0:
            raise SamplingError(
                f"repetition_penalty: expected > 0, got {self.repetition_penalty!r}")
        if self.min_tokens < 0:
            raise SamplingError(f"min_tokens: expected >= 0, got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts(self) -> bool:
        """Its logits change with what came before (penalties, min_tokens) or by a bias."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or (self.min_tokens and self.min_tokens_ban))

    @property
    def keyed(self) -> bool:
        """It draws keyed samples: seeded and not greedy."""
        return self.seed is not None and not self.greedy

    @classmethod
    def seeded(cls, seed: int, temperature: float = 1.0, top_p: float = 1.0,
               top_k: int = 0) -> SamplingParams:
        return cls(temperature, top_p, top_k, seed)


@dataclass(frozen=True, eq=False)
class Row:
    """What a logits row's distribution depends on besides its logits.

    The rows of one sequence in a verification step share ``prompt_ids`` and
    ``output_ids`` (the same objects) and differ by ``drafts``: the draft tokens
    scored before the row. Penalties count ``output_ids + drafts``.
    """

    position: int  # index in the sequence of the token this row samples
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    drafts: Sequence[int] = ()

    @property
    def num_output(self) -> int:
        return len(self.output_ids) + len(self.drafts)


NO_ROW = Row(0)


def _rows_for(params: Sequence[SamplingParams], rows: Sequence[Row] | None) -> Sequence[Row]:
    if rows is None:
        return [NO_ROW] * len(params)
    if len(rows) != len(params):
        raise SamplingError(f"rows: expected {len(params)}, got {len(rows)}")
    return rows


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                   rows: Sequence[Row] | None = None) -> torch.Tensor:
    """The distribution each row samples from: [N, vocab] logits -> [N, vocab] float32 probs."""
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise SamplingError(
            f"logits: expected [{len(params)}, vocab], got {tuple(logits.shape)}")
    logits = adjust_logits(logits.float(), params, rows)
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if not greedy_rows:
        return _softmax_truncated(logits, params)
    if len(greedy_rows) == len(params):
        return _one_hot_argmax(logits)
    probs = torch.empty_like(logits)
    greedy = torch.tensor(greedy_rows, device=logits.device)
    probs[greedy] = _one_hot_argmax(logits[greedy])
    others = [i for i, p in enumerate(params) if not p.greedy]
    index = torch.tensor(others, device=logits.device)
    probs[index] = _softmax_truncated(logits[index], [params[i] for i in others])
    return probs


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                  rows: Sequence[Row] | None = None) -> torch.Tensor:
    """``logits`` [N, vocab] float32 with min_tokens, logit_bias and the penalties applied
    (vLLM's order); the same tensor when no row adjusts, else a new one."""
    adjusted = [i for i, p in enumerate(params) if p.adjusts]
    if not adjusted:
        return logits
    rows = _rows_for(params, rows)
    vocab, dev = logits.shape[1], logits.device
    index = torch.tensor(adjusted, device=dev)
    sub = logits[index]  # [n, vocab]
    ps = [params[i] for i in adjusted]
    rs = [rows[i] for i in adjusted]
    at: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for j, (p, r) in enumerate(zip(ps, rs, strict=True)):
        for token, value in p.logit_bias:
            if 0 <= token < vocab:
                at.append(j)
                tokens.append(token)
                values.append(value)
        if p.min_tokens and r.num_output < p.min_tokens:
            ban = [t for t in p.min_tokens_ban if 0 <= t < vocab]
            at.extend([j] * len(ban))
            tokens.extend(ban)
            values.extend([float("-inf")] * len(ban))
    if at:  # one scatter for every bias and ban of the step
        bias = torch.zeros(len(ps), vocab)
        bias.index_put_((torch.tensor(at), torch.tensor(tokens)), torch.tensor(values),
                        accumulate=True)
        sub += bias.to(dev)
    if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
           for p in ps):
        _penalize(sub, ps, rs)
    out = logits.clone()  # NOTE: the model's logits may be inference tensors (read-only)
    out[index] = sub
    return out


def _penalize(sub: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[Row]) -> None:
    """vLLM's penalties, in place on ``sub`` [n, vocab]."""
    vocab = sub.shape[1]
    counts = _output_counts(rows, vocab)  # [n, vocab] float32
    rep = torch.tensor([p.repetition_penalty for p in params]).unsqueeze(1)
    if bool((rep != 1.0).any()):
        seen = counts > 0
        prompts: dict[int, torch.Tensor] = {}
        for j, r in enumerate(rows):
            if params[j].repetition_penalty != 1.0 and r.prompt_ids:
                key = id(r.prompt_ids)
                if key not in prompts:
                    prompts[key] = torch.bincount(_ids(r.prompt_ids, vocab), minlength=vocab) > 0
                seen[j] |= prompts[key]
        seen_dev = seen.to(sub.device)
        rep_dev = rep.to(sub.device)
        scaled = torch.where(sub > 0, sub / rep_dev, sub * rep_dev)
        sub.copy_(torch.where(seen_dev, scaled, sub))
    freq = torch.tensor([p.frequency_penalty for p in params]).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params]).unsqueeze(1)
    sub -= (freq * counts + pres * (counts > 0).float()).to(sub.device)


def _ids(ids: Sequence[int], vocab: int) -> torch.Tensor:
    t = torch.as_tensor(list(ids), dtype=torch.int64)
    return t[(t >= 0) & (t < vocab)]


def _output_counts(rows: Sequence[Row], vocab: int) -> torch.Tensor:
    """[n, vocab]: occurrences of each token in each row's output (and drafts before it).

    NOTE: a sequence's rows share its ``output_ids``: counted once, then each row adds
    its drafts, so a depth-k step costs one bincount per sequence, not k + 1.
    """
    counts = torch.zeros(len(rows), vocab)
    base: dict[int, torch.Tensor] = {}
    for j, r in enumerate(rows):
        key = id(r.output_ids)
        if key not in base:
            base[key] = torch.bincount(_ids(r.output_ids, vocab), minlength=vocab).float()
        counts[j] = base[key]
        for t in r.drafts:
            if 0 <= t < vocab:
                counts[j, t] += 1.0
    return counts


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
    probs = torch.softmax(scaled, dim=1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
        floor = probs.amax(dim=1, keepdim=True) * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=1, keepdim=True)
    return probs


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


def sample_from_probs(probs: torch.Tensor, params: Sequence[SamplingParams],
                      rows: Sequence[Row] | None = None) -> torch.Tensor:
    """One token per row from [N, vocab] probabilities; greedy rows take the argmax, seeded
    rows their keyed sample (:func:`keyed_sample`), the others an inverse-CDF draw with one
    uniform from torch's RNG."""
    drawn = [i for i, p in enumerate(params) if not p.greedy and not p.keyed]
    keyed = [i for i, p in enumerate(params) if p.keyed]
    tokens = probs.argmax(dim=1)  # [N]
    if drawn:
        u = torch.rand(len(drawn)).to(probs.device)
        if len(drawn) == len(params):
            return _inverse_cdf(probs, u)
        index = torch.tensor(drawn, device=probs.device)
        tokens[index] = _inverse_cdf(probs[index], u)
    if keyed:
        rows = _rows_for(params, rows)
        index = torch.tensor(keyed, device=probs.device)
        tokens[index] = keyed_sample(probs[index], [params[i] for i in keyed],
                                     [rows[i].position for i in keyed])
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


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit key from a structured one."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request with ``n`` samples; index 0 keeps ``seed``."""
    return seed if index == 0 else _mix64((seed & _MASK64) ^ _mix64(index)) >> 1


def keyed_noise(seeds: Sequence[int], positions: Sequence[int], vocab: int) -> torch.Tensor:
    """Exponential(1) noise [n, vocab] float32, row i a function of (seeds[i], positions[i])
    only, drawn on the CPU (the same numbers on any device)."""
    out = torch.empty(len(seeds), vocab)
    g = torch.Generator()
    for i, (seed, pos) in enumerate(zip(seeds, positions, strict=True)):
        g.manual_seed(_mix64((_mix64(seed & _MASK64) + pos) & _MASK64) >> 1)
        torch.rand(vocab, generator=g, out=out[i])
    # NOTE: -log(u) for u in [0, 1): 0 maps to +inf, a token that can never win
    return out.log_().neg_()


def keyed_sample(probs: torch.Tensor, params: Sequence[SamplingParams],
                 positions: Sequence[int]) -> torch.Tensor:
    """[n] tokens: argmax(p / E) per row, E exponential noise keyed by (seed, position).

    The exponential race, i.e. the Gumbel-max trick (argmax(log p - log E)) without its
    logs of p: an exact draw from each row's p, never a zero-mass token. A draft that
    draws with the same key from its own q agrees with the target's draw with
    probability >= (1 - TV(p, q)) / (1 + TV(p, q)).
    """
    noise = keyed_noise([p.seed or 0 for p in params], positions, probs.shape[1])
    return (probs / noise.to(probs.device)).argmax(dim=1)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           rows: Sequence[Row] | None = None) -> torch.Tensor:
    """The plain (non-speculative) sampler: [N, vocab] logits -> [N] tokens."""
    if all(p.greedy and not p.adjusts for p in params):
        return logits.argmax(dim=1)
    return sample_from_probs(process_logits(logits, params, rows), params, rows)


def uniforms(count: int) -> torch.Tensor:
    """``count`` uniforms in [0, 1) from torch's RNG, on the CPU (unseeded rows only)."""
    return torch.rand(count)


def seeded_point_masses(probs: torch.Tensor, params: Sequence[SamplingParams],
                        rows: Sequence[Row] | None) -> torch.Tensor:
    """``probs`` with each keyed row replaced by a point mass on its keyed sample.

    Verification then accepts a draft exactly where it equals the keyed sample, and
    draws the keyed sample at the first mismatch: what plain decoding emits.
    """
    keyed = [i for i, p in enumerate(params) if p.keyed]
    if not keyed:
        return probs
    rows = _rows_for(params, rows)
    index = torch.tensor(keyed, device=probs.device)
    tokens = keyed_sample(probs[index], [params[i] for i in keyed],
                          [rows[i].position for i in keyed])
    point = torch.zeros(len(keyed), probs.shape[1], dtype=probs.dtype, device=probs.device)
    point.scatter_(1, tokens.unsqueeze(1), 1.0)
    probs = probs.clone()
    probs[index] = point
    return probs
