"""Verification before promotion: a candidate serves exactly what the incumbent serves.

The reference is the incumbent answering every request of a fixed plan *alone*
(one request at a time: no batch, no cache pressure, no shared prefix). The
candidate must give each request the same output under the conditions where
engine bugs live, at its own maximum batch size (``max_num_seqs``, the plan
filled to it)::

    prior     the candidate truncated to one layer (what the fast measurement
              tier leaves behind) answers the plan: the prefix cache now holds
              K/V of another model;
    batch     reload the candidate; the whole plan at once: a full batch, every
              batch size on the way down as requests finish (staggered
              max_tokens), contexts of 4-12 KV blocks;
    cached    the plan again: prompts share 48-token prefixes in groups, so
              every request starts from prefix-cache hits;
    pressure  the candidate with a KV cache too small for the batch: sequences
              are preempted and recomputed.

Each request is greedy or seeded-sampled (temperature, ``top_p`` < 1, a seed of
its own), so a sampler that drops a parameter changes its text. NOTE: a
candidate with other speculation settings draws a seeded request's random
numbers differently (rejection sampling is lossless in distribution, not per
draw): its seeded requests are held to its own output alone instead. A request's
output in a full batch equals its output alone: KV isolation, checked on every
pass. The passes must reach what they claim (the engine's own counters: prefix
-cache hits in ``cached``, preemptions in ``pressure``), or the report fails.

Candidates are compared token for token: on the CPU the engine's results do not
depend on batch composition (checked here on the clean engine, by the mutation
suite's clean run). A candidate that legitimately changes floating point
(another dtype, attention kernel, execution mode or forward variant:
:data:`optimizer.numerics.NUMERIC_FIELDS`) cannot be compared with the
incumbent that way: it is held to the stated logit bound of
:mod:`optimizer.numerics` against the incumbent (pass ``logits``), and the four
passes compare it with its own outputs alone (KV isolation, prefix cache and
preemption are still exact within one config).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from optimizer.measure import EngineClient
from optimizer.numerics import LogitBound, LogitReport, changes_numerics, check_logit_bound
from optimizer.sample import DomainPromptSynthesizer
from polyinfer.config import CompiledConfig

logger = logging.getLogger(__name__)

VERIFY_DOMAINS = ("code", "chat", "math", "qa", "extraction", "summarization")
PREEMPTIONS = "vllm:num_preemptions_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"


@dataclass(frozen=True)
class VerifyConfig:
    max_batch: int = 32  # the plan's size: candidates batch up to min(max_num_seqs, this)
    min_batch: int = 8  # requests sent at once even to a candidate with a smaller batch
    prompt_tokens: tuple[int, int] = (56, 168)  # min, max: 4 to 11 blocks of 16 tokens
    prefix_tokens: int = 48  # prompts share this many tokens in groups of `prefix_group`
    prefix_group: int = 4
    max_tokens: tuple[int, int] = (8, 24)  # staggered, so batches shrink one by one
    sampled_every: int = 2  # every n-th request is seeded-sampled, the others greedy
    temperature: float = 0.8
    top_p: float = 0.5
    pressure_share: float = 0.35  # the pressure pass's KV cache: this share of the batch's
    seed: int = 1234
    logits: LogitBound = field(default_factory=LogitBound)  # for numerics-changing candidates

    def __post_init__(self) -> None:
        lo, hi = self.prompt_tokens
        if not (self.min_batch >= 1 and self.max_batch >= self.min_batch
                and self.prefix_tokens < lo <= hi and 1 <= self.max_tokens[0]
                <= self.max_tokens[1] and 0 < self.pressure_share < 1
                and self.prefix_group >= 1 and self.sampled_every >= 1):
            raise ValueError(f"verify: inconsistent config {self}")


@dataclass(frozen=True)
class VerifyRequest:
    prompt: str
    max_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    prompt_tokens: int = 0  # as the synthesizer counted them

    def body(self, model: str) -> dict[str, object]:
        body: dict[str, object] = {"model": model, "prompt": self.prompt,
                                   "max_tokens": self.max_tokens, "ignore_eos": True,
                                   "temperature": self.temperature, "top_p": self.top_p,
                                   "stream": False}
        if self.seed is not None:
            body["seed"] = self.seed
        return body


def verification_plan(synth: DomainPromptSynthesizer, cfg: VerifyConfig = VerifyConfig()
                      ) -> list[VerifyRequest]:
    """``cfg.max_batch`` requests: shared prefixes, spread lengths, greedy and seeded."""
    rng = random.Random(cfg.seed)
    lo, hi = cfg.prompt_tokens
    out, prefix = [], ""
    for i in range(cfg.max_batch):
        if i % cfg.prefix_group == 0:
            prefix = synth.make(VERIFY_DOMAINS[(i // cfg.prefix_group) % len(VERIFY_DOMAINS)],
                                cfg.prefix_tokens)
        num_tokens = lo + (hi - lo) * ((i * 7) % cfg.max_batch) // max(1, cfg.max_batch - 1)
        rest = synth.make(VERIFY_DOMAINS[i % len(VERIFY_DOMAINS)],
                          num_tokens - cfg.prefix_tokens)
        prompt = prefix + " " + rest
        max_tokens = rng.randint(*cfg.max_tokens)
        sampled = i % cfg.sampled_every == cfg.sampled_every - 1
        out.append(VerifyRequest(prompt, max_tokens,
                                 cfg.temperature if sampled else 0.0,
                                 cfg.top_p if sampled else 1.0,
                                 cfg.seed + i if sampled else None,
                                 synth.count_tokens(prompt)))
    return out


def batch_size(candidate: CompiledConfig, cfg: VerifyConfig) -> int:
    """How many plan requests the candidate gets at once: its own max batch, within bounds."""
    return max(cfg.min_batch, min(cfg.max_batch, candidate.engine.max_num_seqs))


def pressure_sizes(candidate: CompiledConfig, plan: Sequence[VerifyRequest],
                   cfg: VerifyConfig) -> list[int]:
    """KV-cache sizes (tokens) to try for the pressure pass, largest first.

    Each holds the longest request; the first is ``pressure_share`` of what the
    running batch (the ``max_num_seqs`` longest requests) needs, then tighter in
    steps of 1/4 down to the longest request and two blocks. NOTE: admission is
    greedy and only growth beyond the cache preempts, so whether a size preempts
    depends on which requests run together (their arrival order): a ladder of
    sizes, not one or two, makes a pass without preemptions unlikely (one plan at
    max_num_seqs 8 preempted nothing at 400 and 240 tokens in one run, once at 240
    in the next).
    """
    e = candidate.engine
    need = sorted((r.prompt_tokens + r.max_tokens + e.block_size for r in plan), reverse=True)
    floor = need[0] + 2 * e.block_size
    first = max(floor, int(sum(need[:e.max_num_seqs]) * cfg.pressure_share))
    sizes = [max(floor, first * k // 4) for k in (4, 3, 2)] + [
        floor + (first - floor) // 8, floor]
    return sorted({-(-t // e.block_size) * e.block_size for t in sizes}, reverse=True)


def pressure_config(candidate: CompiledConfig, tokens: int) -> CompiledConfig:
    e = candidate.engine
    return candidate.with_engine(kv_cache_tokens=min(tokens, e.kv_cache_tokens),
                                 max_model_len=min(e.max_model_len, tokens),
                                 measure_num_layers=None)


@dataclass(frozen=True)
class VerifyReport:
    ok: bool
    batch: int  # requests the candidate served at once
    mismatches: dict[str, tuple[int, ...]]  # pass -> plan indices whose output differed
    coverage: dict[str, float]  # engine counters the passes moved (hits, preemptions)
    reason: str = ""
    details: dict[str, str] = field(default_factory=dict)

    @property
    def bad(self) -> tuple[int, ...]:
        return tuple(sorted({i for v in self.mismatches.values() for i in v}))


@dataclass(frozen=True)
class Reference:
    config: CompiledConfig  # the incumbent that answered
    outputs: tuple[str, ...]  # one per plan request, each answered alone


async def reference_outputs(engine: EngineClient, incumbent: CompiledConfig,
                            plan: Sequence[VerifyRequest]) -> Reference:
    """The incumbent's output for each request alone (one at a time)."""
    await engine.reload(incumbent.with_engine(measure_num_layers=None))
    return Reference(incumbent, tuple([await engine.generate(r.body(engine.model))
                                       for r in plan]))


