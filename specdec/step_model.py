"""The step-time model: what one engine step costs, and so what one emitted token costs.

``t(batch, k) = w . [1, batch, batch*d(k), k, k > 0, prefill, batch*(k > 0)]`` seconds
(:func:`step_features`), where ``d(k) <= k`` is the draft tokens a sequence verifies per
step at depth k, fitted online by least squares on measured ``(batch, k, step seconds)``
samples (the engine's own steps, :mod:`specdec.step_feed`, or else per-request averages),
anchored by a prior expressed as pseudo-samples. ``k > 0`` is the fixed cost of a
verifying step: on the CPU a 2-token step costs ~1.35x a 1-token one while each further
token adds only a few percent (``bench/specdec.py --step-costs``), a step a line in k
cannot fit; ``batch*(k > 0)`` the host work each speculating sequence costs a step.

:func:`token_cost` turns a step into seconds per emitted token, and
:meth:`StepTimeModel.calibration` corrects it per batch bucket and depth by what finished
requests measured. The depth policy (:mod:`specdec.policy`) compares depths with them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

NUM_FEATURES = 7
Features = tuple[float, float, float, float, float, float, float]
# Pseudo-samples of the prior step-time model sit on this grid.
_PRIOR_BATCHES = (1, 4, 16, 64)
_PRIOR_DEPTHS = (0, 1, 2, 4, 8)
_PRIOR_PREFILL = (0, 256)  # prompt tokens sharing the step


def step_features(num_seqs: float, num_drafted: float, max_drafted: float,
                  num_prefill: float = 0.0, num_verifying: float = 0.0) -> Features:
    """[1, decoding sequences, draft tokens verified, the longest proposal, any proposal,
    prompt tokens of prefill chunks in the same step, sequences verifying a proposal].

    NOTE: the last is the host work a speculating sequence costs each step whatever its
    proposal's length (its lookup, its acceptance, more tokens to hand over). On the H200,
    where a graph replay's cost hardly grows with rows, it is most of what speculation
    costs: at concurrency 16 a step at k=4 took ~2.3x a k=0 step, where a fit without this
    term (a fixed cost per speculating step and a cost per draft token) predicted 1.6x and
    kept speculating at a load where it no longer paid.
    """
    return (1.0, num_seqs, num_drafted, max_drafted, 1.0 if max_drafted > 0 else 0.0,
            num_prefill, num_verifying)


def _features(batch: float, k: float, drafted: float | None = None,
              prefill: float = 0.0) -> Features:
    """A step of ``batch`` sequences at depth k, each verifying ``drafted`` tokens (k if None)."""
    rows = k if drafted is None else drafted
    return step_features(batch, batch * rows, longest_proposal(batch, k, rows), prefill,
                         batch if k > 0 else 0.0)


def longest_proposal(batch: float, k: float, drafted: float) -> float:
    """The longest proposal in a step of ``batch`` sequences at depth k verifying ``drafted``
    tokens each on average: ``drafted`` alone, at most k and the batch's total together.

    NOTE: the engine's steps price the longest proposal (a feature of its own); charging k
    there instead overpriced a deep k whose proposals run short: at batch 1 and k=16 with
    3-token proposals, 13 x 0.11-0.16 ms on a ~5 ms step, and the policy kept chat and qa at
    k=3-4 where 16 measured 2-10% faster.
    """
    return min(k, max(batch, 1.0) * drafted)


RESIDUAL_WINDOW = 50.0  # client samples a residual mean averages over (then a moving mean)


def _weighted_mean(cells: Iterable[Sequence[float]]) -> float:
    """Mean of ``[mean, samples]`` cells, weighted by their samples."""
    pairs = list(cells)
    return sum(m * n for m, n in pairs) / sum(n for _, n in pairs)


def batch_bucket(batch: float) -> int:
    """The power of two at or above ``batch`` (1, 2, 4, 8, ...)."""
    return 1 << max(math.ceil(batch) - 1, 0).bit_length()


def _full_coefficients(coefficients: Sequence[float]) -> tuple[float, ...]:
    """4 to 7 coefficients; the missing ones (fixed speculation cost, prefill, per
    speculating sequence) are 0."""
    return (*coefficients, *[0.0] * (NUM_FEATURES - len(coefficients)))


def token_cost(step_time: StepTimeModel, batch: float, k: float, expected: float,
               drafted: float | None = None, overhead: bool = True,
               prefill: float | None = None) -> float:
    """Predicted seconds per emitted token of one sequence at depth k in a batch of ``batch``,
    emitting ``expected`` tokens per step: ``(t(k) - prefill) / E + prefill`` (the prompt
    tokens sharing a step are work per request; see :func:`specdec.policy.choose_depth`).
    ``overhead``: t includes the client's wait per step beyond the engine's step
    (:meth:`StepTimeModel.overhead`); without it, the engine's step alone. ``prefill``:
    :meth:`StepTimeModel.shared_prefill` at the same batch and ``overhead``, when the caller
    prices several depths at once."""
    if prefill is None:
        prefill = step_time.shared_prefill(batch, overhead)
    step = step_time.predict(batch, k, drafted) if overhead else \
        step_time.engine_step(batch, k, drafted)
    return max(step - prefill, 1e-9) / max(expected, 1.0) + prefill


def token_costs(step_time: StepTimeModel, batch: float, expected: Sequence[float],
                drafted: Sequence[float | None], overhead: bool = True,
                prefill: float | None = None) -> list[float]:
    """:func:`token_cost` at k = 0, 1, ... len(expected) - 1 at once (``expected[k]``,
    ``drafted[k]`` for each k).

    NOTE: the depth policy prices every depth of every speculating candidate at each
    decision; here the step's terms that do not depend on k are summed once and
    :meth:`StepTimeModel.engine_step` is written out, the same operations in the same
    order, so each cost is :func:`token_cost`'s bit for bit (tests/specdec/test_policy.py)."""
    if prefill is None:
        prefill = step_time.shared_prefill(batch, overhead)
    w0, wb, wbk, wk, w_spec, w_pre, w_ver = step_time._w
    wait = step_time.overhead(batch) if overhead else 0.0
    head = w0 + wb * batch
    per_row = wbk * batch
    seqs = 1.0 if 1.0 > batch else batch  # max(batch, 1.0)
    verify = w_spec + w_ver * batch
    pre = w_pre * step_time.mean_prefill
    out = []
    for k, (e, d) in enumerate(zip(expected, drafted, strict=True)):
        rows = k if d is None else d
        longest = seqs * rows
        if not longest < k:  # longest_proposal: min(k, ...)
            longest = k
        step = head + per_row * rows + wk * longest + (verify if k > 0 else 0.0) + pre
        if 1e-6 > step:
            step = 1e-6
        if overhead:
            step = step + wait
        left = step - prefill
        if 1e-9 > left:
            left = 1e-9
        out.append(left / (1.0 if 1.0 > e else e) + prefill)
    return out


