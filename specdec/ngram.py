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

NOTE: the caps by match length (``context_depth_caps``, ``pool_depth_caps``) keep a
draft token only where it is accepted often enough to pay for its verification
row. On the 2-core CPU box a verified row costs ~0.1-0.14 of a one-row step and
speculation runs at ~1.5-2 tokens per step-time, so a token pays when P(accepted)
exceeds ~0.2. Measured on the bundled pair's greedy outputs of 80 Spec-Bench
prompts held out from the benchmark's selections (every output position, depth 16,
``min_n=1, max_n=4``), P(the first i drafted tokens are accepted) for i = 1..6:

    context, 1-token match: .33 .21 .13 .09 .07 .06   -> cap 2
    context, 2-token match: .57 .36 .24 .18 .15 .14   -> cap 3
    context, 3-token match: .60 .40 .30 .25 .22 .18   -> weak_match_depth (4)
    context, 4-token match: .88 .80 .73 .68 .64 .61   (.42 at 16) -> no cap
    pool,    1-token match: .11 .04 .02 ...            -> 0 (no proposal)
    pool,    2-token match: .33 .09 .05 ...            -> 1
    pool,    3-token match: .34 .18 .10 ...            -> 1
    pool,    4-token match: .58 .36 .24 .18 .14 .11   -> 3

Replayed step by step over those outputs under that cost model, the caps gave
5-8% more tokens per unit of step time on the repetitive domains at depths 8-16.
Where a verify row costs next to nothing (a GPU replaying CUDA graphs: ~0.3% of a
batch-1 step per row) every such token pays, and the engine lifts the caps there
(``EngineConfig.ngram_caps``; on the H200 the repetitive group went from 2.08x to 2.22x
over depth 0 at depth 16).

The proposer also keeps the outputs of the requests it served before
(:mod:`specdec.pool`) and proposes from them when the context's own match is
shorter than one found there: the bundled model's answers to different prompts
share much of their phrasing (offline on its greedy outputs, 2.5 -> 3.0-3.4
tokens per step at depth 16 on the repetitive domains).

:func:`find_ngram_proposal` is the reference search, vectorised with numpy
over a window of the most recent ``window`` tokens: one comparison per n-gram
offset (``max_n`` of them), a running AND gives the match length ending at
every position, and the answer is the latest position with the longest match.

