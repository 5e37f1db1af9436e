"""The draft model's runner: a second :class:`engine.model.LlamaModel` with its own KV cache.

The proposal logic (rounds, confidence cut, sampled drafts) is
:class:`specdec.draft.DraftProposer`; this module is the :class:`specdec.draft.DraftModel`
it drives: the draft's weights, its paged :class:`engine.kv_cache.KVCache`, the
attention metadata of each round and, on CUDA, its captured graphs.

After a proposal the draft cache holds K/V for ``history + d_1 .. d_{k-1}``.
:meth:`DraftModelRunner.commit` keeps ``history + d_1 .. d_min(n, k-1)`` and
rolls the rest back (positions are simply marked invalid; the next write
overwrites them and attention masks by position). ``prepare`` also re-checks
the cached ids against the engine's history, so a skipped commit (the scheduler
dropped a proposal) can never make the draft attend to stale tokens.

With ``execution: cuda_graph`` the rounds replay captured graphs of the draft
(:class:`engine.cuda_graph.CudaGraphDecoder` over the draft model and its cache: a
round is one :class:`~engine.cuda_graph.DecodeRow` chunk per sequence, its fed
tokens), and greedy rows pick their token on the device, so a round copies back
token ids, not logits. NOTE: on the H200 an eager round of the 2-layer draft cost
~6 ms of host time (metadata built on the host, ~60 small launches, a sync), 40x a
replay of the 8-layer target; a round too large for the biggest bucket (a long
prompt's first catch-up) still runs eager.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.attention import SeqSlice, build_metadata, order_short_first
from engine.checkpoint import load_weights, read_spec
from engine.cpu_attention import cpu_attention_for
from engine.cuda_graph import CudaGraphDecoder, DecodeRow, RowDecoder
from engine.kv_cache import BlockAllocator, KVCache, blocks_needed
from engine.model import LlamaModel
from polyinfer.config import MODELS_DIR, EngineConfig
from specdec.base import ProposalRequest
from specdec.draft import DraftProposer, Round
from specdec.errors import ProposerConfigError

logger = logging.getLogger(__name__)

EXECUTIONS = ("eager", "cuda_graph")

# Builds the row decoder of a draft model over its cache (the graphs, or their forward
# uncaptured in tests); None runs every round eager.
DecoderFactory = Callable[[LlamaModel, KVCache], RowDecoder]


@dataclass(frozen=True)
class DraftConfig:
    model_dir: str  # draft checkpoint (HF Llama format), same tokenizer as the target
    dtype: str = "float32"
    device: str = "cpu"
    kv_cache_tokens: int = 32768  # draft KV capacity, summed over sequences
    block_size: int = 16
    max_model_len: int = 2048  # longest history + depth the draft will see
    short_q: int = 8  # query length up to which sequences attend in the decode group
    # Stop a sequence's drafting at a token whose draft probability is below this (0 = never).
    min_confidence: float = 0.0
    execution: str = "eager"  # "cuda_graph": rounds replay captured graphs (CUDA only)
    max_batch: int = 32  # sequences drafting at once (the graphs' batch buckets)
    max_tokens: int = 1024  # rows of the largest catch-up round run from a graph

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ProposerConfigError("draft.model_dir: expected a checkpoint path, got ''")
        if self.execution not in EXECUTIONS:
            raise ProposerConfigError(
                f"draft.execution: expected one of {EXECUTIONS}, got {self.execution!r}")
        if self.execution == "cuda_graph" and not self.device.startswith("cuda"):
            raise ProposerConfigError(
                f"draft.execution: 'cuda_graph' needs a CUDA device, got {self.device!r}")
        for name in ("kv_cache_tokens", "block_size", "max_model_len", "short_q", "max_batch",
                     "max_tokens"):
            if getattr(self, name) <= 0:
                raise ProposerConfigError(
                    f"draft.{name}: expected a positive integer, got {getattr(self, name)!r}")
        if not 0.0 <= self.min_confidence < 1.0:
            raise ProposerConfigError(
                f"draft.min_confidence: expected a value in [0, 1), got {self.min_confidence!r}")
        if self.kv_cache_tokens < self.block_size:
            raise ProposerConfigError(
                f"draft.kv_cache_tokens: expected >= block_size ({self.block_size}), "
                f"got {self.kv_cache_tokens}")


@dataclass
class _DraftSeq:
    """One sequence's draft-cache state."""

    block_table: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # token at each position whose K/V is written
    num_history: int = 0  # len(token_ids) at the last propose: positions known to match


