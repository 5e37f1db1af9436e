"""The synchronous engine core: requests in, one ``step()`` at a time, text deltas out.

``step`` is ``propose -> schedule -> execute -> postprocess``. The core is not
thread-safe: :class:`engine.async_engine.AsyncEngine` calls it from one
thread at a time (steps on a worker thread, adds/aborts between steps).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.checkpoint import ModelSpec, load_weights
from engine.cuda_graph import CudaGraphDecoder
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import (
    ContextLengthError,
    EngineError,
    InvalidRequestError,
    ReloadError,
    RequestError,
    UnsupportedConfigError,
)
from engine.fused import verify_variants
from engine.grammar import GrammarError, grammars_for
from engine.kv_cache import BlockAllocator
from engine.model import LlamaModel
from engine.pacing import step_terms
from engine.proposers import build_proposer
from engine.runner import ModelRunner, StepResult
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import GenerationParams, Sequence, TokenLogprob
from engine.tokenizer import TextTokenizer
from polyinfer.config import CompiledConfig, EngineConfig, restart_fields_changed
from specdec.base import Proposal, ProposalRequest, Proposer
from specdec.step_feed import DecodeStep

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    text: str  # newly released text
    new_token_ids: list[int]  # tokens generated this step (a stop token id included)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_draft_tokens: int  # totals for the request so far
    num_accepted_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: RequestError | None = None  # why the engine refused the request (finish "abort")
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asks


@dataclass
class StepStats:
    num_prompt_tokens: int = 0  # prompt tokens computed or found cached this step
    num_prefix_queries: int = 0  # prompt tokens of newly admitted requests looked up
    num_prefix_hits: int = 0  # of which found in the prefix cache
    num_generated: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_preempted: int = 0
    num_running: int = 0  # gauges after the step
    num_waiting: int = 0
    kv_usage: float = 0.0
    decode_step: DecodeStep | None = None  # set when any scheduled sequence decoded
    paced: bool = False  # a prompt chunk was held to a TPOT SLO (engine.pacing)


class EngineCore:
    def __init__(self, config: CompiledConfig, spec: ModelSpec,
                 weights: dict[str, torch.Tensor], tokenizer: TextTokenizer) -> None:
        self.spec = spec
        self.weights = weights  # on-disk dtype, kept for hot reload
        self.tokenizer = tokenizer
        self.eos_ids = tokenizer.eos_token_ids | frozenset(spec.eos_token_ids)
        self._seq_ids = itertools.count()
        self.requests: dict[str, Sequence] = {}
        self.detoks: dict[int, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []  # outputs made between steps (reload)
        self._to_prepare: list[Sequence] = []  # added, the proposer not yet told (_launched)
        self._threads_for: int | None = None  # thread whose torch thread count is set
        # called once a step's forward is launched asynchronously (a CUDA-graph replay):
        # engine.async_engine.StepLoop posts the previous step's outputs then
        self.on_launch: Callable[[], None] | None = None
        self.config = config
        self._build(config.engine)

    # -- construction / reload --------------------------------------------------------------

    def _build(self, cfg: EngineConfig) -> None:
        self.max_model_len = cfg.usable_model_len
        self.model = LlamaModel(self.spec, self._layer_weights(cfg), cfg.dtype, cfg.device,
                                max_positions=self.max_model_len + cfg.spec_max_depth + 1,
                                execution=cfg.execution, attention=cfg.attention,
                                variants=cfg.forward, share=getattr(self, "model", None))
        if cfg.forward.enabled:  # every fused kernel against its reference, before it serves
            tuned = {"skinny_gemm": self.model.skinny} if self.model.skinny else None
            verify_variants(cfg.forward.enabled, self.spec, cfg.device, self.model.dtype, tuned)
        try:
            kv = self.model.new_kv_cache(cfg.num_kv_blocks, cfg.block_size)
        except (RuntimeError, MemoryError) as e:  # torch's allocators raise RuntimeError
            raise UnsupportedConfigError(
                f"engine.kv_cache_tokens: cannot allocate a KV cache of {cfg.kv_cache_tokens} "
                f"tokens on {cfg.device!r} ({e})") from e
        self.allocator = BlockAllocator(cfg.num_kv_blocks)
        self.scheduler = Scheduler(cfg, self.allocator)
        graphs = None
        if cfg.execution == "cuda_graph":
            graphs = CudaGraphDecoder(self.model, kv, cfg.max_num_seqs,
                                      self.max_model_len + cfg.spec_max_depth + 1,
                                      max_depth=0 if cfg.spec_method == "none" else cfg.spec_max_depth,
                                      max_tokens=cfg.max_num_batched_tokens,
                                      sizes=cfg.graph_sizes)
        self.runner = ModelRunner(self.model, kv, short_q=max(cfg.spec_max_depth + 1, 8),
                                  graphs=graphs, on_launch=self._launched,
                                  more_waiting=lambda: bool(self.scheduler.waiting))
        self.proposer: Proposer | None = build_proposer(cfg, self.spec, self.weights)
        self._threads_for = None
        logger.info("engine built: dtype=%s kv=%d blocks x %d (%.1f MiB) max_num_seqs=%d "
                    "budget=%d spec=%s/%d prefix_caching=%s", cfg.dtype, cfg.num_kv_blocks,
                    cfg.block_size, kv.num_bytes / 2**20, cfg.max_num_seqs,
                    cfg.max_num_batched_tokens, cfg.spec_method, cfg.spec_max_depth,
                    cfg.enable_prefix_caching)

    def _layer_weights(self, cfg: EngineConfig) -> dict[str, torch.Tensor]:
        want = cfg.measure_num_layers or self.spec.num_layers
        want = min(want, self.spec.num_layers)
        have = sum(1 for k in self.weights if k.endswith(".input_layernorm.weight"))
        if have < want:  # the previous config measured fewer layers: read the rest
            self.weights = load_weights(self.config.model, want)
        return {k: v for k, v in self.weights.items()
                if not k.startswith("model.layers.") or int(k.split(".")[2]) < want}

    def reload(self, config: CompiledConfig) -> float:
        """Apply a new compiled config without re-reading weights; returns seconds taken.

        NOTE: ``_build`` makes a new KV cache and block allocator, so every reload
        starts with an empty prefix cache: no K/V computed under the old dtype,
        layers or attention kernel can be served under the new config.
        """
        t0 = time.perf_counter()
        if Path(config.model).resolve() != Path(self.config.model).resolve():
            raise ReloadError(f"reload cannot change the model ({self.config.model} -> "
                              f"{config.model}); start a new engine")
        changed = restart_fields_changed(self.config.engine, config.engine)
        if changed:
            raise ReloadError(f"reload cannot change engine.{changed[0]} (restart-only); "
                              "start a new engine")
        self._check_fits(config)
        seqs = self.scheduler.drain()
        if self.proposer is not None:
            for seq in seqs:
                self.proposer.release(seq.seq_id)
        old = self.config
        self.config = config
        self.runner.lanes.close()  # the rebuilt runner gets its own lanes on the next step
        try:
            self._build(config.engine)
        except Exception as e:
            self.config = old
            self._build(old.engine)
            if isinstance(e, EngineError):
                raise
            # NOTE: any failure to build the new config is the config's (the old one is
            # serving again): an error the server answers with 400, not a 500
            raise ReloadError(f"cannot apply this config ({type(e).__name__}: {e}); "
                              "the previous config keeps serving") from e
        finally:
            self._requeue(seqs)
        return time.perf_counter() - t0

    def _check_fits(self, config: CompiledConfig) -> None:
        """Refuse a config that would cut a request in flight short of its own max_tokens.

        NOTE: in-flight requests are recomputed under the new config, never cut: a
        config too small for one of them is refused, the old one keeps serving.
        """
        room = config.engine.usable_model_len
        need = max((s.num_prompt_tokens + s.params.max_tokens for s in self.requests.values()),
                   default=0)
        if need > room:
            raise ReloadError(f"a request in flight needs {need} tokens and this config holds "
                              f"{room} per sequence; reload when it has finished")

    def _requeue(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.num_tokens >= self.max_model_len:
                detok = self.detoks.pop(seq.seq_id, None)
                self._finish(seq, "length", None)
                self._pending.append(self._output(seq, detok.finish() if detok else "", 0))
            else:
                self.scheduler.add(seq)

    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache (requests keep running); returns the blocks it named."""
        num_dropped = self.allocator.reset()
        logger.info("prefix cache reset: %d cached blocks dropped", num_dropped)
        return num_dropped

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int],
                    params: GenerationParams) -> None:
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            # The parser checks this first (against the config live when it parsed, which a
            # reload may since have replaced); a sequence that can never fit would stall the
            # queue.
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens; you "
                f"requested {len(prompt_ids) + params.max_tokens} tokens "
                f"({len(prompt_ids)} in the prompt, {params.max_tokens} for the completion).",
                "prompt")
        if prompt_ids and not 0 <= min(prompt_ids) <= max(prompt_ids) < self.vocab_size:
            # NOTE: an id past the embedding would fail the whole step, every request in it
            raise InvalidRequestError(f"'prompt' has token ids outside [0, {self.vocab_size})",
                                      "prompt")
        seq = Sequence(next(self._seq_ids), request_id, list(prompt_ids), len(prompt_ids),
                       self._with_min_tokens_ban(params), time.monotonic())
        if params.grammar is not None:
            try:
                seq.grammar = grammars_for(self.tokenizer, self.vocab_size).matcher(
                    params.grammar)
            except GrammarError as e:
                raise InvalidRequestError(f"the schema cannot be compiled: {e}",
                                          "response_format") from None
        self.requests[request_id] = seq
        self.detoks[seq.seq_id] = IncrementalDetokenizer(
            self.tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output)
        self.scheduler.add(seq)
        if (params.spec_depth > 0 and self.runner.graphs is not None
                and hasattr(self.proposer, "prepare")):
            self._to_prepare.append(seq)  # see _overlap_proposer_work

    def _with_min_tokens_ban(self, params: GenerationParams) -> GenerationParams:
        """``min_tokens`` holds back what would end the request: EOS (unless ignored) and
        the stop token ids, as vLLM does."""
        sampling = params.sampling
        if not sampling.min_tokens:
            return params
        ban = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                  else self.eos_ids)
        return dataclasses.replace(params, sampling=dataclasses.replace(
            sampling, min_tokens_ban=ban))

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is not None:
            self._finish(seq, "abort", None)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._pending)

    def idle(self) -> None:
        """Work that may wait for a moment without requests (the n-gram output pool)."""
        flush = getattr(self.proposer, "flush_pool", None)
        if flush is not None:
            flush()

    # -- the step ---------------------------------------------------------------------------

    def _ensure_threads(self) -> None:
        # NOTE: OpenMP thread counts are per calling thread, so set them where steps run.
        # NOTE: on the CPU, 2+ threads become two lanes (engine.lanes) of n // 2 intra-op
        # threads each. Auto stays half the cores: on the shared 2-core box one thread
        # measured 5-15% faster end to end than two lanes (no idle core to win there).
        if self._threads_for != threading.get_ident():
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
                os.cpu_count() or 2)
            on_cpu = torch.device(self.model.device).type == "cpu"
            n = self.config.engine.num_threads or max(1, cores // 2)
            lanes = 2 if on_cpu and n >= 2 else 1
            torch.set_num_threads(n // lanes)
            self.runner.set_lanes(lanes, n // lanes)
            self._threads_for = threading.get_ident()

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        self._ensure_threads()
        t0 = time.perf_counter()
        outputs, self._pending = self._pending, []
        stats = StepStats()
        plan = self.scheduler.schedule(self._propose())
        stats.num_preempted = len(plan.preempted)
        stats.num_prefix_queries = plan.num_prefix_queries
        stats.num_prefix_hits = plan.num_prefix_hits
        stats.num_prompt_tokens = plan.num_prefix_hits  # vLLM counts cached prompt tokens too
        if self.proposer is not None:
            for seq in plan.preempted:
                self.proposer.release(seq.seq_id)
        if not plan.scheduled:
            return outputs, stats
        decoding = [it for it in plan.scheduled if it.num_new == 1 and it.samples]
        num_prefill = sum(it.num_new for it in plan.scheduled if it.seq.is_prefilling)
        pacer = self.scheduler.pacer
        terms = step_terms(len(decoding), sum(it.q_len for it in decoding),
                           sum(it.seq.num_computed for it in decoding),
                           [(it.seq.num_computed, it.num_new) for it in plan.scheduled
                            if not (it.num_new == 1 and it.samples)]) if pacer.engaged else None
        results = {id(r.item): r for r in self.runner.execute(plan.scheduled)}
        for item in plan.scheduled:
            out = self._postprocess(item, results.get(id(item)), stats)
            if out is not None:
                outputs.append(out)
        if terms is not None:
            pacer.model.observe(terms, time.perf_counter() - t0)
        stats.paced = plan.paced
        if decoding:  # NOTE: the whole step, so proposing and verifying are priced too
            drafted = [len(it.drafts) for it in decoding]
            stats.decode_step = DecodeStep(len(drafted), sum(drafted), max(drafted),
                                           time.perf_counter() - t0, num_prefill,
                                           sum(1 for d in drafted if d))
        return outputs, stats

    def _launched(self) -> None:
        if self.on_launch is not None:
            self.on_launch()
        self._overlap_proposer_work()

    def _overlap_proposer_work(self) -> None:
        """Proposer work done while the GPU runs the step just launched: index the prompts of
        sequences added since the last launch, and the outputs of finished ones (the pool).

        NOTE: done in the first proposal (a ~300-token prompt's index takes ~0.5 ms) or
        when the pool flushes (~1 ms per 128-token output, in the first propose() after a
        request ends unless the engine idled first), this host work delayed a step's launch
        while the GPU idled; here it runs while the GPU computes. The CPU's eager forward
        launches nothing, so there the first proposal and idle time still do it.
        """
        prepare = getattr(self.proposer, "prepare", None)
        if prepare is None:
            return
        todo, self._to_prepare = self._to_prepare, []
        for seq in todo:
            if seq.finish_reason is None:
                prepare(ProposalRequest(seq.seq_id, seq.token_ids, seq.params.spec_depth,
                                        seq.params.sampling, seq.num_prompt_tokens))
        flush = getattr(self.proposer, "flush_pool", None)
        if flush is not None:
            flush()

    def _spec_depth(self, seq: Sequence) -> int:
        """The speculative depth ``seq`` asks for this step (0 while prefilling)."""
        if self.proposer is None or seq.params.spec_depth <= 0 or seq.is_prefilling:
            return 0
        return max(0, min(seq.params.spec_depth,
                          seq.params.max_tokens - seq.num_output_tokens - 1,
                          self.max_model_len - seq.num_tokens))

    def _propose(self) -> dict[int, Proposal]:
        if self.proposer is None:
            return {}
        reqs = []
        for seq in self.scheduler.running:
            depth = self._spec_depth(seq)
            if depth > 0:
                reqs.append(ProposalRequest(seq.seq_id, seq.token_ids, depth,
                                            seq.params.sampling, seq.num_prompt_tokens))
        if not reqs:
            return {}
        return {p.seq_id: p for p in self.proposer.propose(reqs) if p.tokens}

    def _postprocess(self, item: ScheduledSeq, result: StepResult | None,
                     stats: StepStats) -> RequestOutput | None:
        seq = item.seq
        if seq.num_computed < seq.num_prompt_tokens:
            stats.num_prompt_tokens += min(item.num_new, seq.num_prompt_tokens - seq.num_computed)
        seq.num_computed += item.num_new
        if result is None:
            self.scheduler.cache_blocks(seq)  # a prefill chunk that filled blocks
            return None
        seq.num_computed += result.num_accepted
        self.scheduler.cache_blocks(seq)
        if item.drafts:
            self._count_spec(seq, len(item.drafts), result.num_accepted, stats)
        new = self._append(seq, result.tokens)
        if new and seq.first_token_s is None:
            seq.first_token_s = time.monotonic()
        elif new:
            seq.num_decode_steps += 1
        stats.num_generated += new
        text = self.detoks[seq.seq_id].push(self._visible(seq, new))
        if text.stop_string is not None and seq.finish_reason is None:
            self._finish(seq, "stop", text.stop_string)
        elif seq.finish_reason is None:
            self.scheduler.trim_blocks(seq)
        tail = self.detoks[seq.seq_id].finish() if seq.finish_reason is not None else ""
        out = self._output(seq, text.text + tail, new)
        if result.logprobs is not None:
            out = dataclasses.replace(out, logprobs=result.logprobs[:new])
        if seq.finish_reason is not None:
            self.detoks.pop(seq.seq_id, None)
        return out

    def _count_spec(self, seq: Sequence, num_draft: int, num_accepted: int,
                    stats: StepStats) -> None:
        seq.num_draft_tokens += num_draft
        seq.num_accepted_tokens += num_accepted
        stats.num_drafts += 1
        stats.num_draft_tokens += num_draft
        stats.num_accepted_tokens += num_accepted
        if len(stats.accepted_per_pos) < num_accepted:
            stats.accepted_per_pos.extend([0] * (num_accepted - len(stats.accepted_per_pos)))
        for pos in range(num_accepted):
            stats.accepted_per_pos[pos] += 1
        if self.proposer is not None:
            self.proposer.commit(seq.seq_id, num_accepted)

    def _append(self, seq: Sequence, tokens: list[int]) -> int:
        """Append sampled tokens up to the first stop condition; returns how many were kept."""
        p = seq.params
        for n, tok in enumerate(tokens, 1):
            if seq.grammar is not None and not seq.grammar.accept_token(tok):
                # NOTE: only where the mask left nothing to sample (min_tokens banned the EOS
                # that ends the grammar): the grammar wins, the token is dropped
                self._finish(seq, "stop", None)
                return n - 1
            seq.token_ids.append(tok)
            if seq.grammar is not None and seq.grammar.is_terminated():  # it accepted EOS
                self._finish(seq, "stop", tok if tok in p.stop_token_ids else None)
                return n
            if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                self._finish(seq, "stop", tok if tok in p.stop_token_ids else None)
                return n
            if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                self._finish(seq, "length", None)
                return n
        return len(tokens)

    def _visible(self, seq: Sequence, new: int) -> list[int]:
        """New tokens to detokenize: a stop token id is not part of the text."""
        ids = seq.token_ids[seq.num_tokens - new:]
        if seq.finish_reason == "stop" and isinstance(seq.stop_reason, int):
            return ids[:-1]
        return ids

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)
        if reason == "abort":
            self.detoks.pop(seq.seq_id, None)
        if self.proposer is not None:
            self.proposer.release(seq.seq_id)

    def _output(self, seq: Sequence, text: str, new: int) -> RequestOutput:
        new_ids = seq.token_ids[seq.num_tokens - new:] if new else []
        return RequestOutput(seq.request_id, text, new_ids, seq.finish_reason is not None,
                             seq.finish_reason, seq.stop_reason, seq.num_prompt_tokens,
                             seq.num_output_tokens, seq.num_draft_tokens,
                             seq.num_accepted_tokens, seq.num_cached_tokens or 0)

    # -- introspection ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: those both the tokenizer and the model's embedding know."""
        return min(self.tokenizer.vocab_size, self.spec.vocab_size)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        return self.allocator.usage
