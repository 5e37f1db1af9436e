"""N-gram prompt-lookup proposer: propose what followed the last time the context's suffix occurred.

For each sequence the proposer looks for the longest suffix n-gram (``max_n`` down
to ``min_n`` tokens) that also occurs earlier in prompt + generated tokens, takes
its most recent earlier occurrence, and proposes the up to ``k`` tokens that
followed it. Example with ``min_n=1, max_n=3, k=2``::

    tokens = [1, 2, 3, 4, 1, 2, 3]   # suffix [1, 2, 3] occurred at 0..2
    propose -> [4, 1]                # the two tokens that followed it

When the earlier occurrence ends close to the end of the context (a loop, a
repeated line), fewer than ``k`` tokens follow it; the proposal then continues
the repetition with its period (``periodic=True``), so a loop still yields a
full-depth proposal::

    tokens = [5, 6, 7, 5, 6]         # [5, 6] occurred at 0..1, period 3
    propose k=5 -> [7, 5, 6, 7, 5]   # (periodic=False: [7, 5, 6])

How far to trust a match depends on its length: on the bundled pair's greedy
outputs a max_n (4-token) match's continuation is still right at position 16
about half of the time, a 1-token match's at position 5 under 10% of the time.
So a proposal from a match shorter than ``max_n`` is capped at
``weak_match_depth`` tokens, while a full-length match may use the whole depth
the request allows (which is what makes depths of 8-16 pay).

The search is vectorised with numpy over a window of the most recent
``window`` tokens: one comparison per n-gram offset (``max_n`` of them), a
running AND gives the match length ending at every position, and the answer is
the latest position with the longest match. Tokens are kept per sequence in a
growing numpy buffer, so each step only converts the newly generated tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specdec.base import Proposal, ProposalRequest
from specdec.errors import ProposerConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NgramConfig:
    min_n: int = 1  # shortest suffix n-gram to match
    max_n: int = 4  # longest suffix n-gram to match
    window: int = 4096  # search only the last `window` tokens (bounds the cost per step)
    # Continue a match that runs into the end of the context with its period (a loop).
    periodic: bool = True
    # Cap on proposals from matches shorter than max_n (None = no cap).
    weak_match_depth: int | None = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ProposerConfigError(
                f"ngram: expected 1 <= min_n <= max_n, got min_n={self.min_n} max_n={self.max_n}")
        if self.weak_match_depth is not None and self.weak_match_depth < 1:
            raise ProposerConfigError(
                f"ngram: weak_match_depth must be >= 1 or None, got {self.weak_match_depth}")
        if self.window <= self.max_n:
            raise ProposerConfigError(
                f"ngram: window must exceed max_n ({self.max_n}), got {self.window}")


def find_ngram_proposal(tokens: np.ndarray, min_n: int, max_n: int, k: int,
                        periodic: bool = False, weak_match_depth: int | None = None
                        ) -> np.ndarray:
    """The up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix.

    ``tokens`` is a 1-D integer array (the search window). Returns an empty array
    when no suffix of length ``min_n`` or more occurs earlier. With ``periodic``,
    a continuation shorter than ``k`` (it reaches the end of ``tokens``) repeats
    cyclically up to ``k`` tokens. A match shorter than ``max_n`` proposes at most
    ``weak_match_depth`` tokens.

    >>> find_ngram_proposal(np.array([1, 2, 3, 4, 1, 2, 3]), 1, 3, 2).tolist()
    [4, 1]
    >>> find_ngram_proposal(np.array([5, 6, 7, 5, 6]), 1, 3, 5, periodic=True).tolist()
    [7, 5, 6, 7, 5]
    """
    length = int(tokens.shape[0])
    if k <= 0 or length <= min_n:
        return tokens[:0]
    # A candidate occurrence ends at position j in [0, length - 2]: at least one token follows it.
    ends = length - 1
    match_len = np.zeros(ends, dtype=np.int32)  # [ends] match length ending at each j
    alive = np.ones(ends, dtype=bool)  # [ends] still matching at this offset
    for d in range(min(max_n, length - 1)):
        # Compare tokens[j - d] with the suffix token tokens[length - 1 - d], for j >= d.
        eq = np.zeros(ends, dtype=bool)
        eq[d:] = tokens[: ends - d] == tokens[length - 1 - d]
        alive &= eq
        if not alive.any():
            break
        match_len += alive
    best = int(match_len.max(initial=0))
    if best < min_n:
        return tokens[:0]
    j = int(ends - 1 - np.argmax(match_len[::-1] == best))  # latest end with the longest match
    if weak_match_depth is not None and best < max_n:
        k = min(k, weak_match_depth)
    follow = tokens[j + 1 : j + 1 + k]
    if periodic and follow.shape[0] < k:
        # NOTE: the occurrence ends P = length - 1 - j tokens before the suffix does, so the
        # context already repeats with period P; predict that the repetition goes on.
        follow = np.resize(follow, k)  # cyclic repeat of tokens[j + 1 :]
    return follow


class _TokenBuffer:
    """Tokens of one sequence in a growing numpy array, appended incrementally."""

    __slots__ = ("data", "size")

    def __init__(self) -> None:
        self.data = np.empty(256, dtype=np.int64)
        self.size = 0

    def sync(self, token_ids: Sequence[int]) -> np.ndarray:
        n = len(token_ids)
        if n < self.size or (self.size and self.data[self.size - 1] != token_ids[self.size - 1]):
            # NOTE: the sequence was rewritten (preemption with a different history, reuse of
            # a seq_id): start over rather than propose from stale tokens.
            self.size = 0
        if n > self.data.shape[0]:
            grown = np.empty(max(n, 2 * self.data.shape[0]), dtype=np.int64)
            grown[: self.size] = self.data[: self.size]
            self.data = grown
        if n > self.size:
            self.data[self.size : n] = token_ids[self.size : n]
            self.size = n
        return self.data[:n]


class NgramProposer:
    """Prompt-lookup proposer over prompt + generated tokens (implements ``Proposer``)."""

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()
        self._buffers: dict[int, _TokenBuffer] = {}

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        return [self._propose_one(r) for r in requests]

    def _propose_one(self, request: ProposalRequest) -> Proposal:
        if request.depth <= 0:
            return Proposal(request.seq_id, [])
        buffer = self._buffers.get(request.seq_id)
        if buffer is None:
            buffer = self._buffers[request.seq_id] = _TokenBuffer()
        tokens = buffer.sync(request.token_ids)[-self.config.window :]
        c = self.config
        found = find_ngram_proposal(tokens, c.min_n, c.max_n, request.depth, c.periodic,
                                    c.weak_match_depth)
        return Proposal(request.seq_id, found.tolist())

    def commit(self, seq_id: int, num_accepted: int) -> None:
        # Stateless between steps apart from the token buffer, which the next
        # propose() brings up to date from the request's token_ids.
        return None

    def release(self, seq_id: int) -> None:
        self._buffers.pop(seq_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._buffers)