def resolve_model_dir(path: str) -> Path:
    """A draft path as given, else relative to the folder that holds the bundled ``models/``
    (configs name ``models/tiny-draft``): the checkout, or the installed package."""
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    return MODELS_DIR.parent / p


class DraftModelRunner:
    """The draft model over its own paged KV cache (implements ``specdec.draft.DraftModel``)."""

    def __init__(self, model: LlamaModel, config: DraftConfig,
                 decoder: DecoderFactory | None = None) -> None:
        self.model = model
        self.config = config
        num_blocks = config.kv_cache_tokens // config.block_size
        self.kv = model.new_kv_cache(num_blocks, config.block_size)
        if decoder is None and config.execution == "cuda_graph":
            decoder = functools.partial(capture_graphs, config=config)
        # built on the fresh cache: capturing writes its dummy rows into block 0
        self.graphs = decoder(model, self.kv) if decoder is not None else None
        self.allocator = BlockAllocator(num_blocks)
        self._seqs: dict[int, _DraftSeq] = {}
        self._num_q_per_kv = model.spec.num_heads // model.spec.num_kv_heads
        # NOTE: the engine's fused CPU paged-attention kernel (float32 on the CPU; None
        # elsewhere or if it cannot be built): every draft round is a short-query step.
        self._kernel = cpu_attention_for(model.device, model.dtype, config.block_size)

    @classmethod
    def load(cls, config: DraftConfig, target_vocab: int | None = None,
             decoder: DecoderFactory | None = None) -> DraftModelRunner:
        model_dir = resolve_model_dir(config.model_dir)
        spec = read_spec(model_dir)
        if target_vocab is not None and spec.vocab_size != target_vocab:
            raise ProposerConfigError(
                f"draft {model_dir}: vocab {spec.vocab_size} differs from the target's "
                f"{target_vocab}; draft and target must share a tokenizer")
        weights = load_weights(model_dir, spec.num_layers)
        model = LlamaModel(spec, weights, config.dtype, config.device,
                           max_positions=config.max_model_len + 1)
        logger.info("draft model %s: %d layers, kv %d tokens", model_dir, spec.num_layers,
                    config.kv_cache_tokens)
        return cls(model, config, decoder)

    @property
    def vocab_size(self) -> int:
        return self.model.spec.vocab_size

    def commit(self, seq_id: int, num_accepted: int) -> None:
        """Keep history + the first ``num_accepted`` drafts that were written; drop the rest."""
        state = self._seqs.get(seq_id)
        if state is not None:
            del state.ids[state.num_history + max(num_accepted, 0):]

    def release(self, seq_id: int) -> None:
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            self.allocator.free(state.block_table)

    @property
    def num_tracked(self) -> int:
        return len(self._seqs)

    def prepare(self, request: ProposalRequest) -> int | None:
        """Sync the draft cache with the history and reserve blocks; the cached history
        positions, or None: do not propose."""
        history = request.token_ids
        if not history or len(history) + request.depth > self.config.max_model_len:
            return None
        state = self._seqs.setdefault(request.seq_id, _DraftSeq())
        # NOTE: at least the last history token is fed, to get the logits for draft 1.
        del state.ids[min(_common_prefix(state, history), len(history) - 1):]
        state.num_history = len(history)
        # Positions written this call: history[len(ids):], then drafts 1 .. depth-1.
        needed = blocks_needed(len(history) + request.depth - 1, self.config.block_size)
        missing = needed - len(state.block_table)
        if missing > 0:
            if not self.allocator.can_allocate(missing):
                logger.debug("draft KV cache full: seq %d proposes nothing", request.seq_id)
                return None
            state.block_table.extend(self.allocator.allocate(missing))
        return len(state.ids)

    def forward(self, rnd: Round) -> torch.Tensor:
        """Feed each sequence's tokens, write their K/V; logits at each one's last token.

        Returns ``[len(rnd.seq_ids), vocab]`` float32, rows in ``rnd`` order: on the model's
        device from a graph, else on the host.
        """
        if self.graphs is not None and self.graphs.can_run(sum(len(f) for f in rnd.feeds)):
            return self._forward_rows(rnd, self.graphs)
        order = order_short_first([len(f) for f in rnd.feeds], self.config.short_q)
        slices, ids, rows = [], [], []
        for i in order:
            seq_id, feed, start = rnd.seq_ids[i], rnd.feeds[i], rnd.starts[i]
            state = self._seqs[seq_id]
            slices.append(SeqSlice(len(feed), start, state.block_table))
            ids.extend(feed)
            rows.append(len(ids) - 1)
            state.ids.extend(feed)
        meta = build_metadata(slices, self.config.block_size, self._num_q_per_kv,
                              self.config.short_q, self.model.device, self._kernel)
        device = self.model.device
        logits = self.model.forward(torch.tensor(ids, dtype=torch.long).to(device), meta,
                                    self.kv, torch.tensor(rows, dtype=torch.long).to(device))
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
        # NOTE: drafting reads every round's tokens on the host anyway; picking there keeps
        # one device for the small index tensors below (it never ran on CUDA before: the ids
        # stayed on the CPU).
        return logits.cpu()[inverse]

    def _forward_rows(self, rnd: Round, graphs: RowDecoder) -> torch.Tensor:
        """:meth:`forward` through the row decoder: one chunk of rows per sequence."""
        rows = []
        for seq_id, feed, start in zip(rnd.seq_ids, rnd.feeds, rnd.starts, strict=True):
            state = self._seqs[seq_id]
            rows.append(DecodeRow.chunk(feed, start, state.block_table))
            state.ids.extend(feed)
        logits = graphs.run(rows)  # [sum of feeds, vocab], a view of the static output
        last = [n - 1 for n in itertools.accumulate(len(f) for f in rnd.feeds)]
        if last[-1] + 1 == len(last):  # one row per sequence (every round after the first)
            return logits.clone()
        return logits[torch.tensor(last).to(logits.device, non_blocking=True)]


