"""Decisions that beat noise: interleaved A/B pairs, sample sizes from variance, a CI rule.

The candidate and the incumbent are measured alternately on the same engine
(incumbent, candidate, incumbent, candidate, ...); each pair's log ratio
cancels slow drifts of a shared machine that would swamp two separately
measured means. From a pilot of a few pairs, :func:`pairs_needed` gives how
many pairs detect the stated minimum detectable effect (MDE) at the stated
power; the candidate wins only when the lower bound of the gain's 95%
confidence interval clears the minimum gain (:func:`paired_gain`)::

    g = paired_gain(cand_values, inc_values, min_gain=0.02)
    g.significant           # CI lower bound > log(1.02)
    pairs_needed(g.sd, mde=0.05)   # pairs for a 5% effect at 80% power
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

NOISE_FLOOR = 0.01  # smallest standard error a paired comparison is credited with
Z_POWER_80 = 0.8416  # one-sided normal quantile for 80% power
# two-sided 95% Student t quantiles by degrees of freedom (1..30); z beyond
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    return _T975[df - 1] if 1 <= df <= len(_T975) else 1.96


@dataclass(frozen=True)
class GainReport:
    gain: float  # geometric mean of candidate / incumbent over the pairs, minus 1
    noise: float  # standard error of the mean log ratio (~ relative noise of the gain)
    threshold: float  # log(1 + min_gain): what the CI's lower bound had to clear
    significant: bool
    num_pairs: int
    ci_low: float = 0.0  # 95% confidence interval of the gain (ratio - 1)
    ci_high: float = 0.0
    sd: float = 0.0  # standard deviation of one pair's log ratio

    def to_dict(self) -> dict[str, float | int | bool | list[float]]:
        return {"gain": round(self.gain, 4), "ci": [round(self.ci_low, 4), round(self.ci_high, 4)],
                "noise": round(self.noise, 4), "pairs": self.num_pairs,
                "significant": self.significant}


def paired_gain(candidate: Sequence[float], incumbent: Sequence[float], min_gain: float = 0.02
                ) -> GainReport:
    """Gain from interleaved pairs; significant when the 95% CI lies above ``min_gain``.

    NOTE: the interval is Student's t on the mean log ratio, with the standard
    error floored at 1% (identical ratios from a coarse clock would claim zero
    noise; no two replays on one machine compare better than that) and a single
    pair assumed 5% noisy.
    """
    pairs = [(c, i) for c, i in zip(candidate, incumbent, strict=True) if c > 0 and i > 0]
    if not pairs:
        return GainReport(0.0, math.inf, math.inf, False, 0, -1.0, math.inf, math.inf)
    logs = [math.log(c / i) for c, i in pairs]
    mean = statistics.fmean(logs)
    sd = statistics.stdev(logs) if len(logs) > 1 else 0.05
    se = max(sd / math.sqrt(len(logs)) if len(logs) > 1 else 0.05, NOISE_FLOOR)
    half = t975(len(logs) - 1) * se
    threshold = math.log1p(min_gain)
    return GainReport(math.exp(mean) - 1.0, se, threshold, mean - half > threshold, len(pairs),
                      math.exp(mean - half) - 1.0, math.exp(mean + half) - 1.0, sd)


def pairs_needed(sd: float, mde: float, max_pairs: int = 1000) -> int:
    """Pairs whose 95% CI excludes 0 for a true gain of ``mde`` with 80% power.

    n = ((z_0.975 + z_0.8) * sd / log(1 + mde))^2, the per-pair noise ``sd`` floored
    like the standard error (a pilot of identical ratios is not noise-free).
    """
    if mde <= 0:
        return max_pairs
    sd = max(sd, NOISE_FLOOR)
    n = ((1.96 + Z_POWER_80) * sd / math.log1p(mde)) ** 2
    return max(2, min(max_pairs, math.ceil(n)))


def detectable_effect(sd: float, num_pairs: int) -> float:
    """The smallest gain ``num_pairs`` pairs detect with 80% power (the MDE they afford)."""
    sd = max(sd, NOISE_FLOOR)
    return math.expm1((1.96 + Z_POWER_80) * sd / math.sqrt(max(1, num_pairs)))
