"""Fleet-wide calibration of the latency prior: how fast this machine is.

:class:`router.profiles.LatencyPrior` derives each worker's TTFT and TPOT from
its compiled config with fixed constants (a 20 ms decode step, 0.2 ms per
prompt token, ...): it knows how configs differ from one another, not how fast
the hardware is. Without calibration a worker that has not been picked yet
keeps predicting those constants, so as soon as one worker measures faster
than its prior, every unmeasured worker looks slow and is never tried: the
first worker to learn wins all the traffic. bench/routing.py showed exactly
that: 50 of 60 requests on one of two identical workers, the long
prompts meant for the bulk worker included.

:class:`Calibration` learns one factor per key: a running geometric mean of
``observed / prior-predicted`` over every worker's finished requests. The
profiles use one key for TPOT and one per prompt-length band for TTFT, because
a short prompt's TTFT is mostly fixed overhead and a long one's mostly prefill
compute: scaling a long prompt's prior by the short prompts' ratio sent long
prompts to the wrong worker. A profile with no samples of its own predicts
``prior x factor`` and starts learning from there
(:class:`router.profiles.WorkerProfile`), so the prior's *relative* knowledge
(which config suits which shape) carries over to this machine's speed.
"""

from __future__ import annotations

import math

MAX_LOG_RATIO = math.log(100.0)  # one sample moves the mean by at most this (a 100x miss)


class Calibration:
    """Observed / prior latency ratio per key, shared by every profile of a policy."""

    def __init__(self, weight: float = 0.05) -> None:
        # weight: EWMA weight of one sample once more than 1 / weight were seen
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight: expected (0, 1], got {weight}")
        self.weight = weight
        self._log: dict[str, float] = {}  # key -> mean log ratio
        self._num: dict[str, int] = {}

    def observe(self, key: str, observed_s: float, prior_s: float) -> None:
        """One finished request: what it measured and what the uncalibrated prior said."""
        if not (observed_s > 0 and prior_s > 0 and math.isfinite(observed_s / prior_s)):
            return
        x = min(max(math.log(observed_s / prior_s), -MAX_LOG_RATIO), MAX_LOG_RATIO)
        n = self._num[key] = self._num.get(key, 0) + 1
        # NOTE: a plain mean for the first 1/weight samples, then an exponential average,
        # so the first few samples count fully and a later drift is still followed.
        w = max(1.0 / n, self.weight)
        mean = self._log.get(key, 0.0)
        self._log[key] = mean + w * (x - mean)

    def factor(self, key: str) -> float:
        """Multiply the prior's prediction by this; 1.0 before any sample of ``key``."""
        return math.exp(self._log.get(key, 0.0))

    def num_samples(self, key: str) -> int:
        return self._num.get(key, 0)

    def snapshot(self) -> dict[str, list[float]]:
        """key -> [factor, samples]."""
        return {k: [round(self.factor(k), 4), self._num[k]] for k in sorted(self._num)}
