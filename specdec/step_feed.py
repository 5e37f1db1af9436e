"""Per-step timing from the engine into the depth policy's step-time model.

The policy needs ``t(batch, k)``: how long one decode step of ``batch`` sequences
takes when each asks for ``k`` speculative tokens. A client only sees per-request
averages, which blur prefill chunks, other requests' depths and queueing into one
number (a fit of them was measured to have priced a token of depth at batch 16 at
~7% of a step against ~30% measured). The engine knows each step exactly, so it
keeps the least-squares sufficient statistics of its decode steps and
exports them as counters on ``/metrics``; whoever scrapes the worker (the proxy's
scrape loop, the bench) diffs two scrapes and hands the window to
:meth:`specdec.policy.DepthPolicy.observe_step_sums`::

    engine step  -> DecodeStep(num_seqs, num_drafted, max_drafted, seconds, ...)
                 -> StepSums.add (engine side, a few float adds per step)
    /metrics     -> polyinfer:decode_step_fit_total{term="xtx_0_1"} ...
    scrape       -> StepFeed.on_metrics(worker, text) -> policy.observe_step_sums

Every step with at least one decoding sequence is reported, prefill chunks beside
them included: under load most decode rows share a step with a prompt chunk, where
draft rows cost little against the step. Features are the policy's
(:func:`specdec.step_model.step_features`): ``[1, decoding sequences, draft tokens
verified, the longest proposal, any proposal, prompt tokens, sequences verifying a
proposal]``; each step is weighted by ``1 / seconds^2``, as the
policy's own samples (relative error). The sums are exact: the policy fits the
same coefficients as if it had seen every step, at 37 numbers per scrape.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from specdec.policy import DepthPolicy
from specdec.step_model import NUM_FEATURES, step_features

logger = logging.getLogger(__name__)

METRIC = "polyinfer:decode_step_fit"  # a counter family; exposed as METRIC + "_total"
STEPS_TERM = "steps"  # the label value of the step count
PREFILL_TERM = "prefill_tokens"  # prompt tokens that shared those steps (unweighted)


@dataclass(frozen=True)
class DecodeStep:
    """One engine step in which at least one sequence decoded."""

    num_seqs: int  # sequences decoding in the step
    num_drafted: int  # draft tokens verified, all sequences together
    max_drafted: int  # the longest proposal
    seconds: float  # the whole step: propose, schedule, forward, verify, postprocess
    num_prefill: int = 0  # prompt tokens of prefill chunks in the same step
    # sequences verifying a proposal (at least one draft token); None: every decoding
    # sequence when any drafted, else none
    num_verifying: int | None = None

    @property
    def verifying(self) -> int:
        if self.num_verifying is not None:
            return self.num_verifying
        return self.num_seqs if self.max_drafted > 0 else 0


def _terms() -> list[tuple[str, int, int]]:
    """(label, i, j): the upper triangle of X^T X (j >= 0) then X^T y (j = -1)."""
    out = [(f"xtx_{i}_{j}", i, j) for i in range(NUM_FEATURES) for j in range(i, NUM_FEATURES)]
    return out + [(f"xty_{i}", i, -1) for i in range(NUM_FEATURES)]


TERMS = _terms()


@dataclass
class StepSums:
    """Weighted least-squares sums over decode steps: X^T W X (upper triangle), X^T W y, count."""

    values: list[float] = field(default_factory=lambda: [0.0] * len(TERMS))
    num_steps: float = 0.0
    num_prefill: float = 0.0  # prompt tokens in those steps, unweighted

    def add(self, step: DecodeStep) -> None:
        if not (step.seconds > 0.0 and math.isfinite(step.seconds)) or step.num_seqs <= 0:
            return
        x = step_features(step.num_seqs, step.num_drafted, step.max_drafted, step.num_prefill,
                          step.verifying)
        w = 1.0 / (step.seconds * step.seconds)
        v = self.values
        for n, (_, i, j) in enumerate(TERMS):
            v[n] += w * x[i] * (x[j] if j >= 0 else step.seconds)
        self.num_steps += 1
        self.num_prefill += step.num_prefill

    def minus(self, older: StepSums) -> StepSums:
        return StepSums([a - b for a, b in zip(self.values, older.values, strict=True)],
                        self.num_steps - older.num_steps, self.num_prefill - older.num_prefill)

    def matrices(self) -> tuple[list[list[float]], list[float]]:
        """(X^T W X as a full symmetric [F][F], X^T W y [F]), F features."""
        xtx = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        xty = [0.0] * NUM_FEATURES
        for value, (_, i, j) in zip(self.values, TERMS, strict=True):
            if j < 0:
                xty[i] = value
            else:
                xtx[i][j] = xtx[j][i] = value
        return xtx, xty

    def samples(self) -> list[tuple[str, float]]:
        """(term label, value) for the exporter, the step count first."""
        return [(STEPS_TERM, self.num_steps), (PREFILL_TERM, self.num_prefill),
                *((label, v) for (label, _, _), v in zip(TERMS, self.values, strict=True))]


def parse_step_sums(text: str) -> StepSums | None:
    """The sums in a Prometheus text exposition (summed over label sets); None if absent."""
    prefix = METRIC + "_total{"
    index = {label: n for n, (label, _, _) in enumerate(TERMS)}
    sums, found = StepSums(), False
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        labels, _, rest = line[len(prefix):].partition("}")
        term = _label(labels, "term")
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if term == STEPS_TERM:
            sums.num_steps += value
            found = True
        elif term == PREFILL_TERM:
            sums.num_prefill += value
        elif term in index:
            sums.values[index[term]] += value
    return sums if found else None


def _label(labels: str, name: str) -> str | None:
    for part in labels.split(","):
        key, _, value = part.partition("=")
        if key.strip() == name:
            return value.strip().strip('"')
    return None


class StepFeed:
    """Feeds each worker's new decode steps, from its scraped ``/metrics``, to a policy.

    Call :meth:`on_metrics` after every scrape of a worker. The first scrape hands over
    the worker's whole history; a counter that went backwards (the worker restarted)
    starts over from the new totals.
    """

    def __init__(self, policy: DepthPolicy) -> None:
        self.policy = policy
        self._last: dict[str, StepSums] = {}

    def on_metrics(self, worker: str, text: str) -> int:
        """Learn from the steps since the last scrape; returns how many there were."""
        sums = parse_step_sums(text)
        if sums is None:
            return 0
        last = self._last.get(worker)
        self._last[worker] = sums
        window = sums if last is None or sums.num_steps < last.num_steps else sums.minus(last)
        if window.num_steps <= 0:
            return 0
        xtx, xty = window.matrices()
        self.policy.observe_step_sums(worker, xtx, xty, int(window.num_steps),
                                      window.num_prefill)
        return int(window.num_steps)

    def forget(self, worker: str) -> None:
        self._last.pop(worker, None)
