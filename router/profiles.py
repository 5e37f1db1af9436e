"""Per-worker latency profiles, learned online from finished requests.

Two linear models per (worker, shape bucket), fitted by recursive least
squares with forgetting (old samples fade, so a re-tuned worker is re-learned):

- TTFT (seconds) against ``[1, prompt_tokens / 1000, queue / 8]``, where
  ``queue`` is the worker's load when the request was sent;
- TPOT (seconds per output token) against ``[1, batch / 8, k / 4]`` — batch
  size and speculative depth.

A shape bucket is ``(domain, prompt-length band)``. A prediction blends, by
sample count, the bucket's model, the worker's all-bucket model and a prior
derived from the worker's compiled config and declared fit
(:class:`LatencyPrior`), so a new worker starts from what it says it is tuned
for and measurements replace that. Everything is pure Python + tiny numpy: a
predict is a few microseconds, an update a few tens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from engine.config import CompiledConfig, DeclaredFit

PROMPT_BANDS = (256, 1024, 4096)  # bucket upper edges, tokens; last band is open


def prompt_band(prompt_tokens: int) -> int:
    for i, edge in enumerate(PROMPT_BANDS):
        if prompt_tokens < edge:
            return i
    return len(PROMPT_BANDS)


def ttft_features(prompt_tokens: int, queue: float) -> tuple[float, float, float]:
    return (1.0, prompt_tokens / 1000.0, queue / 8.0)


def tpot_features(batch: float, depth: int) -> tuple[float, float, float]:
    return (1.0, batch / 8.0, depth / 4.0)


class RecursiveLeastSquares:
    """Online least squares with exponential forgetting; ``predict`` is a 3-term dot product."""

    def __init__(self, dim: int, forgetting: float = 0.98, delta: float = 100.0) -> None:
        self.theta = np.zeros(dim)
        self.p = np.eye(dim) * delta
        self.forgetting = forgetting
        self.num_samples = 0
        self._w = tuple(0.0 for _ in range(dim))

    def update(self, x: tuple[float, ...], y: float) -> None:
        xv = np.asarray(x)
        px = self.p @ xv
        gain = px / (self.forgetting + xv @ px)
        self.theta = self.theta + gain * (y - xv @ self.theta)
        self.p = (self.p - np.outer(gain, px)) / self.forgetting
        # NOTE: keep P bounded; with forgetting and unexciting inputs (queue always 0)
        # it would otherwise grow without limit and make one sample swing the fit.
        np.clip(self.p, -1e4, 1e4, out=self.p)
        self.num_samples += 1
        self._w = tuple(float(v) for v in self.theta)

    def predict(self, x: tuple[float, ...]) -> float:
        return sum(w * v for w, v in zip(self._w, x, strict=True))


@dataclass(frozen=True)
class PriorConfig:
    """The prior latency model, in seconds, before any measurement."""

    step_s: float = 0.02  # one decode step at batch 1
    step_per_seq_s: float = 0.002  # added per running sequence
    prefill_s_per_token: float = 0.0002
    spec_speedup: float = 0.75  # TPOT factor for speculating workers on copy-heavy domains
    copy_domains: tuple[str, ...] = ("code", "extraction", "summarization", "rag")
    fit_bonus: float = 0.85  # cost factor when the declared fit covers the shape
    weight_samples: float = 8.0  # the prior counts as this many samples

    def __post_init__(self) -> None:
        if min(self.step_s, self.prefill_s_per_token, self.weight_samples) <= 0:
            raise ValueError("step_s, prefill_s_per_token and weight_samples must be > 0")
        if not 0 < self.spec_speedup <= 1 or not 0 < self.fit_bonus <= 1:
            raise ValueError("spec_speedup and fit_bonus must be in (0, 1]")


class LatencyPrior:
    """TTFT/TPOT guesses from a compiled config: batch cap, prefill budget, speculation, fit."""

    def __init__(self, config: CompiledConfig, prior: PriorConfig) -> None:
        self.config = config
        self.prior = prior

    def _factor(self, domain: str, prompt_tokens: int) -> float:
        fit = self.config.fit
        # NOTE: the default fit (any domain, any length) declares nothing: no bonus.
        declared = bool(fit.domains) or fit.prompt_tokens != DeclaredFit().prompt_tokens
        return self.prior.fit_bonus if declared and fit.covers(domain, prompt_tokens) else 1.0

    def ttft_s(self, domain: str, prompt_tokens: int, queue: float) -> float:
        p, e = self.prior, self.config.engine
        chunks = max(1, math.ceil(prompt_tokens / e.max_num_batched_tokens))
        prefill = chunks * p.step_s + prompt_tokens * p.prefill_s_per_token
        # waiting behind a full batch: about one request's worth of steps per batch slot
        waits = max(0.0, queue - e.max_num_seqs + 1) / e.max_num_seqs
        return (prefill + waits * 128 * self.tpot_s(domain, prompt_tokens, queue, 0)) \
            * self._factor(domain, prompt_tokens)

    def tpot_s(self, domain: str, prompt_tokens: int, batch: float, depth: int) -> float:
        p, e = self.prior, self.config.engine
        t = p.step_s + p.step_per_seq_s * min(batch, e.max_num_seqs)
        if (depth > 0 or e.spec_method != "none") and domain in p.copy_domains:
            t *= p.spec_speedup
        return t * self._factor(domain, prompt_tokens)


@dataclass
class _Models:
    ttft: RecursiveLeastSquares = field(default_factory=lambda: RecursiveLeastSquares(3))
    tpot: RecursiveLeastSquares = field(default_factory=lambda: RecursiveLeastSquares(3))


@dataclass(frozen=True)
class Prediction:
    ttft_s: float
    tpot_s: float
    num_samples: int  # bucket samples behind it (0 = prior / worker-level only)


class WorkerProfile:
    """Learned TTFT/TPOT for one worker: per-bucket and all-bucket models over a prior."""

    def __init__(self, prior: LatencyPrior, forgetting: float = 0.98) -> None:
        self.prior = prior
        self._forgetting = forgetting
        self._all = self._new()
        self._buckets: dict[tuple[str, int], _Models] = {}

    def _new(self) -> _Models:
        return _Models(RecursiveLeastSquares(3, self._forgetting),
                       RecursiveLeastSquares(3, self._forgetting))

    def predict(self, domain: str, prompt_tokens: int, queue: float, batch: float,
                depth: int) -> Prediction:
        xt, xp = ttft_features(prompt_tokens, queue), tpot_features(batch, depth)
        ttft = self.prior.ttft_s(domain, prompt_tokens, queue)
        tpot = self.prior.tpot_s(domain, prompt_tokens, batch, depth)
        n0 = self.prior.prior.weight_samples
        bucket = self._buckets.get((domain, prompt_band(prompt_tokens)))
        for models in (self._all, bucket):
            if models is None:
                continue
            ttft = _blend(ttft, models.ttft, xt, n0)
            tpot = _blend(tpot, models.tpot, xp, n0)
        return Prediction(ttft, tpot, bucket.tpot.num_samples if bucket else 0)

    def observe(self, domain: str, prompt_tokens: int, queue: float, batch: float, depth: int,
                ttft_s: float | None, tpot_s: float | None) -> None:
        key = (domain, prompt_band(prompt_tokens))
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = self._new()
        for models in (self._all, bucket):
            if ttft_s is not None and ttft_s >= 0 and math.isfinite(ttft_s):
                models.ttft.update(ttft_features(prompt_tokens, queue), ttft_s)
            if tpot_s is not None and tpot_s > 0 and math.isfinite(tpot_s):
                models.tpot.update(tpot_features(batch, depth), tpot_s)

    def num_samples(self, domain: str, prompt_tokens: int) -> int:
        bucket = self._buckets.get((domain, prompt_band(prompt_tokens)))
        return bucket.tpot.num_samples if bucket else 0

    def snapshot(self) -> dict[str, object]:
        return {"num_samples": self._all.tpot.num_samples,
                "buckets": {f"{d}/{b}": m.tpot.num_samples for (d, b), m in self._buckets.items()},
                "ttft_coef": [round(float(v), 5) for v in self._all.ttft.theta],
                "tpot_coef": [round(float(v), 6) for v in self._all.tpot.theta]}


def _blend(prior: float, model: RecursiveLeastSquares, x: tuple[float, ...], n0: float) -> float:
    """Sample-count weighted mix of a prediction so far and a learned model's (floored at 0)."""
    n = model.num_samples
    if n == 0:
        return prior
    learned = max(model.predict(x), 0.0)
    w = n / (n + n0)
    return w * learned + (1.0 - w) * prior
