"""Draft-model proposer: a small model of the same family proposes k tokens, batched.

This is the proposal logic; running the draft model (its weights, paged KV
cache, attention and CUDA graphs) is the engine's :mod:`engine.draft_runner`,
behind the :class:`DraftModel` interface. One ``propose`` call is ``k_max``
batched forward passes of the draft:

1. catch-up: every sequence feeds the tokens its draft cache has not seen
   (the whole prompt the first time, then the tokens accepted since the last
   step plus the bonus token) and drafts token 1 from the last position;
2. rounds 2..k: each sequence that wants more feeds its previous draft token
   and drafts the next one.

Afterwards the draft cache holds K/V for ``history + d_1 .. d_{k-1}``; the
target then accepts ``n`` of the ``k`` drafts and :meth:`DraftProposer.commit`
tells the model to keep ``history + d_1 .. d_min(n, k-1)``.

A sequence stops drafting at the first token the draft itself is unsure of
(its probability under the draft's distribution below ``min_confidence``);
that token is dropped. NOTE: on a CPU each draft round costs about a tenth of a
target step and each verified position more, while a low-probability draft
token is rarely accepted; the target's bonus token fills that position anyway.
Dropping a suffix of a proposal never changes what is emitted (verification
accepts a prefix), so this stays lossless.

Drafts are greedy (argmax, ``probs=None``: a point mass) unless the request
carries non-greedy ``sampling``: then each draft token is drawn from the draft's
distribution processed exactly as the target's (temperature, top-k, top-p), and
that distribution is returned as ``Proposal.probs`` for rejection sampling. Both
are lossless; sampled drafts are accepted more often at temperature > 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from polyinfer.sampling import Row, SamplingParams, process_logits, sample_from_probs
from specdec.base import Proposal, ProposalRequest

GREEDY = SamplingParams(0.0)


@dataclass
class Round:
    """One batched forward of the draft: which sequences, feeding which tokens."""

    seq_ids: list[int]
    feeds: list[list[int]]  # tokens fed per sequence
    starts: list[int]  # positions already cached per sequence


class DraftModel(Protocol):
    """The draft model with a per-sequence KV cache, as the proposer drives it."""

    @property
    def vocab_size(self) -> int: ...

    def prepare(self, request: ProposalRequest) -> int | None:
        """Sync the sequence's cache with its history and reserve room for ``depth`` drafts;
        the number of history positions already cached, or None: do not propose."""
        ...

    def forward(self, rnd: Round) -> torch.Tensor:
        """Feed each sequence its tokens; logits at each one's last token,
        ``[len(rnd.seq_ids), vocab]`` float32."""
        ...

    def commit(self, seq_id: int, num_accepted: int) -> None:
        """Keep history + the first ``num_accepted`` drafts written; drop the rest."""
        ...

    def release(self, seq_id: int) -> None: ...

    @property
    def num_tracked(self) -> int: ...


class DraftProposer:
    """Batched draft-model proposer over a :class:`DraftModel` (implements ``Proposer``)."""

    def __init__(self, model: DraftModel, min_confidence: float = 0.0) -> None:
        assert 0.0 <= min_confidence < 1.0, min_confidence  # checked by the draft's config
        self.model = model
        self.min_confidence = min_confidence

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        return self._propose(requests, keep_logits=False)[0]

    def propose_with_logits(self, requests: Sequence[ProposalRequest]
                            ) -> tuple[list[Proposal], list[torch.Tensor]]:
        """Proposals, and the draft's logits at each proposed position (``[n, vocab]`` float32
        on the host, each)."""
        return self._propose(requests, keep_logits=True)

    def _propose(self, requests: Sequence[ProposalRequest], keep_logits: bool
                 ) -> tuple[list[Proposal], list[torch.Tensor]]:
        drafts: dict[int, list[int]] = {r.seq_id: [] for r in requests}
        rows: dict[int, list[torch.Tensor]] = {r.seq_id: [] for r in requests}
        probs: dict[int, list[torch.Tensor]] = {r.seq_id: [] for r in requests}
        sampling = {r.seq_id: r.sampling for r in requests
                    if r.sampling is not None and not r.sampling.greedy}
        rnd = self._catch_up(requests)
        depth = {r.seq_id: r.depth for r in requests}
        length = {r.seq_id: len(r.token_ids) for r in requests}
        step = 0
        while rnd.seq_ids:
            logits = self.model.forward(rnd)  # [len(rnd.seq_ids), vocab]
            tokens, q = pick(logits, [sampling.get(s) for s in rnd.seq_ids],
                             [length[s] + step for s in rnd.seq_ids])
            sure = self._confident(logits, q, tokens, [s in sampling for s in rnd.seq_ids])
            step += 1
            for i, seq_id in enumerate(rnd.seq_ids):
                if not sure[i]:
                    continue
                drafts[seq_id].append(tokens[i])
                if keep_logits:
                    rows[seq_id].append(logits[i].cpu())
                if seq_id in sampling:
                    probs[seq_id].append(q[i])
            more = [i for i, s in enumerate(rnd.seq_ids) if depth[s] > step and sure[i]]
            rnd = Round([rnd.seq_ids[i] for i in more], [[tokens[i]] for i in more],
                        [rnd.starts[i] + len(rnd.feeds[i]) for i in more])
        vocab = self.model.vocab_size
        stacked = [torch.stack(rows[r.seq_id]) if rows[r.seq_id] else torch.empty(0, vocab)
                   for r in requests] if keep_logits else []
        out = [Proposal(r.seq_id, drafts[r.seq_id],
                        torch.stack(probs[r.seq_id]) if probs[r.seq_id] else None)
               for r in requests]
        return out, stacked

    def _catch_up(self, requests: Sequence[ProposalRequest]) -> Round:
        """The first round: each proposing sequence feeds the history its cache lacks."""
        seq_ids, feeds, starts = [], [], []
        for r in requests:
            cached = self.model.prepare(r) if r.depth > 0 else None
            if cached is not None:
                seq_ids.append(r.seq_id)
                feeds.append(list(r.token_ids[cached:]))
                starts.append(cached)
        return Round(seq_ids, feeds, starts)

    def commit(self, seq_id: int, num_accepted: int) -> None:
        self.model.commit(seq_id, num_accepted)

    def release(self, seq_id: int) -> None:
        self.model.release(seq_id)

    @property
    def num_tracked(self) -> int:
        return self.model.num_tracked

    def _confident(self, logits: torch.Tensor, q: torch.Tensor, tokens: list[int],
                   sampled: list[bool]) -> list[bool]:
        """Per row: is the drafted token's draft probability at least ``min_confidence``?"""
        if self.min_confidence <= 0.0:
            return [True] * len(tokens)
        index = torch.tensor(tokens, dtype=torch.long, device=logits.device).unsqueeze(1)
        p_greedy = torch.softmax(logits, dim=-1).gather(1, index).squeeze(1).tolist()
        p_sampled = (q.gather(1, index.to(q.device)).squeeze(1).tolist() if any(sampled)
                     else p_greedy)
        return [(p_sampled[i] if s else p_greedy[i]) >= self.min_confidence
                for i, s in enumerate(sampled)]