NOTE: the proposer itself answers the same question from an index kept per
sequence (:class:`_SuffixIndex`): the latest end position of every n-gram of
length ``min_n .. max_n``, updated with each step's new tokens. A lookup is
``max_n`` dictionary probes instead of a pass over the window (about 15 us a
step instead of ~250 us at a few hundred tokens of context); the index holds
``max_n - min_n + 1`` entries per token (~0.8 KB per token at the defaults,
a tenth of the tiny model's KV cache per token).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specdec.base import Proposal, ProposalRequest
from specdec.errors import ProposerConfigError
from specdec.pool import OutputPool

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
    # Outputs of finished requests kept for cross-request lookup (specdec.pool); 0 = off.
    pool_tokens: int = 16384
    # Caps by match length (entry m - 1 caps a match of m tokens; longer ones: no cap from
    # here), for matches in the context and in the pool; see the NOTE in the module docstring.
    context_depth_caps: tuple[int, ...] = (2, 3)
    pool_depth_caps: tuple[int, ...] = (0, 1, 1, 3)

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ProposerConfigError(
                f"ngram: expected 1 <= min_n <= max_n, got min_n={self.min_n} max_n={self.max_n}")
        if self.weak_match_depth is not None and self.weak_match_depth < 1:
            raise ProposerConfigError(
                f"ngram: weak_match_depth must be >= 1 or None, got {self.weak_match_depth}")
        if self.pool_tokens < 0:
            raise ProposerConfigError(f"ngram: pool_tokens must be >= 0, got {self.pool_tokens}")
        if self.window <= self.max_n:
            raise ProposerConfigError(
                f"ngram: window must exceed max_n ({self.max_n}), got {self.window}")
        for name in ("context_depth_caps", "pool_depth_caps"):
            caps = getattr(self, name)
            if not all(isinstance(c, int) and c >= 0 for c in caps):
                raise ProposerConfigError(f"ngram: {name} must be ints >= 0, got {caps!r}")


def find_ngram_proposal(tokens: np.ndarray, min_n: int, max_n: int, k: int,
                        periodic: bool = False, weak_match_depth: int | None = None,
                        depth_caps: Sequence[int] = ()) -> np.ndarray:
    """The up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix.

    ``tokens`` is a 1-D integer array (the search window). Returns an empty array
    when no suffix of length ``min_n`` or more occurs earlier. With ``periodic``,
    a continuation shorter than ``k`` (it reaches the end of ``tokens``) repeats
    cyclically up to ``k`` tokens. A match shorter than ``max_n`` proposes at most
    ``weak_match_depth`` tokens, and a match of ``m <= len(depth_caps)`` tokens at most
    ``depth_caps[m - 1]``.

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
    if best <= len(depth_caps):
        k = min(k, depth_caps[best - 1])
    follow = tokens[j + 1 : j + 1 + k]
    if periodic and follow.shape[0] < k:
        # NOTE: the occurrence ends P = length - 1 - j tokens before the suffix does, so the
        # context already repeats with period P; predict that the repetition goes on.
        follow = np.resize(follow, k)  # cyclic repeat of tokens[j + 1 :]
    return follow


class _SuffixIndex:
    """One sequence's tokens and, per n-gram length, the latest end of every n-gram.

    An end ``j`` is indexed once a token follows it (``j <= len(tokens) - 2``), so the
    context's own suffix is never its own match.
    """

    __slots__ = ("latest", "max_n", "min_n", "tokens")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]  # [n]

    def sync(self, token_ids: Sequence[int]) -> None:
        size, n = len(self.tokens), len(token_ids)
        if n < size or (size and token_ids[size - 1] != self.tokens[size - 1]):
            # NOTE: the sequence was rewritten (preemption with a different history, reuse of
            # a seq_id): start over rather than propose from stale tokens.
            self.tokens = []
            self.latest = [{} for _ in range(self.max_n + 1)]
            size = 0
        self.tokens.extend(token_ids[size:n])
        tokens = self.tokens
        for j in range(max(size - 1, 0), n - 1):
            for m in range(self.min_n, min(self.max_n, j + 1) + 1):
                self.latest[m][tuple(tokens[j - m + 1 : j + 1])] = j

    def lookup(self, k: int, window: int, periodic: bool, weak_match_depth: int | None,
               depth_caps: Sequence[int] = ()) -> tuple[int, list[int]]:
        """(match length, proposal): the proposal is what :func:`find_ngram_proposal` returns
        for the last ``window`` tokens, cut to ``depth_caps[m - 1]`` tokens for a match of
        ``m < len(depth_caps)`` tokens; (0, []) without a match."""
        tokens = self.tokens
        length = len(tokens)
        lowest = max(0, length - window)  # first position inside the window
        if k <= 0 or length - lowest <= self.min_n:
            return 0, []
        for m in range(min(self.max_n, length - lowest - 1), self.min_n - 1, -1):
            j = self.latest[m].get(tuple(tokens[length - m :]))
            if j is not None and j - m + 1 >= lowest:
                break
        else:
            return 0, []
        if weak_match_depth is not None and m < self.max_n:
            k = min(k, weak_match_depth)
        if m <= len(depth_caps):
            k = min(k, depth_caps[m - 1])
        follow = tokens[j + 1 : j + 1 + k]
        if periodic and len(follow) < k:
            period = length - 1 - j  # the context repeats with this period: continue it
            follow = [tokens[j + 1 + i % period] for i in range(k)]
        return m, follow


@dataclass
class _SeqState:
    index: _SuffixIndex
    num_prompt_tokens: int  # 0 = unknown: the output is not pooled
    prompt_key: int | None  # hash of the prompt tokens (specdec.pool)


class NgramProposer:
    """Prompt-lookup proposer over prompt + generated tokens (implements ``Proposer``).

    With ``pool_tokens > 0`` it also searches the outputs of the requests it served
    before (:class:`specdec.pool.OutputPool`) when the context's own match is shorter.
    """

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()
        self._indexes: dict[int, _SeqState] = {}
        c = self.config
        self._pool = OutputPool(c.pool_tokens, c.min_n, c.max_n) if c.pool_tokens else None
        self._unpooled: list[tuple[int, list[int]]] = []  # (prompt key, output) not yet added
        self._num_unpooled = 0  # their tokens

    @property
    def pool(self) -> OutputPool | None:
        """The output pool, with every released output in it."""
        self.flush_pool()
        return self._pool

    def flush_pool(self) -> None:
        """Index the outputs released since the last call (see :meth:`release`)."""
        if self._pool is None:
            return
        for key, tokens in self._unpooled:
            self._pool.add(key, tokens)
        self._unpooled.clear()
        self._num_unpooled = 0

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        if self._unpooled:
            self.flush_pool()
        return [self._propose_one(r) for r in requests]

    def prepare(self, request: ProposalRequest) -> None:
        """Index ``request``'s tokens now, ahead of its first :meth:`propose` (the engine
        calls this while the GPU runs a step; see ``EngineCore._overlap_proposer_work``)."""
        self._synced(request)

    def _synced(self, request: ProposalRequest) -> _SeqState:
        state = self._indexes.get(request.seq_id)
        if state is None:
            state = self._indexes[request.seq_id] = self._new_state(request)
        state.index.sync(request.token_ids)
        return state

    def _propose_one(self, request: ProposalRequest) -> Proposal:
        if request.depth <= 0:
            return Proposal(request.seq_id, [])
        c = self.config
        state = self._synced(request)
        length, tokens = state.index.lookup(request.depth, c.window, c.periodic,
                                            c.weak_match_depth, c.context_depth_caps)
        return Proposal(request.seq_id, self._pooled(state, request.depth, length, tokens))

    def _pooled(self, state: _SeqState, depth: int, length: int, tokens: list[int]) -> list[int]:
        """The pool's proposal when it holds a longer match than the context's ``length``
        (below ``max_n``), else the context's ``tokens``."""
        c = self.config
        if self._pool is None or length >= c.max_n:
            return tokens
        pooled = self._pool.lookup(state.index.tokens, state.prompt_key, length, depth,
                                   c.weak_match_depth, c.pool_depth_caps)
        return pooled or tokens

    def _new_state(self, request: ProposalRequest) -> _SeqState:
        c = self.config
        num_prompt = request.num_prompt_tokens
        key = hash(tuple(request.token_ids[:num_prompt])) if num_prompt > 0 else None
        return _SeqState(_SuffixIndex(c.min_n, c.max_n), num_prompt, key)

    def commit(self, seq_id: int, num_accepted: int) -> None:
        # Stateless between steps apart from the token buffer, which the next
        # propose() brings up to date from the request's token_ids.
        return None

    def release(self, seq_id: int) -> None:
        """Forget ``seq_id``; its output joins the pool before the next :meth:`propose`.

        NOTE: indexing an output costs ~0.6 ms per 128 tokens (and ~100 ms when the pool
        rebuilds its index, once per pool's worth of outputs); done here, it lands in the
        step that finishes the request, before its last tokens are sent. The engine calls
        :meth:`flush_pool` when it is idle; :meth:`propose` and :attr:`pool` flush first,
        so every proposal sees exactly the pool it saw before.
        """
        state = self._indexes.pop(seq_id, None)
        if state is None or self._pool is None or state.prompt_key is None:
            return
        output = state.index.tokens[state.num_prompt_tokens:]
        self._unpooled.append((state.prompt_key, output))
        self._num_unpooled += len(output)
        if self._num_unpooled > self._pool.max_tokens:  # never idle: bound what waits
            self.flush_pool()

    @property
    def num_tracked(self) -> int:
        return len(self._indexes)
