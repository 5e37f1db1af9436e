"""How far the adaptive policy can trust its own predictions, and when to balance instead.

The adaptive policy predicts each request's TTFT and TPOT on every worker and
routes by the predicted cost. Where those predictions are poor (a fleet or a
traffic shape its priors and profiles do not fit) or unproven (too few
outcomes to tell), that cost is noise, and routing by noise loses to plain
load-balancing: least-outstanding (LO) spreads the work evenly and needs no
model at all.

:class:`PredictionErrors` measures the model online. Every finished request
compares what the decision predicted on the worker it went to with what it
measured: the log ratio ``ln(observed / predicted)`` of its TTFT, of its TPOT,
and of its end-to-end time (the predicted TTFT + the tokens it produced x the
predicted TPOT: the latency the cost is made of), each kept as a running
root-mean-square per worker and shape class (domain, prompt band: the buckets
the profiles learn in). A key's error band is its end-to-end RMS log error (the
TTFT and TPOT errors partly cancel in it, as they do in the cost; both are in
the stats); a key with fewer than ``min_samples`` outcomes takes its worker's
band over all shapes, and one of a worker with fewer than that is infinite.

:meth:`PredictionErrors.distinguishable` is the rule the policy applies: the
model's pick overrides LO's only when its predicted cost is lower than LO's
pick's by more than the two bands together (their root sum of squares, as for
independent errors, in log space), times ``margin_bands``: ``ln(cost_lo /
cost_pick) > margin_bands x sqrt(b_pick^2 + b_lo^2)``. So an accurate model
routes by cost wherever it sees a real difference, a poor one only where the
difference is large, and an unproven one not at all, and every outcome (LO's
picks included) keeps measuring it.

NOTE: ``margin_bands`` is 0.5, not 1. A band is the spread of one prediction's
error, and the two predictions compared are made at the same moment by the same
model for the same request: what the request turns out to be, how fast the
machine runs and the load that arrives after the decision move both alike, so
the spread of their difference is below the independent errors' root sum of
squares, which a whole band takes it to be. In the simulator, over the
prefix-mix model and the mixed-domain fleets, half a band met as many SLOs as a
whole one or more on every workload (bench/RESULTS.md, Routing): at one band the
fallback gave back the model's gain on a code-only load (0.851 of requests met,
LO 0.864), at half a band it kept it (0.904).

Example::

    errors = PredictionErrors()
    errors.observe("spec", "code", 120, predicted=(0.02, 0.0010), observed=(0.03, 0.0012))
    errors.band("spec", "code", 120)         # inf until min_samples outcomes
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from router.profiles import prompt_band

MAX_LOG_ERROR = math.log(100.0)  # one sample counts at most a 100x miss


@dataclass(frozen=True)
class ConfidenceConfig:
    # outcomes of a (worker, domain, prompt band) before its predictions count at all
    min_samples: int = 8
    # EWMA weight of one outcome in the running error, once more than 1 / weight were seen
    # (a plain mean before): ~20 outcomes of memory, so a fleet that changes is followed
    weight: float = 0.05
    # how many combined error bands the pick's predicted cost must beat LO's pick's by
    # (see the module docstring's NOTE)
    margin_bands: float = 0.5

    def __post_init__(self) -> None:
        if self.min_samples < 1:
            raise ValueError(f"min_samples: expected >= 1, got {self.min_samples}")
        if self.margin_bands < 0:
            raise ValueError(f"margin_bands: expected >= 0, got {self.margin_bands}")
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"weight: expected (0, 1], got {self.weight}")


@dataclass
class _Error:
    """Running mean squared log error of one key's TTFT and TPOT predictions."""

    num_ttft: int = 0
    num_tpot: int = 0
    ttft_sq: float = 0.0  # mean of ln(observed / predicted)^2
    tpot_sq: float = 0.0
    ttft_bias: float = 0.0  # mean of ln(observed / predicted): > 0, the model is optimistic
    tpot_bias: float = 0.0
    num_e2e: int = 0
    e2e_sq: float = 0.0


def _log_error(predicted_s: float | None, observed_s: float | None) -> float | None:
    if predicted_s is None or observed_s is None or not (predicted_s > 0 and observed_s > 0):
        return None
    x = math.log(observed_s / predicted_s)
    if not math.isfinite(x):
        return None
    if -MAX_LOG_ERROR > x:  # min(max(x, -MAX), MAX)
        return -MAX_LOG_ERROR
    return MAX_LOG_ERROR if MAX_LOG_ERROR < x else x


