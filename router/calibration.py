"""Fleet-wide calibration of the latency prior: how fast this machine is.

:class:`router.profiles.LatencyPrior` derives each worker's TTFT and TPOT from
its compiled config with fixed constants (a 20 ms decode step, 0.2 ms per
prompt token, ...): it knows how configs differ from one another, not how fast
the hardware is. Without calibration a worker that has not been picked yet
keeps predicting those constants, so as soon as one worker measures faster
than its prior, every unmeasured worker looks slow and is never tried: the
first worker to learn wins all the traffic. bench/routing.py showed exactly
that (session 3): 50 of 60 requests on one of two identical workers, the long
prompts meant for the bulk worker included.

:class:`Calibration` learns one factor per quantity (TTFT, TPOT): a running
geometric mean of ``observed / prior-predicted`` over every worker's finished
requests. A profile with no samples of its own predicts ``prior x factor`` and
starts learning from there (:class:`router.profiles.WorkerProfile`), so the
prior's *relative* knowledge (which config suits which shape) carries over to
this machine's speed.
"""

from __future__ import annotations

import math
from typing import Literal

Quantity = Literal["ttft", "tpot"]
MAX_LOG_RATIO = math.log(100.0)  # one sample moves the mean by at most this (a 100x miss)


class Calibration:
    """Observed / prior latency ratio per quantity, shared by every profile of a policy."""

    def __init__(self, weight: float = 0.05) -> None:
        # weight: EWMA weight of one sample once more than 1 / weight were seen
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight: expected (0, 1], got {weight}")
        self.weight = weight
        self._log: dict[str, float] = {"ttft": 0.0, "tpot": 0.0}
        self._num: dict[str, int] = {"ttft": 0, "tpot": 0}

    def observe(self, quantity: Quantity, observed_s: float, prior_s: float) -> None:
        """One finished request: what it measured and what the uncalibrated prior said."""
        if not (observed_s > 0 and prior_s > 0 and math.isfinite(observed_s / prior_s)):
            return
        x = min(max(math.log(observed_s / prior_s), -MAX_LOG_RATIO), MAX_LOG_RATIO)
        n = self._num[quantity] = self._num[quantity] + 1
        # NOTE: a plain mean for the first 1/weight samples, then an exponential average,
        # so the first few samples count fully and a later drift is still followed.
        w = max(1.0 / n, self.weight)
        self._log[quantity] += w * (x - self._log[quantity])

    def factor(self, quantity: Quantity) -> float:
        """Multiply the prior's prediction by this; 1.0 before any sample."""
        return math.exp(self._log[quantity])

    def num_samples(self, quantity: Quantity) -> int:
        return self._num[quantity]

    def snapshot(self) -> dict[str, float]:
        return {"ttft_factor": round(self.factor("ttft"), 4),
                "tpot_factor": round(self.factor("tpot"), 4),
                "num_samples": self._num["ttft"] + self._num["tpot"]}
