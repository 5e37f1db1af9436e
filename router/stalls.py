"""Prefill stalls: what prompts' prefill does to the requests decoding on a worker.

On a continuous-batching worker the decodes and the prefills share the steps: the
engine schedules the running decodes first and gives the rest of the step's token
budget (``max_num_batched_tokens``) to prompts, oldest first. Two consequences, which
the adaptive policy prices (:mod:`router.adaptive`):

- Prefill queued or running when a request arrives is ahead of its own prompt in that
  order: it delays the request's first token (TTFT), not its decode.
- Prefill that arrives while a request decodes stalls each of its steps: the request
  waits out the prompt's whole prefill compute. The chunk size only spreads it over more
  or fewer steps (a 1,300-token prompt: five ~50 ms steps at 256, one ~250 ms step at
  2,048); TPOT, ``(e2e - TTFT) / (tokens - 1)``, counts the total. The policy charges
  that stall to the requests running there when it routes the prompt, on top of what
  each has been charged so far (:meth:`router.inflight.InFlight.add_stall`).

How many decode seconds a prefill second costs is :meth:`PrefillStalls.factor`, per
worker: learned online from finished requests -- the TPOT they measured beyond the
profile's prediction, against the prefill that ran within their decode
(:meth:`PrefillStalls.overlap_s`, from the prompts the policy routed there) -- as a
least-squares slope through the origin with forgetting, starting from the config's
prior, ``1 / engine cores`` (a prompt's prefill runs on one core and stalls the decodes
on that core only). The worker's profile learns TPOT with those stalls taken out, so it
predicts the worker's step time, and the stalls are priced where they arise.

Example: a one-core worker (factor 1) routed a 0.2 s prefill while a request with
16 output tokens decodes there: that request's TPOT grows by 0.2 / 15 = 13 ms.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StallConfig:
    max_events: int = 512  # routed prefills remembered per worker (for overlap_s)
    prior_samples: float = 20.0  # the prior factor weighs as much as this many samples
    forgetting: float = 0.99  # per sample, for the learned factor

    def __post_init__(self) -> None:
        if self.max_events <= 0 or self.prior_samples <= 0:
            raise ValueError("max_events and prior_samples must be > 0")
        if not 0.5 < self.forgetting <= 1.0:
            raise ValueError(f"forgetting: expected (0.5, 1], got {self.forgetting}")


@dataclass(frozen=True)
class Prefill:
    """One prompt routed to a worker: its prefill compute and when it should run."""

    start_s: float  # its prefill starts (policy clock)
    end_s: float  # ... and ends: the predicted first token
    seconds: float  # predicted prefill compute (uncached tokens)

    @classmethod
    def before_first_token(cls, sent_s: float, first_token_s: float, prefill_s: float
                           ) -> Prefill:
        """A prompt's prefill as it runs: right before its first token (the engine runs
        prompts oldest first, after any wait for a slot), not before it was sent."""
        return cls(max(first_token_s - prefill_s, sent_s), max(first_token_s, sent_s),
                   prefill_s)

    def within_s(self, start_s: float, end_s: float) -> float:
        """Prefill seconds that ran within [start_s, end_s], the compute spread evenly over
        [start_s, end_s] of the prefill."""
        if self.end_s <= start_s or self.start_s >= end_s:
            return 0.0
        span = self.end_s - self.start_s
        if span <= 0:
            return self.seconds
        return self.seconds * (min(self.end_s, end_s) - max(self.start_s, start_s)) / span


@dataclass
class _Slope:
    """Least-squares slope through the origin of residual TPOT on stall per token, with
    a prior worth ``prior_samples`` samples of the mean squared stall seen."""

    prior: float
    sum_xy: float = 0.0
    sum_xx: float = 0.0
    mean_xx: float = 0.0
    num_samples: int = 0


class PrefillStalls:
    """Per worker: the prompts routed there (for overlap_s) and the learned
    stall factor."""

    def __init__(self, config: StallConfig | None = None) -> None:
        self.config = config or StallConfig()
        self._events: dict[str, deque[Prefill]] = {}
        self._slopes: dict[str, _Slope] = {}

    def record(self, worker: str, sent_s: float, first_token_s: float, prefill_s: float
               ) -> None:
        """A prompt routed to ``worker`` at ``sent_s``, its first token predicted at
        ``first_token_s``, with ``prefill_s`` seconds of prefill compute."""
        if not (prefill_s > 0 and math.isfinite(prefill_s + sent_s + first_token_s)):
            return  # NOTE: one NaN window would make every later overlap on the worker NaN
        events = self._events.setdefault(worker, deque(maxlen=self.config.max_events))
        events.append(Prefill.before_first_token(sent_s, first_token_s, prefill_s))

    def overlap_s(self, worker: str, start_s: float, end_s: float) -> float:
        """Prefill seconds that ran on ``worker`` within [start_s, end_s], from every
        recorded prompt (:meth:`Prefill.within_s`)."""
        total = 0.0
        for e in self._events.get(worker, ()):
            # NOTE: the events outside the window (most of them) tested here, not in a call
            if e.end_s > start_s and e.start_s < end_s:
                total += e.within_s(start_s, end_s)
        return total

    def set_prior(self, worker: str, factor: float) -> None:
        """The factor before any sample (a new worker, or one whose config changed)."""
        self._slopes[worker] = _Slope(prior=factor)

    def factor(self, worker: str) -> float:
        """Decode seconds lost per prefill second on ``worker``: the prior, then learned."""
        s = self._slopes.get(worker)
        if s is None:
            return 1.0
        w = self.config.prior_samples * s.mean_xx
        if s.num_samples == 0 or w + s.sum_xx <= 0:
            return s.prior
        # NOTE: bounded to [0, 2 x prior]: one core cannot lose more than the prefill's
        # time twice over; below 0 a prefill would speed decodes up.
        slope = (w * s.prior + s.sum_xy) / (w + s.sum_xx)
        return min(max(slope, 0.0), 2.0 * s.prior)

    def observe(self, worker: str, stall_per_token_s: float, residual_s: float) -> None:
        """A finished request: the stall per output token it met (``overlap_s`` / gaps) and
        its TPOT less what the profile predicts without stalls, seconds."""
        s = self._slopes.get(worker)
        if s is None or not (stall_per_token_s > 0
                             and math.isfinite(stall_per_token_s + residual_s)):
            return
        x, lam = stall_per_token_s, self.config.forgetting
        s.sum_xy = lam * s.sum_xy + x * residual_s
        s.sum_xx = lam * s.sum_xx + x * x
        s.num_samples += 1
        # NOTE: the prior's weight is in samples of the stalls this worker sees (their mean
        # square, over about as many samples as the forgetting keeps), so it needs no unit
        memory = 1.0 / (1.0 - lam) if lam < 1.0 else math.inf
        s.mean_xx += (x * x - s.mean_xx) / min(s.num_samples, memory)

    def forget_worker(self, worker: str) -> None:
        self._events.pop(worker, None)
        self._slopes.pop(worker, None)

    def snapshot(self) -> dict[str, list[float]]:
        """worker -> [factor, samples]."""
        return {w: [round(self.factor(w), 4), s.num_samples] for w, s in sorted(self._slopes.items())}
