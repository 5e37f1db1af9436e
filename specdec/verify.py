"""Batched verification of proposals with a different depth k per sequence.

The engine runs one target forward pass that scores ``k_i + 1`` positions for
every sequence i (the last accepted token followed by its ``k_i`` proposed
tokens) and hands the logits here, flat and in sequence order::

    target_logits  [sum(k_i + 1), vocab]
    seq 0: positions 0 .. k_0      (position j scores the token after draft token j-1)
    seq 1: positions k_0 + 1 .. k_0 + k_1 + 1   ...

Lossless rejection sampling (Leviathan et al. 2023; Chen et al. 2023): with p the
target distribution (:func:`polyinfer.sampling.process_logits`, the one plain
sampling uses) and q the draft's, draft token x is accepted with probability
min(1, p(x) / q(x)); at the first rejection the final token is drawn from
norm(max(0, p - q)); when all k are accepted the bonus token is drawn from p at
position k. A deterministic proposer (n-gram) is a point mass, q(x) = 1. Greedy
requests have p = a point mass on the argmax, which makes this "accept the
longest prefix matching the argmax, then the argmax".

Seeded requests (:func:`polyinfer.sampling.keyed_sample`) verify by equality
instead: the target's keyed sample is drawn at every position, a draft is
accepted where it equals it, and the keyed sample follows the accepted prefix, so
the output is token for token what plain decoding with that seed emits.
Penalties, ``logit_bias`` and ``min_tokens`` apply at every position as they
would in plain decoding: position j counts the drafts before it as output.

Everything is vectorised across the batch; the only Python loops are over
sequences (to build index tensors and per-row histories).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from polyinfer.sampling import (
    Row,
    SamplingParams,
    process_logits,
    sample_from_probs,
    seeded_point_masses,
    uniforms,
)
from specdec import triton_accept
from specdec.base import Proposal
from specdec.errors import VerifyInputError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyResult:
    seq_id: int
    tokens: list[int]  # [num_accepted + 1]: accepted draft tokens, then the bonus/resampled token
    num_accepted: int  # draft tokens accepted, 0..num_draft
    num_draft: int  # draft tokens proposed (k_i as actually proposed)


@dataclass(frozen=True)
class _Layout:
    """Where each sequence's positions sit in the flat logits."""

    num_draft: torch.Tensor  # [B] int64, k_i
    starts: torch.Tensor  # [B] int64, flat index of each sequence's first position
    draft_tokens: torch.Tensor  # [T] int64, the draft token scored at each position (0 at bonus)
    is_draft: torch.Tensor  # [T] bool, False at each sequence's bonus position
    max_k: int  # max(k_i), known on the host