SPEC_FIELDS = ("spec_method", "spec_max_depth", "spec_default_depth", "ngram_min", "ngram_max",
               "ngram_caps", "draft_model", "draft_min_confidence")


def same_random_stream(a: CompiledConfig, b: CompiledConfig) -> bool:
    """Whether a seeded request draws the same random numbers for the same tokens on both.

    NOTE: speculation is lossless in distribution, not per draw: rejection sampling
    spends its uniforms on accept/reject tests, so a seeded request's text under
    another speculation setting is a different (equally valid) sample.
    """
    ea, eb = a.engine, b.engine
    if ea.spec_method == eb.spec_method == "none":
        return True
    return all(getattr(ea, f) == getattr(eb, f) for f in SPEC_FIELDS)


async def _expected(engine: EngineClient, candidate: CompiledConfig,
                    plan: Sequence[VerifyRequest], reference: Reference) -> list[str]:
    """What each request must answer: the incumbent alone; the candidate alone for a seeded
    request whose random stream the candidate changes, and for every request when it
    changes floating point (held to the logit bound instead): KV isolation still holds."""
    expected = list(reference.outputs)[:len(plan)]
    numerics = changes_numerics(candidate, reference.config)
    if same_random_stream(candidate, reference.config) and not numerics:
        return expected
    await engine.reload(candidate)
    for i, r in enumerate(plan):
        if r.seed is not None or numerics:
            expected[i] = await engine.generate(r.body(engine.model))
    return expected


