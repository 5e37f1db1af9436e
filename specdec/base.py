"""The speculative-decoding contract between the engine and the proposers.

One engine step with speculation is::

    proposals = proposer.propose([ProposalRequest(seq_id, token_ids, depth), ...])
    # engine: one target forward pass scoring len(p.tokens) + 1 positions per sequence
    results = verify(target_logits, proposals, sampling)        # specdec.verify
    for r in results: proposer.commit(r.seq_id, r.num_accepted)  # keep draft state in step
    # finished or aborted sequences: proposer.release(seq_id)

Depth is per sequence: every request in the batch may ask for a different k
(0 = no speculation), and a proposer may return fewer tokens than asked (the
n-gram proposer returns none when nothing matches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from polyinfer.sampling import SamplingParams


@dataclass(frozen=True)
class ProposalRequest:
    seq_id: int
    token_ids: Sequence[int]  # prompt + generated so far, including the last sampled token
    depth: int  # k: how many tokens to propose at most (> 0)
    # How the request samples. A proposer may draft from the same processed
    # distribution (the draft model does, returning it as ``Proposal.probs``),
    # which raises acceptance at temperature > 0; None = draft greedily.
    sampling: SamplingParams | None = None
    # How many of token_ids are the prompt (0 = unknown); the n-gram proposer pools
    # outputs across requests (specdec.pool) and needs to tell them from prompts.
    num_prompt_tokens: int = 0


@dataclass(frozen=True)
class Proposal:
    seq_id: int
    tokens: list[int]  # [n] with n <= depth; may be empty
    # Draft distribution at each proposed position, [n, vocab] float32, or None
    # when the proposer is deterministic (n-gram lookup): a point mass on each
    # token, which rejection sampling treats as q(x) = 1.
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """Proposes up to k next tokens per sequence; all methods are synchronous."""

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        """One proposal per request, in order."""
        ...

    def commit(self, seq_id: int, num_accepted: int) -> None:
        """The target accepted ``num_accepted`` of the last proposal (plus one bonus token)."""
        ...

    def release(self, seq_id: int) -> None:
        """The sequence finished or was aborted/preempted: free its state."""
        ...
