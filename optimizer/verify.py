"""Verification before promotion: same greedy outputs, no KV-cache contamination, real gain.

1. ``outputs_match``: the candidate, on the full model, answers a fixed
   prompt set one request at a time with exactly the reference config's
   greedy text.
2. ``no_contamination``: the same prompts sent all at once (interleaved in
   one batch, sharing the KV cache) and then again (blocks reused after
   being freed) give exactly the same texts.
3. ``gain_beyond_noise``: the candidate's repeated slow-tier measurements
   beat the incumbent's by more than the measured noise.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from optimizer.measure import EngineClient
from optimizer.sample import PromptSynthesizer
from polyinfer.config import CompiledConfig

logger = logging.getLogger(__name__)

NOISE_FLOOR = 0.01  # smallest standard error a paired comparison is credited with
VERIFY_DOMAINS = ("code", "chat", "math", "qa", "extraction", "summarization")


@dataclass(frozen=True)
class VerifyConfig:
    num_prompts: int = 6
    prompt_tokens: int = 48
    max_tokens: int = 24
    seed: int = 1234


def fixed_prompts(synth: PromptSynthesizer, cfg: VerifyConfig = VerifyConfig()) -> list[str]:
    return [synth.make(VERIFY_DOMAINS[i % len(VERIFY_DOMAINS)], cfg.prompt_tokens)
            for i in range(cfg.num_prompts)]


@dataclass(frozen=True)
class VerifyReport:
    ok: bool
    sequential_match: bool
    interleaved_match: bool
    repeated_match: bool
    mismatches: tuple[int, ...] = ()  # prompt indices that differed anywhere
    details: dict[str, str] = field(default_factory=dict)


async def reference_outputs(engine: EngineClient, reference: CompiledConfig,
                            prompts: Sequence[str], max_tokens: int) -> list[str]:
    await engine.reload(reference.with_engine(measure_num_layers=None))
    return [await engine.complete(p, max_tokens) for p in prompts]


async def verify_candidate(engine: EngineClient, candidate: CompiledConfig,
                           prompts: Sequence[str], reference: Sequence[str],
                           max_tokens: int) -> VerifyReport:
    await engine.reload(candidate.with_engine(measure_num_layers=None))
    sequential = [await engine.complete(p, max_tokens) for p in prompts]
    interleaved = await asyncio.gather(*(engine.complete(p, max_tokens) for p in prompts))
    repeated = await asyncio.gather(*(engine.complete(p, max_tokens)
                                      for p in list(prompts)[::-1]))
    repeated = repeated[::-1]
    bad = sorted({i for i, ref in enumerate(reference)
                  if ref != sequential[i] or ref != interleaved[i] or ref != repeated[i]})
    details = {str(i): f"ref={reference[i][:40]!r} seq={sequential[i][:40]!r}" for i in bad[:3]}
    seq_ok = list(sequential) == list(reference)
    inter_ok = list(interleaved) == list(reference)
    rep_ok = list(repeated) == list(reference)
    return VerifyReport(seq_ok and inter_ok and rep_ok, seq_ok, inter_ok, rep_ok, tuple(bad),
                        details)


@dataclass(frozen=True)
class GainReport:
    gain: float  # geometric mean of candidate / incumbent over the pairs, minus 1
    noise: float  # standard error of the mean log ratio (~ relative noise of the gain)
    threshold: float  # what the mean log ratio had to exceed
    significant: bool
    num_pairs: int


def paired_gain(candidate: Sequence[float], incumbent: Sequence[float], min_gain: float = 0.02,
                num_sigma: float = 2.0) -> GainReport:
    """Gain from interleaved pairs (incumbent, candidate, incumbent, candidate, ...).

    NOTE: pairs measured back to back share the machine's state at that moment,
    so the ratio cancels slow drifts (other tenants' load) that would swamp a
    comparison of two separately measured means on a shared box. The gain counts
    only when the mean log ratio beats both ``log(1 + min_gain)`` and
    ``num_sigma`` standard errors; a single pair is assumed 5% noisy.
    """
    pairs = [(c, i) for c, i in zip(candidate, incumbent, strict=True) if c > 0 and i > 0]
    if not pairs:
        return GainReport(0.0, math.inf, math.inf, False, 0)
    logs = [math.log(c / i) for c, i in pairs]
    mean = statistics.fmean(logs)
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.05
    # NOTE: a few identical ratios (coarse clocks: CPU time ticks at 10 ms) would claim
    # zero noise; no comparison of two replays on one machine is better than ~1%.
    se = max(se, NOISE_FLOOR)
    threshold = max(math.log1p(min_gain), num_sigma * se)
    return GainReport(math.exp(mean) - 1.0, se, threshold, mean > threshold, len(pairs))
