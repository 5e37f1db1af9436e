"""Continuous batching: which sequences run this step, with how many tokens each.

Every step, running sequences come first (oldest first): a decoding sequence
gets its last token plus its speculative proposal, a prefilling one the next
chunk of its prompt, all under ``max_num_batched_tokens`` (chunked prefill).
Then waiting sequences join while the token budget, ``max_num_seqs`` and free
KV blocks allow. When a running sequence needs a block and none is free, the
newest running sequence is preempted: its blocks are freed and it goes back to
the front of the queue to be recomputed later. No request is ever dropped.

With ``enable_prefix_caching`` a sequence admitted with nothing computed first
takes the longest run of cached full blocks of its tokens (engine.kv_cache)
and starts computing after them, always leaving at least its last token to
compute (the step must produce logits). A block is registered in the cache
only once committed tokens cover it entirely: after its prefill, after a
decode fills it, and when the sequence is freed (finish, preemption, drain).
NOTE: speculative decoding writes K/V for draft positions that may be
rejected; those lie at or past ``num_computed``, which counts committed
tokens only, so a registered block never holds a rejected draft's K/V.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.kv_cache import BlockAllocator, blocks_needed, extend_block_hashes
from engine.pacing import PrefillBudget, PrefillPacer
from engine.sequence import Sequence, Status
from polyinfer.config import EngineConfig
from specdec.base import Proposal

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens of seq.token_ids fed this step, from seq.num_computed on
    drafts: list[int]  # speculative tokens fed after them (decode only)
    draft_probs: torch.Tensor | None = None  # [len(drafts), vocab] draft distribution, or None

    @property
    def q_len(self) -> int:
        return self.num_new + len(self.drafts)

    @property
    def samples(self) -> bool:
        """This step reaches the end of the known tokens, so it yields new ones."""
        return self.seq.num_computed + self.num_new == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_prefix_queries: int = 0  # tokens of first-time admissions looked up in the cache
    num_prefix_hits: int = 0  # of which found cached
    paced: bool = False  # a prompt chunk got fewer tokens than it asked for (engine.pacing)

    @property
    def num_tokens(self) -> int:
        return sum(s.q_len for s in self.scheduled)


def _scheduled(seq: Sequence, num_new: int, prop: Proposal | None,
               num_drafts: int) -> ScheduledSeq:
    if prop is None or num_drafts == 0:
        return ScheduledSeq(seq, num_new, [])
    probs = prop.probs[:num_drafts] if prop.probs is not None else None
    return ScheduledSeq(seq, num_new, prop.tokens[:num_drafts], probs)


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: BlockAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pacer = PrefillPacer()  # fitted afresh per build: a reload changes step costs

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)
        if seq.params.slo_tpot_s is not None or seq.params.slo_ttft_s is not None:
            self.pacer.engaged = True

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self._free(seq)

    def drain(self) -> list[Sequence]:
        """Take every sequence out (running ones reset for recompute), in priority order."""
        seqs = self.running + list(self.waiting)
        for seq in seqs:
            self._free(seq)
            seq.num_computed = 0
            seq.status = Status.WAITING
        self.running, self.waiting = [], deque()
        return seqs

    def schedule(self, proposals: dict[int, Proposal]) -> SchedulerOutput:
        """Pick this step's sequences; ``proposals`` holds drafts of decoding sequences."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        paced = self._prefill_budget(proposals)
        budget = self._schedule_running(proposals, budget, out, paced)
        if not out.preempted:
            self._admit_waiting(budget, out, paced)
        out.paced = paced is not None and paced.paced
        return out

    def _prefill_budget(self, proposals: dict[int, Proposal]) -> PrefillBudget | None:
        """What the decodes' TPOT SLOs leave for prompt chunks this step; None: no limit."""
        if not self.pacer.engaged:  # no request has named an SLO: nothing to look at
            return None
        decoding, prefill = [], bool(self.waiting)
        for seq in self.running:
            if seq.num_tokens - seq.num_computed == 1:
                prop = proposals.get(seq.seq_id)
                decoding.append((seq, 1 + (len(prop.tokens) if prop is not None else 0)))
            else:
                prefill = True
        if not prefill or not any(seq.params.slo_tpot_s is not None for seq, _ in decoding):
            return None
        return self.pacer.budget(decoding, time.monotonic())

    def trim_blocks(self, seq: Sequence) -> None:
        """Free blocks past the sequence's tokens (rejected speculative positions)."""
        keep = blocks_needed(seq.num_tokens, self.config.block_size)
        if len(seq.block_table) > keep:
            self.allocator.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def _schedule_running(self, proposals: dict[int, Proposal], budget: int,
                          out: SchedulerOutput, paced: PrefillBudget | None) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = seq.num_tokens - seq.num_computed
            prop = proposals.get(seq.seq_id) if num_new == 1 else None
            num_drafts = len(prop.tokens) if prop is not None else 0
            q_len = min(num_new + num_drafts, budget)
            if paced is not None and num_new > 1:
                q_len = paced.take(seq, seq.num_computed, q_len)
                if q_len == 0:  # a prompt chunk held back; the decodes after it still run
                    i += 1
                    continue
            if not self._reserve(seq, q_len, out):
                break  # seq itself was preempted: it was the last one running
            out.scheduled.append(_scheduled(seq, min(num_new, q_len), prop,
                                            max(q_len - num_new, 0)))
            budget -= q_len
            i += 1
        return budget

    def _reserve(self, seq: Sequence, q_len: int, out: SchedulerOutput) -> bool:
        """Blocks for ``q_len`` more tokens, preempting from the back if needed.

        A decode also takes the block its next token will need when one is free and no
        request waits for it: the runner launches a decode step ahead only into blocks a
        sequence holds (engine.runner, look-ahead), so without it every ``block_size``-th
        step of a batch ran in series with the host. That block is never taken by
        preempting, and the sequence keeps it (``trim_blocks`` keeps ``num_tokens``'s).
        """
        bs = self.config.block_size
        need = blocks_needed(seq.num_computed + q_len, bs) - len(seq.block_table)
        while not self.allocator.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        if (q_len == 1 and not self.waiting and (seq.num_computed + 1) % bs == 0
                and self.allocator.can_allocate(need + 1)):
            need += 1
        if need > 0:
            seq.block_table.extend(self.allocator.allocate(need))
        return True

    def _admit_waiting(self, budget: int, out: SchedulerOutput,
                       paced: PrefillBudget | None) -> None:
        bs = self.config.block_size
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self._prefix_hits(seq)
            start = seq.num_computed + len(hits) * bs
            q_len = min(seq.num_tokens - start, budget)
            if paced is not None:
                q_len = paced.take(seq, start, q_len)
                if q_len == 0:
                    break
            num_fresh = blocks_needed(start + q_len, bs) - len(seq.block_table) - len(hits)
            # NOTE: taking an unreferenced cached block removes it from the allocatable pool
            if not self.allocator.can_allocate(num_fresh + self.allocator.num_evictable(hits)):
                break
            self.waiting.popleft()
            self._take_hits(seq, hits, out)
            seq.block_table.extend(self.allocator.allocate(num_fresh))
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, q_len, []))
            budget -= q_len

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks for the start of ``seq``, leaving at least one token to compute."""
        if not self.config.enable_prefix_caching or seq.num_computed or seq.block_table:
            return []
        bs = self.config.block_size
        extend_block_hashes(seq.block_hashes, seq.token_ids, bs)
        return self.allocator.lookup(seq.block_hashes[:(seq.num_tokens - 1) // bs])

    def _take_hits(self, seq: Sequence, hits: list[int], out: SchedulerOutput) -> None:
        self.allocator.take(hits)
        seq.block_table.extend(hits)
        seq.num_cached_blocks = len(hits)
        seq.num_computed += len(hits) * self.config.block_size
        if seq.num_cached_tokens is None:  # first admission; a preempted one is not counted
            seq.num_cached_tokens = seq.num_computed
            if self.config.enable_prefix_caching:
                out.num_prefix_queries += seq.num_tokens
                out.num_prefix_hits += seq.num_computed

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that committed tokens now cover entirely."""
        if not self.config.enable_prefix_caching:
            return
        bs = self.config.block_size
        # NOTE: num_computed can pass num_tokens for a step that stopped inside its accepted
        # drafts; only positions of tokens the sequence kept have hashes.
        num_full = min(seq.num_computed, seq.num_tokens) // bs
        if num_full <= seq.num_cached_blocks:
            return
        extend_block_hashes(seq.block_hashes, seq.token_ids, bs)
        for i in range(seq.num_cached_blocks, num_full):
            self.allocator.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_cached_blocks = num_full

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        logger.debug("preempted seq %d (%d tokens) for recompute", seq.seq_id, seq.num_tokens)

    def _free(self, seq: Sequence) -> None:
        """Release the blocks of ``seq``; computed full ones stay findable in the cache."""
        if seq.block_table:
            self.cache_blocks(seq)
            self.allocator.free(seq.block_table)
            seq.block_table = []
        seq.num_cached_blocks = 0
