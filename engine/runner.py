"""One model step: scheduled sequences -> flat batch -> forward -> new tokens per sequence.

Sequences that reach the end of their known tokens this step are sampled:
with no speculative tokens anywhere in the batch the plain sampler
(``polyinfer.sampling.sample``) runs on one logits row per sequence; otherwise
every sampled sequence gets ``k_i + 1`` rows and ``specdec.verify.verify``
accepts a prefix of each proposal (k_i = 0 rows behave like plain sampling).
When every sampled sequence is greedy (on the CPU), the forward stops at the
hidden states and ``specdec.verify.verify_greedy_in_waves`` projects to the
vocabulary only the rows it reads (up to each proposal's first rejection).

With captured graphs (``execution: cuda_graph``) a step whose tokens fit the
largest bucket runs as ``sum(q_len)`` decode rows through
:class:`engine.cuda_graph.CudaGraphDecoder`: a decoding sequence is ``k + 1``
rows, a prefill chunk one row per prompt token (mixed steps included); the
``[rows, vocab]`` logits stay on the device, the sampling rows are picked there,
and the same ``verify`` accepts from them (greedy: one argmax over those rows,
one device-to-host copy).

A graph step of plain decodes launches the next one before it reads its own tokens
back (:meth:`ModelRunner._look_ahead`): the sampled ids go from the sampler to the
next replay's inputs on the device, so the host's read-back, append, detokenize and
schedule run while the GPU computes. The next step uses it when it schedules the same
decodes (or a subset: rows that finished) and discards it otherwise; outputs are the
same token for token (tests/engine/test_look_ahead.py).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.attention import SeqSlice, build_metadata, order_short_first
from engine.cpu_attention import cpu_attention_for
from engine.cuda_graph import DecodeRow, IdsReadback, RowDecoder, read_rows
from engine.gpu_sampling import argmax_rows, sample_ids
from engine.grammar import mask_rows
from engine.kv_cache import KVCache
from engine.lanes import LaneChooser, Lanes, split_lanes
from engine.model import LlamaModel
from engine.scheduler import ScheduledSeq
from engine.sequence import TokenLogprob
from polyinfer.sampling import Row, sample
from specdec.base import Proposal
from specdec.verify import verify, verify_greedy_in_waves


@dataclass
class LookAhead:
    """A decode step launched before the host read the tokens it decodes (their ids went
    from the sampler to the graph's inputs on the device); its logits are the graphs'
    output until the next run."""

    rows: dict[int, int]  # seq_id -> row of the launched step
    positions: list[int]  # per row: the position its token was fed at
    blocks: list[int]  # per row: the KV block holding that position
    sources: list[int]  # per row: its index among the launching step's sampled rows
    tokens: list[int]  # per row: the token fed, once read back


@dataclass(frozen=True)
class StepResult:
    item: ScheduledSeq
    tokens: list[int]  # new tokens: accepted drafts, then the sampled one
    num_accepted: int  # draft tokens accepted
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asks


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, short_q: int,
                 graphs: RowDecoder | None = None,
                 on_launch: Callable[[], None] | None = None,
                 more_waiting: Callable[[], bool] | None = None) -> None:
        self.model = model
        self.on_launch = on_launch  # called once a graph replay is queued (the GPU is busy)
        # whether requests wait to be admitted: the next step will then not be this step's
        # decodes alone, so none is launched ahead
        self.more_waiting = more_waiting or (lambda: False)
        self.kv = kv
        self.short_q = short_q  # queries up to this length attend in the decode group
        self.num_q_per_kv = model.spec.num_heads // model.spec.num_kv_heads
        self.cpu_attention = None
        if not model.naive_attention:  # naive is the reference path: keep it pure torch
            self.cpu_attention = cpu_attention_for(model.device, model.dtype, kv.block_size)
        self.graphs = graphs  # captured decode steps (execution: cuda_graph)
        # NOTE: with graphs, a step of plain decodes launches the next one before it reads
        # its own tokens back (see _look_ahead); False runs every step in series
        self.look_ahead = True
        self._ahead: LookAhead | None = None  # the step launched ahead, not yet consumed
        self.num_ahead_used = 0  # steps launched ahead and consumed ...
        self.num_ahead_missed = 0  # ... and those the next schedule did not match
        self.lanes = Lanes(1, 1)  # one forward per step until set_lanes
        self.chooser = LaneChooser(1)

    @property
    def graphs(self) -> RowDecoder | None:
        return self._graphs

    @graphs.setter
    def graphs(self, graphs: RowDecoder | None) -> None:
        """Set or swap the captured steps; the pinned readback is sized for them."""
        self._graphs = graphs
        self._ahead = None  # launched on the old graphs: never consumed on the new ones
        self._readback = IdsReadback(graphs.max_rows, self.model.device) if graphs else None

    def execute(self, scheduled: Sequence[ScheduledSeq]) -> list[StepResult]:
        """Run one forward over ``scheduled``; results for the sequences that sampled."""
        if self.graphs is not None and self._graph_can_run(scheduled):
            return self._execute_graph(scheduled)
        if self._ahead is not None:  # a step too large for the graphs: the one ahead is stale
            self._ahead = None
            self.num_ahead_missed += 1
        num_tokens = sum(s.q_len for s in scheduled)
        parts = self._lane_parts(scheduled, self.chooser.lanes_for(num_tokens))
        in_waves = self._verify_in_waves(scheduled)
        t0 = time.perf_counter()
        outs = self.lanes.run([functools.partial(self._forward, part, in_waves)
                               for part in parts])
        if all(s.q_len <= self.short_q for s in scheduled):  # like for like: decode steps
            self.chooser.record(len(parts), num_tokens, time.perf_counter() - t0)
        # NOTE: sampling and verification build small CPU tensors per request; on an
        # accelerator the [N, vocab] logits come back once instead.
        rows = outs[0].cpu() if len(outs) == 1 else torch.cat([o.cpu() for o in outs])
        sampled = [it for part in parts for it in part if it.samples]
        if not sampled:
            return []
        if in_waves:  # rows are hidden states: logits only for the rows verification reads
            return self._verify_greedy(sampled, rows)
        return self._sample(sampled, rows)

    def set_lanes(self, num_lanes: int, threads_per_lane: int) -> None:
        """Run big CPU steps as ``num_lanes`` forwards in parallel (engine.lanes)."""
        self.lanes.close()
        self.lanes = Lanes(num_lanes, threads_per_lane)
        self.chooser = LaneChooser(num_lanes)

    def _lane_parts(self, scheduled: Sequence[ScheduledSeq],
                    num_lanes: int) -> list[list[ScheduledSeq]]:
        """The step's sequences per lane, each lane ordered short-first for attention."""
        contexts = [s.seq.num_computed + s.q_len for s in scheduled]
        parts = []
        for lane in split_lanes([s.q_len for s in scheduled], contexts, num_lanes):
            order = order_short_first([scheduled[i].q_len for i in lane], self.short_q,
                                      [contexts[i] for i in lane])
            parts.append([scheduled[lane[i]] for i in order])
        return parts

    def _verify_in_waves(self, scheduled: Sequence[ScheduledSeq]) -> bool:
        """Greedy verification on the CPU scores rows in waves (verify_greedy_in_waves)."""
        sampled = [it for it in scheduled if it.samples]
        return (torch.device(self.model.device).type == "cpu"
                and any(it.drafts for it in sampled)
                and all(_plain_greedy(it) for it in sampled))

    def _forward(self, items: list[ScheduledSeq], hidden_only: bool = False) -> torch.Tensor:
        """Logits ``[N, vocab]`` (on the model's device) for the sampling rows of ``items``;
        their last hidden states ``[N, hidden]`` with ``hidden_only``."""
        ids: list[int] = []
        slices: list[SeqSlice] = []
        rows: list[int] = []
        for it in items:
            start = it.seq.num_computed
            ids.extend(it.seq.token_ids[start:start + it.num_new])
            ids.extend(it.drafts)
            slices.append(SeqSlice(it.q_len, start, it.seq.block_table))
            if it.samples:
                end = len(ids)
                rows.extend(range(end - len(it.drafts) - 1, end))
        device = self.model.device
        meta = build_metadata(slices, self.kv.block_size, self.num_q_per_kv, self.short_q,
                              device, self.cpu_attention)
        logit_rows = torch.tensor(rows, dtype=torch.long).to(device)
        return self.model.forward(torch.tensor(ids, dtype=torch.long).to(device), meta,
                                  self.kv, logit_rows, hidden_only)

    def _sample(self, sampled: list[ScheduledSeq], logits: torch.Tensor) -> list[StepResult]:
        params = [it.seq.params.sampling for it in sampled]
        if not any(it.drafts for it in sampled):
            tokens = sample(_constrained(sampled, logits), params, _rows_of(sampled)).tolist()
            return with_logprobs(logits, [StepResult(it, [t], 0) for it, t in
                                          zip(sampled, tokens, strict=False)])
        return self._verify(sampled, logits)

    def _verify(self, sampled: list[ScheduledSeq], logits: torch.Tensor) -> list[StepResult]:
        """Accept a prefix of each proposal from ``[sum(k_i + 1), vocab]`` logits (any device)."""
        params = [it.seq.params.sampling for it in sampled]
        proposals = [Proposal(it.seq.seq_id, it.drafts, it.draft_probs) for it in sampled]
        results = verify(_constrained(sampled, logits), proposals, params, _rows_of(sampled),
                         argmax_rows)
        return with_logprobs(logits, [StepResult(it, r.tokens, r.num_accepted)
                                      for it, r in zip(sampled, results, strict=True)])

    def _verify_greedy(self, sampled: list[ScheduledSeq],
                       hidden: torch.Tensor) -> list[StepResult]:
        def score(rows: list[int]) -> list[int]:
            index = torch.tensor(rows, dtype=torch.long)
            argmax: list[int] = self.model.logits(hidden.index_select(0, index)).argmax(
                dim=1).tolist()
            return argmax

        proposals = [Proposal(it.seq.seq_id, it.drafts) for it in sampled]
        results = verify_greedy_in_waves(score, proposals)
        return [StepResult(it, r.tokens, r.num_accepted)
                for it, r in zip(sampled, results, strict=True)]

    def _graph_can_run(self, scheduled: Sequence[ScheduledSeq]) -> bool:
        """The step's rows (prompt chunks, tokens, drafts) fit a bucket."""
        assert self.graphs is not None
        return self.graphs.can_run(sum(it.q_len for it in scheduled))

    def _execute_graph(self, scheduled: Sequence[ScheduledSeq]) -> list[StepResult]:
        """Every sequence's ``q_len`` rows through a captured graph; sampled or verified there.

        A sampling sequence reads its last ``k + 1`` rows; a prompt chunk that does not end
        its prompt reads none (its rows only write K/V). A step the last one launched
        ahead (:meth:`_look_ahead`) is not run again: its logits are already computed.
        """
        assert self.graphs is not None
        logits = self._launched_ahead(scheduled)
        if logits is None:
            logits = self.graphs.run([_rows(it) for it in scheduled])  # [rows, vocab] on device
        if self.on_launch is not None:  # the replay is queued: the GPU is busy from here
            self.on_launch()
        sampled = [it for it in scheduled if it.samples]
        if not sampled:
            return []
        num_read = [len(it.drafts) + 1 if it.samples else 0 for it in scheduled]
        if sum(num_read) < logits.shape[0]:
            keep = read_rows([it.q_len for it in scheduled], num_read)
            logits = logits[torch.tensor(keep).to(logits.device, non_blocking=True)]
        if any(it.drafts for it in sampled):
            return self._verify(sampled, logits)
        params = [it.seq.params.sampling for it in sampled]
        ids = sample_ids(_constrained(sampled, logits), params, _rows_of(sampled))  # [N]
        assert self._readback is not None
        self._readback.start(ids)
        if self.look_ahead and len(sampled) == len(scheduled) and not self.more_waiting():
            self._look_ahead(sampled, ids)
        tokens = self._readback.wait()
        if self._ahead is not None:
            self._ahead.tokens = [tokens[i] for i in self._ahead.sources]
        return with_logprobs(logits, [StepResult(it, [t], 0) for it, t in
                                      zip(sampled, tokens, strict=True)])

    def _look_ahead(self, sampled: list[ScheduledSeq], ids: torch.Tensor) -> None:
        """Launch the next decode step of ``sampled`` now, its tokens ``ids`` [N] fed on the
        device, so the GPU runs it while the host reads this step's tokens, appends them,
        detokenizes and schedules (~0.23 ms a step at batch 1, otherwise in series).

        NOTE: only when every row is a plain decode whose next position lies in a block it
        already holds, and no row reads logits after sampling (logprobs: the launch
        overwrites them) or may propose drafts. A row that finishes this step (EOS, stop,
        length) makes the next schedule a subset: its logits are unused and its K/V went
        to a slot of its own block, not full, so never in the prefix cache, that a later
        owner writes before it reads. Any other change of schedule discards the step.
        """
        assert self.graphs is not None
        bs = self.kv.block_size
        rows, keep = [], []
        for i, it in enumerate(sampled):
            seq = it.seq
            if it.drafts or seq.params.logprobs is not None or seq.params.spec_depth > 0:
                return
            if seq.num_output_tokens + 1 >= seq.params.max_tokens:
                continue  # this step's token ends it: nothing to look ahead for
            pos = seq.num_computed + it.num_new  # where this step's token goes
            if pos // bs >= len(seq.block_table) or pos + 1 >= self.graphs.max_positions:
                return  # its next block is not allocated yet
            rows.append(DecodeRow(0, pos, seq.block_table))
            keep.append(i)
        if not rows:
            return
        feed = ids if len(keep) == len(sampled) else ids[torch.tensor(keep).to(ids.device)]
        self.graphs.run(rows, tokens=feed)
        self._ahead = LookAhead({sampled[i].seq.seq_id: r for r, i in enumerate(keep)},
                                [r.position for r in rows],
                                [r.block_table[r.position // bs] for r in rows], keep, [])

    def _launched_ahead(self, scheduled: Sequence[ScheduledSeq]) -> torch.Tensor | None:
        """The logits of ``scheduled`` if the last step launched exactly these decodes (or a
        subset of them) ahead; None (and the launch discarded) otherwise."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        assert self.graphs is not None
        index = []
        for it in scheduled:
            seq = it.seq
            r = ahead.rows.get(seq.seq_id)
            if (r is None or it.num_new != 1 or it.drafts or not it.samples
                    or seq.num_computed != ahead.positions[r]
                    or seq.token_ids[seq.num_computed] != ahead.tokens[r]
                    or seq.block_table[seq.num_computed // self.kv.block_size] != ahead.blocks[r]):
                self.num_ahead_missed += 1
                return None
            index.append(r)
        self.num_ahead_used += 1
        out = self.graphs.output(len(ahead.positions))
        if index == list(range(len(ahead.positions))):
            return out
        return out[torch.tensor(index).to(out.device, non_blocking=True)]


def _plain_greedy(item: ScheduledSeq) -> bool:
    """Greedy, unadjusted, unconstrained and without logprobs: an argmax of its rows is all
    it needs."""
    p = item.seq.params
    return (p.sampling.greedy and not p.sampling.adjusts and p.logprobs is None
            and p.grammar is None)


def _constrained(sampled: Sequence[ScheduledSeq], logits: torch.Tensor) -> torch.Tensor:
    """The step's sampling rows with each constrained sequence's grammar mask applied
    (engine.grammar), at its drafts' positions too, so verification accepts from the
    masked distribution as plain decoding samples from it; logprobs still read the
    model's own logits, as vLLM's default."""
    if all(it.seq.grammar is None for it in sampled):
        return logits
    return mask_rows(logits, [it.seq.grammar for it in sampled],
                     [it.drafts for it in sampled])


def _rows_of(sampled: Sequence[ScheduledSeq]) -> list[Row] | None:
    """Each sampled sequence's :class:`~polyinfer.sampling.Row` (its next position and,
    for penalised requests, its history); None when no request needs one."""
    if not any(it.seq.params.sampling.adjusts or it.seq.params.sampling.keyed
               for it in sampled):
        return None
    rows = []
    for it in sampled:
        seq = it.seq
        if seq.params.sampling.adjusts:
            rows.append(Row(seq.num_tokens, seq.token_ids[:seq.num_prompt_tokens],
                            seq.output_ids))
        else:
            rows.append(Row(seq.num_tokens))
    return rows


def with_logprobs(logits: torch.Tensor, results: list[StepResult]) -> list[StepResult]:
    """``results`` with their tokens' logprobs for the requests that ask for them.

    ``logits`` are the step's sampling rows, ``len(drafts) + 1`` per result in order;
    token j of a result was sampled at its row j. One log-softmax over the rows read,
    one copy to the host.
    """
    wanted = [i for i, r in enumerate(results) if r.item.seq.params.logprobs is not None]
    if not wanted:
        return results
    starts = list(itertools.accumulate((len(r.item.drafts) + 1 for r in results), initial=0))
    index = [starts[i] + j for i in wanted for j in range(len(results[i].tokens))]
    chosen = [t for i in wanted for t in results[i].tokens]
    dev = logits.device
    lp = torch.log_softmax(logits[torch.tensor(index, device=dev)].float(), dim=1)
    picked = lp.gather(1, torch.tensor(chosen, device=dev).unsqueeze(1)).squeeze(1).tolist()
    num_top = max(results[i].item.seq.params.logprobs or 0 for i in wanted)
    top_lp: list[list[float]] = []
    top_ids: list[list[int]] = []
    if num_top:
        top = lp.topk(num_top, dim=1)
        top_lp, top_ids = top.values.tolist(), top.indices.tolist()
    out, row = list(results), 0
    for i in wanted:
        r = results[i]
        k = r.item.seq.params.logprobs or 0
        lps = []
        for t in r.tokens:
            alts = tuple(zip(top_ids[row][:k], top_lp[row][:k], strict=True)) if k else ()
            lps.append(TokenLogprob(t, picked[row], alts))
            row += 1
        out[i] = StepResult(r.item, r.tokens, r.num_accepted, lps)
    return out


def _rows(item: ScheduledSeq) -> DecodeRow:
    """``item``'s new tokens (its chunk, or its last committed token) then its drafts."""
    seq, start = item.seq, item.seq.num_computed
    if item.num_new == 1:
        return DecodeRow(seq.token_ids[start], start, seq.block_table, item.drafts)
    return DecodeRow.chunk(seq.token_ids[start:start + item.num_new] + item.drafts, start,
                           seq.block_table)