@dataclass
class StepTimeModel:
    """t(batch, k) = w . [1, batch, batch*d, k, k > 0, prefill, batch*(k > 0)] seconds (d
    draft tokens verified per sequence, k when not known), least squares over decayed
    samples.

    NOTE: samples are weighted by 1 / t^2, i.e. the fit minimises relative error,
    so a 10 ms batch-1 step counts as much as a 200 ms batch-64 one (the policy
    compares ratios of step times at one batch size).

    Two sources of samples: per-request averages as a client sees them
    (:meth:`observe`) and the engine's own per-step sums (:meth:`observe_sums`,
    see :mod:`specdec.step_feed`). NOTE: once a worker reports its steps, the
    per-request averages no longer enter the fit: they mix prefill chunks, other
    requests' depths and queueing into the step time, and measured far off the
    steps themselves. They still measure one thing the engine's steps cannot: the
    time a client waits per step beyond the step itself (the engine loop handing
    outputs over, detokenizing, streaming), ~1 ms on a 3.6 ms batch-1 step on the
    2-core box. That cost is paid once per step whatever k is, so leaving it out
    made deeper k look dearer than it is (at concurrency 1 the policy stayed at
    k = 2-8 where k = 16 was 8% faster). It is learned per batch size, as the mean
    residual of the client's step times against the fitted steps
    (:meth:`overhead`), and added to every prediction.
    """

    prior_xtx: np.ndarray  # [F, F] prior pseudo-samples' X^T X (not decayed), F features
    prior_xty: np.ndarray  # [F]
    decay: float = 1.0
    xtx: np.ndarray = field(default_factory=lambda: np.zeros((NUM_FEATURES, NUM_FEATURES)))
    xty: np.ndarray = field(default_factory=lambda: np.zeros(NUM_FEATURES))
    num_samples: int = 0
    coef: np.ndarray = field(default_factory=lambda: np.zeros(NUM_FEATURES))
    feed_decay: float = 1.0  # per engine-reported step
    num_fed_steps: int = 0  # engine-reported decode steps seen (0: client samples only)

    # decayed like the sums: prompt tokens that shared the engine's decode steps, and steps
    prefill_tokens: float = 0.0
    prefill_steps: float = 0.0
    # per batch bucket (a power of two): [mean seconds a client waits per step beyond the
    # fitted step, samples] (see the class NOTE)
    residuals: dict[int, list[float]] = field(default_factory=dict)
    # per (batch bucket, depth): moving means, weighted by decoded tokens, of [client's
    # seconds per token, batch, 1 / tokens per step, draft tokens per step], then requests
    # and their weight (see observe_token_cost, calibration)
    token_costs: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    # calibrations per (batch bucket, max depth), until the fit or a cell changes
    _calibrated: dict[tuple[int, int], list[float]] = field(default_factory=dict, repr=False,
                                                            compare=False)
    calibration_prior: float = 8.0  # requests (in their tokens) a depth needs to weigh as its bucket
    # batch bucket -> the measured one nearest it, while token_costs has _nearest_at cells
    # (cells are only ever added, so their count tells when the answers may change)
    _nearest: dict[int, int] = field(default_factory=dict, repr=False, compare=False)
    _nearest_at: int = field(default=-1, repr=False, compare=False)
    # bumped by every method that changes what the model predicts (the fit, the clients'
    # wait, the calibration cells): a caller may keep what it derived from the model while
    # this is unchanged (specdec.policy.DepthPolicy.peek)
    version: int = field(default=0, repr=False, compare=False)
    # bumped by the fit alone (_solve: the coefficients and the mean prefill), and by the
    # clients' wait alone (_observe_residual); what a calibration cell's ratio to the model
    # depends on besides the cell (_cell_ratio keeps each while these are unchanged)
    fit_version: int = field(default=0, repr=False, compare=False)
    wait_version: int = field(default=0, repr=False, compare=False)
    _ratios: dict[tuple[int, int], tuple] = field(default_factory=dict, repr=False,
                                                  compare=False)

    def __post_init__(self) -> None:
        self._solve()

    @property
    def mean_prefill(self) -> float:
        """Prompt tokens an engine decode step shares with prefill chunks, on average (0
        until the engine reports its steps)."""
        return self.prefill_tokens / self.prefill_steps if self.prefill_steps else 0.0

    @classmethod
    def from_prior(cls, coefficients: tuple[float, ...], weight: float,
                   decay: float = 1.0, feed_decay: float = 1.0) -> StepTimeModel:
        grid = [_features(b, k, None, p) for b in _PRIOR_BATCHES for k in _PRIOR_DEPTHS
                for p in _PRIOR_PREFILL]
        x = np.array(grid)  # [G, 6]
        y = x @ np.array(_full_coefficients(coefficients))  # [G]
        w = weight / len(grid) / y**2  # [G] relative-error weights
        return cls((x * w[:, None]).T @ x, (x * w[:, None]).T @ y, decay, feed_decay=feed_decay)

    @classmethod
    def from_coefficients(cls, coefficients: tuple[float, ...]) -> StepTimeModel:
        """A fixed model (a prior so heavy that samples barely move it); for tests and docs."""
        return cls.from_prior(coefficients, weight=1e12)

    def observe(self, batch: int, k: int, step_s: float, drafted: float | None = None) -> None:
        """One client-side sample: a request's mean step time at ``batch`` and depth ``k``
        (``drafted`` draft tokens verified per step, k if None). Once the engine reports its
        steps, only the residual over the fitted step is kept (:meth:`overhead`)."""
        if not (step_s > 0.0 and math.isfinite(step_s)) or batch <= 0 or k < 0:
            return
        if self.num_fed_steps:
            self._observe_residual(batch, step_s - self.engine_step(batch, k, drafted, None))
            return
        x = np.array(_features(batch, k, drafted))
        w = 1.0 / step_s**2
        self.xtx = self.decay * self.xtx + w * np.outer(x, x)
        self.xty = self.decay * self.xty + w * x * step_s
        self.num_samples += 1
        self._solve()

    def observe_sums(self, xtx: Sequence[Sequence[float]], xty: Sequence[float],
                     num_steps: int, num_prefill: float = 0.0) -> None:
        """Engine-reported decode steps: their weighted sums X^T W X [F, F], X^T W y [F] and
        the prompt tokens of prefill chunks that shared those steps (unweighted)
        (:mod:`specdec.step_feed`)."""
        a, b = np.asarray(xtx, dtype=float), np.asarray(xty, dtype=float)
        if num_steps <= 0 or a.shape != (NUM_FEATURES, NUM_FEATURES) \
                or b.shape != (NUM_FEATURES,) or not (np.isfinite(a).all() and np.isfinite(b).all()):
            return
        if not self.num_fed_steps:  # the engine's steps replace the client's averages
            self.xtx, self.xty = np.zeros_like(self.xtx), np.zeros_like(self.xty)
        keep = self.feed_decay ** num_steps
        self.xtx = keep * self.xtx + a
        self.xty = keep * self.xty + b
        self.prefill_tokens = keep * self.prefill_tokens + max(num_prefill, 0.0)
        self.prefill_steps = keep * self.prefill_steps + num_steps
        self.num_fed_steps += num_steps
        self._solve()

    def _solve(self) -> None:
        """Least squares with every coefficient >= 0 (a small active-set loop).

        NOTE: each coefficient is a cost (per step, per sequence, per token); noisy
        per-request averages from a shared machine can fit a negative one, which
        would make deeper k look cheaper than shallower k and the argmax meaningless.
        A feature whose coefficient comes out negative is dropped and the rest refit.
        """
        a = self.prior_xtx + self.xtx
        b = self.prior_xty + self.xty
        coef = np.zeros(len(b))
        active = list(range(len(b)))
        while active:
            sub = np.linalg.solve(a[np.ix_(active, active)], b[active])
            if sub.min() >= 0.0:
                coef[active] = sub
                break
            active.pop(int(np.argmin(sub)))
        coef[0] = max(coef[0], 1e-6)  # t must stay positive
        self._calibrated.clear()
        self.version += 1
        self.fit_version += 1
        self.coef = coef
        self._w = tuple(float(c) for c in self.coef)

    def prefill_part(self, batch: float) -> float:
        """Seconds of a depth-0 step of ``batch`` sequences that its prompt tokens take (the
        engine's recent mean per step; 0 before it reports its steps)."""
        return max(self.engine_step(batch, 0, None, None)
                   - self.engine_step(batch, 0, None, 0.0), 0.0)

    def shared_prefill(self, batch: float, overhead: bool = True) -> float:
        """The prompt tokens' part of a depth-0 step (:meth:`prefill_part`), at most 0.99 of
        the step (:meth:`predict`, or :meth:`engine_step` without ``overhead``)."""
        # NOTE: prefill_part's first step is this one's: computed once (per decision)
        step = self.engine_step(batch, 0, None, None)
        part = max(step - self.engine_step(batch, 0, None, 0.0), 0.0)  # prefill_part
        if overhead:
            step = step + self.overhead(batch)  # predict
        return min(part, 0.99 * step)

    def _observe_residual(self, batch: int, residual_s: float) -> None:
        self.version += 1
        self.wait_version += 1
        bucket = batch_bucket(batch)
        mean, n = self.residuals.get(bucket) or (0.0, 0.0)
        n = min(n + 1.0, RESIDUAL_WINDOW)
        self.residuals[bucket] = [mean + (residual_s - mean) / n, n]

    def overhead(self, batch: float) -> float:
        """Seconds a client waits per step beyond the engine's step, at ``batch`` (the nearest
        measured batch bucket; 0 before any client sample after the engine's steps)."""
        if not self.residuals:
            return 0.0
        bucket = batch_bucket(batch)
        nearest = min(self.residuals, key=lambda b: (abs(math.log2(b / bucket)), b))
        return max(self.residuals[nearest][0], 0.0)

    def observe_token_cost(self, batch: int, k: int, seconds: float, expected: float,
                           drafted: float | None = None, tokens: float = 1.0) -> None:
        """One finished request: the ``seconds`` a token cost it as its client saw it, at its
        batch, depth, measured tokens per step and draft tokens per step, over its ``tokens``
        decoded tokens (the sample's weight).

        NOTE: weighted by tokens, a cell's mean is the cost of a token, not of a request: a
        request of 7 decoded tokens that shared one 30-ms prefill chunk measured 6 ms a token
        over the model's 2, and with every request weighing the same, a few such put every
        speculating depth of the spec worker's 2-sequence bucket at the clamp (x4) on the
        device, so the depth policy sent k=0 there."""
        if not (seconds > 0.0 and math.isfinite(seconds)) or batch <= 0 or k < 0 \
                or not (expected >= 1.0 and math.isfinite(expected)) \
                or not (tokens > 0.0 and math.isfinite(tokens)):
            return
        key = (batch_bucket(batch), int(k))
        self._calibrated.clear()
        self.version += 1
        cell = self.token_costs.setdefault(key, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
        n = min(cell[4] + 1.0, RESIDUAL_WINDOW)
        # the weight behind the means, kept over the last RESIDUAL_WINDOW requests' worth
        weight = (cell[5] * (n - 1.0) / cell[4] if cell[4] else 0.0) + tokens
        # NOTE: 1 / E, whose mean prices the cell exactly where a token costs t / E (a cell
        # mixes domains: code at E = 3 and rag at 1.2 average to more than t / mean E)
        share = tokens / weight  # each mean moves toward the sample by its share, written out
        cell[0] += (seconds - cell[0]) * share
        cell[1] += (float(batch) - cell[1]) * share
        cell[2] += (1.0 / expected - cell[2]) * share
        cell[3] += ((drafted if drafted is not None else 0.0) - cell[3]) * share
        cell[4], cell[5] = n, weight

    def _log_ratio(self, k: int, cell: Sequence[float]) -> float:
        """log(measured seconds per token / the engine's step model's, now) for one cell.

        NOTE: against the model as it is now, not as it was at each sample: early in a run the
        fit moves, and ratios frozen against it misled (the first fixed-depth block's k=2
        read cheap against an early fit, and adaptive then sent 46 of 48 requests at k=2)."""
        seconds, batch, inverse_expected, drafted = cell[:4]
        model = token_cost(self, batch, k, 1.0 / inverse_expected, drafted if k > 0 else None,
                           overhead=False)
        return math.log(min(max(seconds / model, 0.25), 4.0))

    def _cell_ratio(self, bucket: int, k: int, cell: Sequence[float]) -> float:
        """:meth:`_log_ratio` of a cell, kept while the fit and the cell's means are unchanged
        (an outcome moves one cell; the calibration reads every cell of its bucket)."""
        kept = self._ratios.get((bucket, k))
        if kept is not None and kept[0] == self.fit_version and kept[1] == cell[0] \
                and kept[2] == cell[1] and kept[3] == cell[2] and kept[4] == cell[3]:
            return kept[5]
        ratio = self._log_ratio(k, cell)
        self._ratios[(bucket, k)] = (self.fit_version, cell[0], cell[1], cell[2], cell[3], ratio)
        return ratio

    def calibration(self, batch: float, k: int) -> float:
        """The factor :func:`token_cost` of the engine's step alone (no client wait) at depth
        k is off by at ``batch``, as measured.

        NOTE: the step model prices what the engine's steps explain; what a depth costs
        beyond that (on the 2-core CPU at concurrency 16 a k=2 step cycle came out ~20 ms
        over it: event-loop work sharing the engine's GIL and cores; on the H200 at 16 a
        k=16 cycle 0.5 ms over a fitted 2.6 ms, a k=0 one 0.1 ms under) shows only in the
        tokens per second requests get. So finished requests' seconds per token are kept per
        batch bucket and depth (moving means, with what the model needs to price them:
        :meth:`observe_token_cost`), and a depth's factor is their ratio to the model's
        (:meth:`_log_ratio`), weighed by its tokens, shrunk toward its bucket's mean ratio by
        ``calibration_prior`` requests' worth of tokens: over its speculating depths for k > 0
        (what makes speculation dearer than modelled is mostly common to its depths: when
        only k=0 and k=2 had run, a k=16 priced at the mean of the two was pushed below
        k=2's measured cost, and adaptive sent 37 of 192 requests at k=2, 0.74x of k=16, at
        c=4 on the H200), over all depths for k=0. The speculating depths' mean is itself
        shrunk toward the bucket's by ``calibration_prior`` samples: taken alone, a bucket's
        first few speculating requests set every k > 0 there (two stalled ones put all six
        at the clamp, x4, on the device). A factor common to every depth cancels in
        the argmax, so only measured differences between depths move a choice. The client's
        wait per step
        (:meth:`overhead`) is a mean over all depths that moves with whichever depths ran
        last, so ratios are taken against the engine's step alone and, once there are any,
        the factors replace it (:func:`specdec.policy.choose_depth`).
        """
        return self.calibrations(batch, k)[k]

    def samples_at(self, batch: float, k: int) -> float:
        """Finished requests behind the calibration of depth k at ``batch`` (in the batch
        bucket :meth:`calibrations` reads; 0 before any)."""
        if not self.token_costs:
            return 0.0
        cell = self.token_costs.get((self._nearest_bucket(batch), int(k)))
        return cell[4] if cell is not None else 0.0

    def _nearest_bucket(self, batch: float) -> int:
        """The measured batch bucket nearest ``batch``'s (``token_costs`` must not be empty)."""
        bucket = batch_bucket(batch)
        if self._nearest_at != len(self.token_costs):
            self._nearest.clear()
            self._nearest_at = len(self.token_costs)
        nearest = self._nearest.get(bucket)
        if nearest is None:
            buckets = {b for b, _ in self.token_costs}
            nearest = self._nearest[bucket] = min(
                buckets, key=lambda b: (abs(math.log2(b / bucket)), b))
        return nearest

    def calibrations(self, batch: float, max_depth: int) -> list[float]:
        """:meth:`calibration` for k = 0..max_depth (the bucket's mean computed once).

        NOTE: kept until the fit or a cell changes (decisions outnumber both): re-reading
        every cell against the model at each decision, with the prompt share re-priced per
        depth too, took a decision at max_depth 16 from 95 us (before the calibration) to
        263 us; 131 us with this cache and the share priced once (``choose_depth``)."""
        if not self.token_costs:
            return [1.0] * (max_depth + 1)
        nearest = self._nearest_bucket(batch)
        cached = self._calibrated.get((nearest, max_depth))
        if cached is None:
            cached = self._calibrated[(nearest, max_depth)] = self._calibrate(nearest, max_depth)
        return cached

    def _calibrate(self, nearest: int, max_depth: int) -> list[float]:
        bucket = {k: v for (b, k), v in self.token_costs.items() if b == nearest}
        # evidence in tokens (observe_token_cost); the prior in its requests' worth of them
        cells = {k: (self._cell_ratio(nearest, k, v), v[5]) for k, v in bucket.items()}
        prior = self.calibration_prior * sum(v[5] for v in bucket.values()) \
            / sum(v[4] for v in bucket.values())
        common = _weighted_mean(cells.values())
        # the speculating depths' mean, itself shrunk toward the bucket's by the prior
        speculating = [v for k, v in cells.items() if k > 0] + [(common, prior)]
        common_spec = _weighted_mean(speculating)
        out = []
        for k in range(max_depth + 1):
            own_mean, own_n = cells.get(k, (0.0, 0.0))
            toward = common_spec if k > 0 else common
            out.append(math.exp((own_mean * own_n + toward * prior) / (own_n + prior)))
        return out

    def predict(self, batch: float, k: float, drafted: float | None = None,
                prefill: float | None = None) -> float:
        """Seconds for a step of ``batch`` sequences at depth k, each verifying ``drafted``
        draft tokens (k when None: full proposals), beside ``prefill`` prompt tokens (the
        engine's recent mean when None).

        NOTE: under load most decode rows ride in steps with a prefill chunk (up to the
        engine's token budget), where draft rows add little to a long step; priced against
        pure decode steps alone, depth looked 5x dearer than it was at concurrency 16."""
        return self.engine_step(batch, k, drafted, prefill) + self.overhead(batch)

    def engine_step(self, batch: float, k: float, drafted: float | None = None,
                    prefill: float | None = None) -> float:
        """:meth:`predict` without the client's wait per step: the engine's step alone."""
        w0, wb, wbk, wk, w_spec, w_pre, w_ver = self._w
        rows = k if drafted is None else drafted
        pre = self.mean_prefill if prefill is None else prefill
        longest = longest_proposal(batch, k, rows)
        return max(w0 + wb * batch + wbk * batch * rows + wk * longest
                   + ((w_spec + w_ver * batch) if k > 0 else 0.0) + w_pre * pre, 1e-6)