async def _all_at_once(engine: EngineClient, plan: Sequence[VerifyRequest]) -> list[str]:
    return list(await asyncio.gather(*(engine.generate(r.body(engine.model)) for r in plan)))


def _differ(outputs: Sequence[str], reference: Sequence[str]) -> tuple[int, ...]:
    return tuple(i for i, (o, r) in enumerate(zip(outputs, reference, strict=True)) if o != r)


async def verify_candidate(engine: EngineClient, candidate: CompiledConfig,
                           plan: Sequence[VerifyRequest], incumbent: Reference,
                           cfg: VerifyConfig = VerifyConfig()) -> VerifyReport:
    """Run the four passes on ``engine`` (left serving ``candidate``); see the module doc."""
    n = batch_size(candidate, cfg)
    plan = list(plan)[:n]
    serving = candidate.with_engine(measure_num_layers=None)
    mismatches: dict[str, tuple[int, ...]] = {}
    coverage: dict[str, float] = {}
    caching = candidate.engine.enable_prefix_caching
    logits: LogitReport | None = None
    if changes_numerics(serving, incumbent.config):
        logits = await check_logit_bound(engine, incumbent.config, serving, plan, cfg.logits)
        if logits.bad:
            mismatches["logits"] = logits.bad
    reference = await _expected(engine, serving, plan, incumbent)
    if caching:
        await engine.reload(candidate.with_engine(measure_num_layers=1))
        await _all_at_once(engine, plan)
    await engine.reload(serving)
    mismatches["batch"] = _differ(await _all_at_once(engine, plan), reference)
    if caching:
        hits0 = await engine.counter(PREFIX_HITS)
        mismatches["cached"] = _differ(await _all_at_once(engine, plan), reference)
        coverage["prefix_hit_tokens"] = await engine.counter(PREFIX_HITS) - hits0
    for tokens in pressure_sizes(candidate, plan, cfg):
        pre0 = await engine.counter(PREEMPTIONS)
        await engine.reload(pressure_config(candidate, tokens))
        mismatches["pressure"] = _differ(await _all_at_once(engine, plan), reference)
        coverage["preemptions"] = await engine.counter(PREEMPTIONS) - pre0
        coverage["pressure_kv_tokens"] = tokens
        if coverage["preemptions"] > 0 or mismatches["pressure"]:
            break
    await engine.reload(serving)
    mismatches = {k: v for k, v in mismatches.items() if v}
    reason = "; ".join(r for r in (logits.reason if logits else "",
                                   _reason({k: v for k, v in mismatches.items() if k != "logits"},
                                           coverage, caching)) if r)
    details = {}
    if set(mismatches) - {"logits"}:
        details = await _diagnose(engine, plan, reference,
                                  {k: v for k, v in mismatches.items() if k != "logits"})
    if logits is not None:
        coverage["logit_positions"] = logits.num_positions
        coverage["logit_max_abs_diff"] = round(logits.max_abs_diff, 6)
        details.update({f"logits {k}": v for k, v in logits.details.items()})
    return VerifyReport(not reason, n, mismatches, coverage, reason, details)


def _reason(mismatches: dict[str, tuple[int, ...]], coverage: dict[str, float],
            caching: bool) -> str:
    if mismatches:
        return "; ".join(f"{k}: {len(v)} request(s) differ from the incumbent alone"
                         for k, v in mismatches.items())
    if caching and coverage.get("prefix_hit_tokens", 0) <= 0:
        return "the cached pass hit no prefix-cache block: the check did not run"
    if coverage.get("preemptions", 0) <= 0:
        return "the pressure pass preempted nothing: the check did not run"
    return ""


async def _diagnose(engine: EngineClient, plan: Sequence[VerifyRequest],
                    reference: Sequence[str],
                    mismatches: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """For a few bad requests: the candidate alone, to tell batch effects from config ones."""
    out = {}
    for i in sorted({i for v in mismatches.values() for i in v})[:3]:
        alone = await engine.generate(plan[i].body(engine.model))
        kind = "isolation (alone it matches)" if alone == reference[i] else "differs alone too"
        out[str(i)] = f"{kind}: ref={reference[i][:40]!r} alone={alone[:40]!r}"
    return out
