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

from engine.config import CompiledConfig
from optimizer.measure import EngineClient, Measurement
from optimizer.sample import PromptSynthesizer

logger = logging.getLogger(__name__)

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
    gain: float  # candidate mean / incumbent mean - 1
    noise: float  # relative standard error of the difference
    threshold: float  # what the gain had to exceed
    significant: bool


def gain_beyond_noise(candidate: Measurement, incumbent: Measurement, min_gain: float = 0.02,
                      num_sigma: float = 2.0) -> GainReport:
    """Gain must exceed ``min_gain`` and ``num_sigma`` standard errors of the difference."""
    if incumbent.value <= 0:
        return GainReport(math.inf if candidate.value > 0 else 0.0, 0.0, min_gain,
                          candidate.value > 0)
    se = math.sqrt(_var_of_mean(candidate.values) + _var_of_mean(incumbent.values))
    noise = se / incumbent.value
    gain = candidate.value / incumbent.value - 1.0
    threshold = max(min_gain, num_sigma * noise)
    return GainReport(gain, noise, threshold, gain > threshold)


def _var_of_mean(values: Sequence[float]) -> float:
    if len(values) < 2:
        # NOTE: one sample says nothing about noise; assume 5% so one lucky run never promotes.
        return (0.05 * values[0]) ** 2 if values else 0.0
    return statistics.variance(values) / len(values)