class PredictionErrors:
    """Predicted against observed TTFT and TPOT per (worker, domain, prompt band)."""

    def __init__(self, config: ConfidenceConfig | None = None) -> None:
        self.config = config or ConfidenceConfig()
        self._errors: dict[tuple[str, str, int], _Error] = {}
        # every outcome of a worker, whatever its shape: the band of a shape class the
        # worker has not yet served min_samples times (see band)
        self._by_worker: dict[str, _Error] = {}

    def observe(self, worker: str, domain: str, prompt_tokens: int,
                predicted: tuple[float, float], observed: tuple[float | None, float | None],
                num_tokens: int = 2) -> None:
        """One finished request: (TTFT, TPOT) as the decision predicted them on ``worker``
        and as measured, seconds (an unmeasured one, None, is skipped), and the tokens it
        produced (for its end-to-end time)."""
        key = (worker, domain, prompt_band(prompt_tokens))
        # NOTE: the log errors once, for the key's and the worker's running errors alike
        x_ttft = _log_error(predicted[0], observed[0])
        x_tpot = _log_error(predicted[1], observed[1])
        x_e2e = None
        if observed[0] is not None and observed[1] is not None:
            gaps = max(num_tokens - 1, 0)
            x_e2e = _log_error(predicted[0] + gaps * predicted[1],
                               observed[0] + gaps * observed[1])
        err = self._errors.get(key)
        if err is None:
            err = self._errors[key] = _Error()
        self._observe(err, x_ttft, x_tpot, x_e2e)
        err = self._by_worker.get(worker)
        if err is None:
            err = self._by_worker[worker] = _Error()
        self._observe(err, x_ttft, x_tpot, x_e2e)

    def _observe(self, err: _Error, x_ttft: float | None, x_tpot: float | None,
                 x_e2e: float | None) -> None:
        weight = self.config.weight  # _weight, written out: max(1 / n, weight)
        if x_ttft is not None:
            n = err.num_ttft = err.num_ttft + 1
            w = 1.0 / n
            if weight > w:
                w = weight
            err.ttft_sq += w * (x_ttft * x_ttft - err.ttft_sq)
            err.ttft_bias += w * (x_ttft - err.ttft_bias)
        if x_tpot is not None:
            n = err.num_tpot = err.num_tpot + 1
            w = 1.0 / n
            if weight > w:
                w = weight
            err.tpot_sq += w * (x_tpot * x_tpot - err.tpot_sq)
            err.tpot_bias += w * (x_tpot - err.tpot_bias)
        if x_e2e is not None:
            n = err.num_e2e = err.num_e2e + 1
            w = 1.0 / n
            if weight > w:
                w = weight
            err.e2e_sq += w * (x_e2e * x_e2e - err.e2e_sq)

    def band(self, worker: str, domain: str, prompt_tokens: int) -> float:
        """The key's error band in log space: its end-to-end RMS log error. A key with fewer
        than ``min_samples`` outcomes takes its worker's band over every shape (the same
        profile predicts them all), and the larger of the two where it has some; inf while
        the worker too has fewer than ``min_samples``."""
        key = self._errors.get((worker, domain, prompt_band(prompt_tokens)))
        if key is not None and key.num_e2e >= self.config.min_samples:
            return math.sqrt(key.e2e_sq)
        whole = self._by_worker.get(worker)
        if whole is None or whole.num_e2e < self.config.min_samples:
            return math.inf
        band = math.sqrt(whole.e2e_sq)
        return max(band, math.sqrt(key.e2e_sq)) if key is not None and key.num_e2e else band

    def distinguishable(self, cost_pick_s: float, band_pick: float, cost_other_s: float,
                        band_other: float) -> bool:
        """Whether ``cost_pick_s`` is lower than ``cost_other_s`` by more than
        ``margin_bands`` x the two predictions' error bands together (see the module
        docstring)."""
        if not (cost_pick_s > 0 and cost_other_s > 0) or math.isinf(band_pick + band_other):
            return False
        margin = self.config.margin_bands * math.hypot(band_pick, band_other)
        return math.log(cost_other_s / cost_pick_s) > margin

    def snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        """worker -> "domain/band" -> RMS and mean log error of TTFT and TPOT, samples
        (JSON-able; for /stats)."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (worker, domain, band), e in sorted(self._errors.items()):
            out.setdefault(worker, {})[f"{domain}/{band}"] = {
                "ttft_rms_log": round(math.sqrt(e.ttft_sq), 4),
                "tpot_rms_log": round(math.sqrt(e.tpot_sq), 4),
                "e2e_rms_log": round(math.sqrt(e.e2e_sq), 4),
                "ttft_bias_log": round(e.ttft_bias, 4), "tpot_bias_log": round(e.tpot_bias, 4),
                "num_ttft": e.num_ttft, "num_tpot": e.num_tpot}
        return out

    def summary(self) -> dict[str, float]:
        """Fleet-wide: the outcome-weighted RMS log error of TTFT and TPOT, and outcomes."""
        num_ttft = sum(e.num_ttft for e in self._errors.values())
        num_tpot = sum(e.num_tpot for e in self._errors.values())
        ttft = sum(e.ttft_sq * e.num_ttft for e in self._errors.values()) / max(num_ttft, 1)
        tpot = sum(e.tpot_sq * e.num_tpot for e in self._errors.values()) / max(num_tpot, 1)
        num_e2e = sum(e.num_e2e for e in self._errors.values())
        e2e = sum(e.e2e_sq * e.num_e2e for e in self._errors.values()) / max(num_e2e, 1)
        return {"ttft_rms_log": round(math.sqrt(ttft), 4),
                "tpot_rms_log": round(math.sqrt(tpot), 4),
                "e2e_rms_log": round(math.sqrt(e2e), 4),
                "num_ttft": num_ttft, "num_tpot": num_tpot}