def pick(logits: torch.Tensor, sampling: list[SamplingParams | None],
         positions: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """Draft tokens: argmax for greedy rows; for sampled rows a draw from the request's own
    processed distribution q (temperature, top-k, top-p), returned as ``[rows, vocab]``.

    A seeded row draws with the key of the position it drafts (``positions``), as the
    target's keyed sample there does: coupled draws, which agree far more often than
    independent ones (polyinfer.sampling.keyed_sample). NOTE: the draft sees no
    penalties; verification applies them to the target, so acceptance drops, not exactness.
    """
    params = [s if s is not None else GREEDY for s in sampling]
    if all(p.greedy for p in params):  # on the logits' device: only the ids come back
        return logits.argmax(dim=1).tolist(), logits
    logits = logits.cpu()  # sampled drafts' q goes to verification with the proposal
    plain = [_unadjusted(p) for p in params]
    q = process_logits(logits, plain)  # greedy rows: one-hot on the argmax
    rows = [Row(pos) for pos in positions] if positions is not None else None
    return sample_from_probs(q, plain, rows).tolist(), q


def _unadjusted(p: SamplingParams) -> SamplingParams:
    """``p`` without the history-dependent adjustments the draft has no history for."""
    if not p.adjusts:
        return p
    return SamplingParams(p.temperature, p.top_p, p.top_k, p.seed, p.min_p)