def verify(target_logits: torch.Tensor, proposals: Sequence[Proposal],
           sampling: Sequence[SamplingParams],
           rows: Sequence[Row] | None = None,
           argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[VerifyResult]:
    """Accept or reject every proposal; one result per proposal, in order.

    ``rows``: per proposal, the :class:`~polyinfer.sampling.Row` of its first position
    (its history and position), needed by seeded and penalised requests. ``argmax``: the
    rows' ``argmax(dim=1)`` as the caller computes it fastest on its device (the engine's
    two-pass kernel on a GPU); torch's by default.
    """
    _check_inputs(target_logits, proposals, sampling)
    if all(s.greedy and not s.adjusts for s in sampling):
        return _verify_greedy(target_logits, proposals, argmax)
    layout = _layout(target_logits, proposals)
    counts = [len(p.tokens) + 1 for p in proposals]
    flat_params = [s for s, c in zip(sampling, counts, strict=True) for _ in range(c)]
    flat_rows = _flat_rows(proposals, sampling, rows)
    p = process_logits(target_logits, flat_params, flat_rows)  # [T, vocab]
    p = seeded_point_masses(p, flat_params, flat_rows)
    q_draft = _draft_prob_of_token(proposals, layout)  # [T]
    p_draft = p.gather(1, layout.draft_tokens.unsqueeze(1)).squeeze(1)  # [T]
    u = torch.ones_like(p_draft)  # [T]; 1 at bonus rows, which are never tested
    u[layout.is_draft] = uniforms(sum(counts) - len(counts)).to(p.device)
    num_accepted = _num_accepted(p_draft, q_draft, u, layout)  # [B]
    final_pos = layout.starts + num_accepted  # [B]
    rejected = num_accepted < layout.num_draft  # [B]
    dist = p[final_pos]  # [B, vocab]
    if bool(rejected.any()):
        q_rows = _draft_rows(proposals, layout, final_pos, rejected, p.shape[1])
        dist[rejected] = _residual(dist[rejected], q_rows)
    final = sample_from_probs(dist, sampling)  # [B]
    return _results(proposals, num_accepted, final)


def _flat_rows(proposals: Sequence[Proposal], sampling: Sequence[SamplingParams],
               rows: Sequence[Row] | None) -> list[Row] | None:
    """One row per scored position: position j of a proposal follows its drafts 0..j-1."""
    if rows is None or not any(s.adjusts or s.keyed for s in sampling):
        return None
    if len(rows) != len(proposals):
        raise VerifyInputError(f"{len(proposals)} proposals but {len(rows)} rows")
    return [Row(r.position + j, r.prompt_ids, r.output_ids, prop.tokens[:j])
            for prop, r in zip(proposals, rows, strict=True)
            for j in range(len(prop.tokens) + 1)]


def _check_inputs(logits: torch.Tensor, proposals: Sequence[Proposal],
                  sampling: Sequence[SamplingParams]) -> None:
    if len(proposals) != len(sampling):
        raise VerifyInputError(
            f"{len(proposals)} proposals but {len(sampling)} sampling params")
    total = sum(len(p.tokens) + 1 for p in proposals)
    if logits.dim() != 2 or logits.shape[0] != total:
        raise VerifyInputError(
            f"target_logits: expected [{total}, vocab] (sum of k_i + 1), got {tuple(logits.shape)}")
    for prop in proposals:
        _check_proposal(prop, logits.shape[1])


def _layout(logits: torch.Tensor, proposals: Sequence[Proposal]) -> _Layout:
    counts = [len(p.tokens) + 1 for p in proposals]
    total = sum(counts)
    flat: list[int] = []
    for prop in proposals:
        flat.extend(prop.tokens)
        flat.append(0)
    dev = logits.device
    num_draft = torch.tensor([c - 1 for c in counts], dtype=torch.int64, device=dev)
    starts = torch.cumsum(torch.tensor([0] + counts[:-1], dtype=torch.int64, device=dev), dim=0)
    is_draft = torch.ones(total, dtype=torch.bool, device=dev)
    is_draft[starts + num_draft] = False
    return _Layout(num_draft, starts, torch.tensor(flat, dtype=torch.int64, device=dev), is_draft,
                   max(counts, default=1) - 1)


def _check_proposal(prop: Proposal, vocab: int) -> None:
    if any(not 0 <= t < vocab for t in prop.tokens):
        raise VerifyInputError(f"seq {prop.seq_id}: proposed token outside [0, {vocab})")
    if prop.probs is not None and tuple(prop.probs.shape) != (len(prop.tokens), vocab):
        raise VerifyInputError(
            f"seq {prop.seq_id}: draft probs expected [{len(prop.tokens)}, {vocab}], "
            f"got {tuple(prop.probs.shape)}")


def _verify_greedy(logits: torch.Tensor, proposals: Sequence[Proposal],
                   argmax_of: Callable[[torch.Tensor], torch.Tensor] | None = None
                   ) -> list[VerifyResult]:
    """p is a point mass on each row's argmax: accept the longest prefix equal to the argmax.

    NOTE: one argmax over all rows, then plain Python over at most sum(k_i) ints: at batch 1
    building index tensors for the vectorised path cost more than the rows it checks.
    """
    ids = logits.argmax(dim=1) if argmax_of is None else argmax_of(logits)
    argmax: list[int] = ids.tolist()  # [T]
    out = []
    start = 0
    for prop in proposals:
        n = 0
        for token in prop.tokens:
            if token != argmax[start + n]:
                break
            n += 1
        out.append(VerifyResult(prop.seq_id, prop.tokens[:n] + [argmax[start + n]], n,
                                len(prop.tokens)))
        start += len(prop.tokens) + 1
    return out


FIRST_WAVE_ROWS = 4  # rows per sequence scored first by verify_greedy_in_waves


def verify_greedy_in_waves(score: Callable[[list[int]], list[int]],
                           proposals: Sequence[Proposal]) -> list[VerifyResult]:
    """Greedy verification that asks ``score`` for the argmax of as few rows as it can.

    Rows are laid out as for :func:`verify` (``k_i + 1`` per proposal, flat, in order);
    ``score(rows)`` returns the argmax token of each of those flat rows. The first
    ``FIRST_WAVE_ROWS`` rows of every proposal are scored together, then all the remaining
    rows of the proposals accepted so far. The answer equals :func:`verify`'s on logits
    whose rows give the same argmax.

    NOTE: on the CPU the vocabulary projection of one row costs about a quarter of a
    row's whole forward on the bundled model, and rows after the first rejection are
    never used: at depth 16 a step accepts 2-3 drafts on average, so scoring 17 rows
    wasted most of that projection.
    """
    starts = list(itertools.accumulate((len(p.tokens) + 1 for p in proposals), initial=0))
    done: list[VerifyResult | None] = [None] * len(proposals)
    scored = [0] * len(proposals)  # rows of each proposal scored so far
    pending = list(range(len(proposals)))
    wave = FIRST_WAVE_ROWS
    while pending:
        spans = [(i, min(len(proposals[i].tokens) + 1 - scored[i], wave)) for i in pending]
        tokens = score([starts[i] + scored[i] + r for i, n in spans for r in range(n)])
        pending, offset = [], 0
        for i, n in spans:
            done[i] = _accept(proposals[i], scored[i], tokens[offset:offset + n])
            scored[i] += n
            if done[i] is None:
                pending.append(i)
            offset += n
        wave = max(len(p.tokens) + 1 for p in proposals)  # then everything left
    return [r for r in done if r is not None]


def _accept(prop: Proposal, first: int, argmax: list[int]) -> VerifyResult | None:
    """The result once ``argmax`` (rows ``first ..``) rejects or ends the proposal; else None."""
    for j, token in enumerate(argmax, first):
        if j == len(prop.tokens) or prop.tokens[j] != token:
            return VerifyResult(prop.seq_id, prop.tokens[:j] + [token], j, len(prop.tokens))
    return None


def _num_accepted(p_draft: torch.Tensor, q_draft: torch.Tensor, u: torch.Tensor,
                  layout: _Layout) -> torch.Tensor:
    """[B]: leading draft positions with u * q(x) < p(x); a Triton kernel on CUDA."""
    if layout.max_k > 0 and triton_accept.available(p_draft):
        return triton_accept.accept_counts(p_draft, q_draft, u, layout.starts, layout.num_draft,
                                           layout.max_k)
    return _leading_true(layout.is_draft & (u * q_draft < p_draft), layout)


def _leading_true(accepted: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """Per sequence, how many of its draft positions are accepted before the first rejection."""
    max_k = layout.max_k
    if max_k == 0:
        return torch.zeros_like(layout.num_draft)
    offsets = torch.arange(max_k, device=accepted.device)
    valid = offsets.unsqueeze(0) < layout.num_draft.unsqueeze(1)  # [B, max_k]
    index = (layout.starts.unsqueeze(1) + offsets).clamp_(max=accepted.shape[0] - 1)
    grid = accepted[index] & valid  # [B, max_k]
    return grid.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _draft_prob_of_token(proposals: Sequence[Proposal], layout: _Layout) -> torch.Tensor:
    """q(x) for each position's draft token: 1 for point-mass proposals."""
    dev = layout.draft_tokens.device
    q = torch.ones(layout.draft_tokens.shape[0], dtype=torch.float32, device=dev)
    for i, prop in enumerate(proposals):
        if prop.probs is not None and prop.tokens:
            start = int(layout.starts[i])
            tokens = torch.tensor(prop.tokens, dtype=torch.int64, device=dev).unsqueeze(1)
            q[start : start + len(prop.tokens)] = prop.probs.to(dev, torch.float32).gather(
                1, tokens).squeeze(1)
    return q


def _draft_rows(proposals: Sequence[Proposal], layout: _Layout, final_pos: torch.Tensor,
                rejected: torch.Tensor, vocab: int) -> torch.Tensor:
    """q at each rejected sequence's rejection position: [num_rejected, vocab]."""
    rows = rejected.nonzero().squeeze(1).tolist()
    q = torch.zeros(len(rows), vocab, dtype=torch.float32, device=final_pos.device)
    for r, i in enumerate(rows):
        j = int(final_pos[i] - layout.starts[i])
        probs = proposals[i].probs
        if probs is None:
            q[r, proposals[i].tokens[j]] = 1.0
        else:
            q[r] = probs[j].to(q.device, torch.float32)
    return q


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) per row; falls back to p where p <= q everywhere (rounding only)."""
    r = (p - q).clamp_(min=0.0)
    mass = r.sum(dim=1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp(min=torch.finfo(r.dtype).tiny), p)


def _results(proposals: Sequence[Proposal], num_accepted: torch.Tensor,
             final: torch.Tensor) -> list[VerifyResult]:
    out = []
    for prop, n, token in zip(proposals, num_accepted.tolist(), final.tolist(), strict=True):
        out.append(VerifyResult(prop.seq_id, prop.tokens[:n] + [token], n, len(prop.tokens)))
    return out