def capture_graphs(model: LlamaModel, kv: KVCache, config: DraftConfig) -> CudaGraphDecoder:
    """The draft's rounds as CUDA graphs: up to ``max_batch`` sequences a round, catch-up
    rounds up to ``max_tokens`` rows (as the target's graphs cover its step budget)."""
    return CudaGraphDecoder(model, kv, config.max_batch, config.max_model_len,
                            max_tokens=config.max_tokens)


def _common_prefix(state: _DraftSeq, history: Sequence[int]) -> int:
    """How many cached positions still match ``history``.

    Positions before the last call's history length matched then and a history
    only grows, so only a spot check there and the (at most k) drafts after it
    need comparing.
    """
    known = min(state.num_history, len(state.ids))
    if known > len(history) or (known and state.ids[known - 1] != history[known - 1]):
        return 0  # the history was rewritten (a reused seq_id): recompute from scratch
    n = known
    limit = min(len(state.ids), len(history))
    while n < limit and state.ids[n] == history[n]:
        n += 1
    return n


def draft_proposer(model: LlamaModel, config: DraftConfig,
                   decoder: DecoderFactory | None = None) -> DraftProposer:
    """A proposer over ``model`` with a fresh cache (weights shared with other proposers)."""
    return DraftProposer(DraftModelRunner(model, config, decoder), config.min_confidence)


def load_draft_proposer(config: DraftConfig, target_vocab: int | None = None,
                        decoder: DecoderFactory | None = None) -> DraftProposer:
    runner = DraftModelRunner.load(config, target_vocab, decoder)
    return DraftProposer(runner, config.min_confidence)


def build_draft_proposer(cfg: EngineConfig) -> DraftProposer:
    """The proposer for ``spec_method: draft`` (see ``engine.proposers``)."""
    config = DraftConfig(
        model_dir=cfg.draft_model,
        dtype=cfg.dtype,
        device=cfg.device,
        kv_cache_tokens=cfg.kv_cache_tokens,
        block_size=cfg.block_size,
        max_model_len=cfg.max_model_len + cfg.spec_max_depth + 1,
        short_q=max(cfg.spec_max_depth + 1, 8),
        min_confidence=cfg.draft_min_confidence,
        execution="cuda_graph" if cfg.execution == "cuda_graph" else "eager",
        max_batch=cfg.max_num_seqs,
        max_tokens=cfg.max_num_batched_tokens,
    )
    return load_draft_proposer(config)
