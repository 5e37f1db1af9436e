"""The depth policy: how many tokens to speculate for one request, given what has been learned.

The core is one pure function, :func:`choose_depth`: with per-token acceptance
probability ``a`` a step at depth k emits on average
``E[accepted + 1] = (1 - a^(k+1)) / (1 - a)`` tokens and takes ``t(batch, k)``
seconds, so the policy picks the k that maximises ``E / t`` and answers 0 when
no k beats plain decoding by ``min_gain`` (high load, low acceptance)::

    >>> model = StepTimeModel.from_coefficients((0.010, 0.001, 0.0005, 0.0))
    >>> choose_depth(acceptance=0.8, batch=1, step_time=model, max_depth=6)
    6
    >>> choose_depth(acceptance=0.2, batch=64, step_time=model, max_depth=6)
    0

:class:`DepthPolicy` keeps the learned state around that function:

- acceptance per (worker, domain): a Beta posterior updated from the reported
  ``(num_draft_tokens, num_accepted_tokens)`` counts (see :meth:`AcceptanceEstimate.observe`);
- a step-time model per worker, ``t = w . [1, batch, batch*d(k), k, k > 0, prefill,
  batch*(k > 0)]`` seconds,
  where ``d(k) <= k`` is the draft tokens a sequence verifies per step at depth k
  (learned per domain with the acceptance: proposals are often shorter than k),
  fitted online by least squares on measured ``(batch, k, step seconds)`` samples
  (the engine's own steps, :mod:`specdec.step_feed`, or else per-request averages),
  anchored by a prior expressed as pseudo-samples. ``k > 0`` is the fixed
  cost of a verifying step: on the CPU a 2-token step costs ~1.35x a 1-token one
  while each further token adds only a few percent (``bench/specdec.py
  --step-costs``), a step a line in k cannot fit; ``batch*(k > 0)`` the host work
  each speculating sequence costs a step (see :func:`step_features`). With ``price_row_buckets`` (for a GPU
  with captured graphs, whose step cost is flat within a bucket of rows and not linear
  across them) the same fit adds one term per power-of-two bucket of the step's rows
  (:meth:`StepTimeModel.row_residual`);
- a calibration per worker, batch bucket and depth: what a token cost finished requests as
  their clients saw it, over what the model predicted (:meth:`StepTimeModel.calibration`).

All methods are synchronous and cheap (a decision is a loop over k <= 16).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from specdec.errors import ProposerConfigError

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


NUM_ROW_BUCKETS = 12  # rows 1, 2, 3-4, 5-8, ..., 1025-2048, and above (the last)


def row_bucket(num_rows: float) -> int:
    """Power-of-two bucket of a step's rows: 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ..."""
    return min(max(math.ceil(math.log2(max(num_rows, 1.0))), 0), NUM_ROW_BUCKETS - 1)


RESIDUAL_WINDOW = 50.0  # client samples a residual mean averages over (then a moving mean)


def _weighted_mean(cells: Iterable[Sequence[float]]) -> float:
    """Mean of ``[mean, samples]`` cells, weighted by their samples."""
    pairs = list(cells)
    return sum(m * n for m, n in pairs) / sum(n for _, n in pairs)


def _batch_bucket(batch: float) -> int:
    """The power of two at or above ``batch`` (1, 2, 4, 8, ...)."""
    return 1 << max(math.ceil(batch) - 1, 0).bit_length()


def _full_coefficients(coefficients: Sequence[float]) -> tuple[float, ...]:
    """4 to 7 coefficients; the missing ones (fixed speculation cost, prefill, per
    speculating sequence) are 0."""
    return (*coefficients, *[0.0] * (NUM_FEATURES - len(coefficients)))


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """E[accepted + 1] = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def expected_accepted(acceptance: float, k: int) -> float:
    return expected_tokens_per_step(acceptance, k) - 1.0


@dataclass(frozen=True)
class PolicyConfig:
    max_depth: int = 6  # never speculate deeper (a worker's own cap also applies)
    min_gain: float = 1.01  # speculate only if E/t beats depth 0 by this factor
    prior_acceptance: float = 0.5  # Beta prior mean for an unseen (worker, domain)
    # Per-domain prior means that replace prior_acceptance, e.g. NGRAM_DOMAIN_PRIORS.
    domain_priors: tuple[tuple[str, float], ...] = ()
    prior_strength: float = 8.0  # Beta prior weight, in tested draft tokens
    max_evidence: float = 4000.0  # cap on alpha + beta, so estimates track drift
    # Weight, in decode steps, of the geometric E(a, k) against steps measured at k.
    prior_steps_per_depth: float = 50.0
    # Under load, choose k for the worker's domain mix (see batch_tokens_per_step);
    # the mix forgets old requests by this factor per decision.
    share_depth_under_load: bool = True
    # Under load, one depth for the worker's mix alone, the request's own domain counted only
    # as part of the mix (see DepthPolicy.decide); off weighs it by its share of the batch.
    one_depth_under_load: bool = False
    mix_decay: float = 0.98
    # Prior step time in seconds, coefficients of [1, batch, batch*k, k] and optionally
    # [k > 0] (the fixed cost of verifying), prefill tokens in the step and sequences
    # verifying a proposal (0 when left out).
    step_prior_s: tuple[float, ...] = (0.010, 0.0005, 0.0003, 0.0005, 0.0, 0.0002)
    step_prior_weight: float = 4.0  # prior weight, in measured samples
    step_decay: float = 0.99  # weight kept by older samples at each new one
    # Weight kept by older engine-reported decode steps at each new step (specdec.step_feed).
    step_feed_decay: float = 0.999
    # Price each power-of-two bucket of a step's rows by what the fitted line misses there
    # (StepTimeModel.row_residual): on a GPU with graphs a step's cost is a step function
    # of its rows, which the line cannot follow. Off keeps the pure line (the CPU's fit).
    price_row_buckets: bool = False
    row_prior_steps: float = 1.0  # ridge on a bucket's term, in steps of that bucket
    # Scale each depth's predicted cost per token by what finished requests measured
    # (StepTimeModel.calibration). Off keeps the model's prediction alone.
    calibrate_token_cost: bool = True

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.max_depth <= 16, "max_depth", "0..16"),
            (self.min_gain >= 1.0, "min_gain", ">= 1"),
            (0.0 < self.prior_acceptance < 1.0, "prior_acceptance", "in (0, 1)"),
            (self.prior_strength > 0, "prior_strength", "> 0"),
            (all(0.0 < a < 1.0 for _, a in self.domain_priors), "domain_priors",
             "(domain, mean) pairs with means in (0, 1)"),
            (self.max_evidence > self.prior_strength, "max_evidence", "> prior_strength"),
            (self.prior_steps_per_depth > 0, "prior_steps_per_depth", "> 0"),
            (0.0 < self.mix_decay <= 1.0, "mix_decay", "in (0, 1]"),
            (4 <= len(self.step_prior_s) <= NUM_FEATURES
             and self.step_prior_s[0] > 0 and all(c >= 0 for c in self.step_prior_s),
             "step_prior_s", "4 to 7 coefficients >= 0 with a positive intercept"),
            (self.step_prior_weight > 0, "step_prior_weight", "> 0"),
            (0.0 < self.step_decay <= 1.0, "step_decay", "in (0, 1]"),
            (0.0 < self.step_feed_decay <= 1.0, "step_feed_decay", "in (0, 1]"),
            (self.row_prior_steps > 0, "row_prior_steps", "> 0"),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise ProposerConfigError(
                    f"policy.{name}: expected {expected}, got {getattr(self, name)!r}")


# Per-token n-gram acceptance per domain, measured on the bundled pair in session 1
# (bench/RESULTS.md); a starting point for a worker the policy has not seen yet.
NGRAM_DOMAIN_PRIORS: tuple[tuple[str, float], ...] = (
    ("translation", 0.69), ("qa", 0.60), ("chat", 0.50), ("extraction", 0.49),
    ("code", 0.40), ("math", 0.29), ("summarization", 0.19), ("rag", 0.17))


def choose_depth(acceptance: float, batch: int, step_time: StepTimeModel, max_depth: int,
                 min_gain: float = 1.0, tokens_per_step: Sequence[float] | None = None,
                 drafts_per_step: Sequence[float] | None = None) -> int:
    """The k in 0..max_depth maximising E[accepted + 1] / t(batch, k); 0 unless it pays.

    ``tokens_per_step[k]``, when given, replaces the geometric E for k (see
    :meth:`AcceptanceEstimate.tokens_per_step`); ``drafts_per_step[k]`` the k draft tokens
    a sequence is assumed to verify per step (:meth:`AcceptanceEstimate.drafts_per_step`).

    NOTE: the prompt tokens that share a step (:meth:`StepTimeModel.prefill_part`) are work
    per request, not per step: under steady load, requests that finish sooner bring their
    successors' prompts sooner (a closed loop), or the prompts arriving during a longer step
    make it longer still (an open one). So speculation does not spread that part of a step
    over more tokens: a token costs ``(t(k) - prefill) / E(k) + prefill``. Spread with the
    rest, 125 prompt tokens per step (52 of a 65-ms step) made k=4 look 1.06x faster than
    k=0 at concurrency 16 on the 2-core CPU, where it measured 0.84x.
    """
    factors = step_time.calibrations(batch, max_depth)
    wait = not step_time.token_costs  # once calibrated, the factors carry the client's wait
    best_k, best = 0, min_gain / (token_cost(step_time, batch, 0, 1.0, None, wait) * factors[0])
    for k in range(1, max_depth + 1):
        expected = (tokens_per_step[k] if tokens_per_step is not None and k < len(tokens_per_step)
                    else expected_tokens_per_step(acceptance, k))
        drafted = (drafts_per_step[k] if drafts_per_step is not None and k < len(drafts_per_step)
                   else None)
        goodput = 1.0 / (token_cost(step_time, batch, k, expected, drafted, wait) * factors[k])
        if goodput > best:
            best_k, best = k, goodput
    return best_k


def token_cost(step_time: StepTimeModel, batch: float, k: float, expected: float,
               drafted: float | None = None, overhead: bool = True) -> float:
    """Predicted seconds per emitted token of one sequence at depth k in a batch of ``batch``,
    emitting ``expected`` tokens per step: ``(t(k) - prefill) / E + prefill`` (the prompt
    tokens sharing a step are work per request; see :func:`choose_depth`). ``overhead``:
    t includes the client's wait per step beyond the engine's step
    (:meth:`StepTimeModel.overhead`); without it, the engine's step alone."""
    wait = 0.0 if overhead else step_time.overhead(batch)
    step = step_time.predict(batch, k, drafted) - wait
    prefill = min(step_time.prefill_part(batch), 0.99 * (step_time.predict(batch, 0) - wait))
    return max(step - prefill, 1e-9) / max(expected, 1.0) + prefill


def batch_tokens_per_step(own: Sequence[float], mix: Sequence[tuple[float, Sequence[float]]],
                          batch: int, own_weight: float | None = None) -> list[float]:
    """E[tokens per step] per k, averaged over a request and the ``batch - 1`` sharing its steps.

    ``mix`` is (weight, E per k) for each domain in the worker's recent traffic.
    NOTE: one engine step pads every decode query to the deepest one in the
    batch, so under load a worker gains most from one depth that suits its whole
    traffic mix, not from a different depth per request; at batch 1 this is the
    request's own E.
    """
    total = sum(w for w, _ in mix)
    if batch <= 1 or total <= 0.0:
        return list(own)
    share = (batch - 1) / batch if own_weight is None else 1.0 - own_weight
    return [(1.0 - share) * own[k] + share * sum(w * e[k] for w, e in mix) / total
            for k in range(len(own))]


def solve_acceptance(mean_accepted: float, k: int) -> float:
    """The per-token acceptance a with sum_{i=1..k} a^i = mean_accepted (bisection)."""
    if mean_accepted <= 0.0:
        return 0.0
    if mean_accepted >= k:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if expected_accepted(mid, k) < mean_accepted:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclass
class AcceptanceEstimate:
    """Beta(alpha, beta) posterior over the per-token acceptance probability.

    It also keeps, per depth k, the decode steps measured at k and the tokens
    they produced. Acceptance is not geometric in practice (an n-gram match
    in a repeated span is accepted whole, or not at all), so where a depth has
    been measured its observed tokens per step take over from the geometric
    prediction, which remains the prior for depths not tried yet.
    """

    alpha: float
    beta: float
    steps_at: dict[int, float] = field(default_factory=dict)  # depth -> decode steps seen
    tokens_at: dict[int, float] = field(default_factory=dict)  # depth -> tokens they produced
    drafts_at: dict[int, float] = field(default_factory=dict)  # depth -> draft tokens verified
    _cache: dict[tuple[int, float], list[float]] = field(default_factory=dict, repr=False,
                                                         compare=False)

    @property
    def mean(self) -> float:
        return self.alpha / (self.alpha + self.beta)

    def tokens_per_step(self, max_depth: int, prior_steps: float) -> list[float]:
        """E[accepted + 1] for k = 0..max_depth: measured steps shrunk toward the geometric E.

        ``(tokens_k + prior_steps * E_geo(a, k)) / (steps_k + prior_steps)``. Cached
        until the next observation (decisions outnumber observations).
        """
        cached = self._cache.get((max_depth, prior_steps))
        if cached is not None:
            return cached
        a = self.mean
        out = []
        for k in range(max_depth + 1):
            geo = expected_tokens_per_step(a, k)
            steps = self.steps_at.get(k, 0.0)
            out.append((self.tokens_at.get(k, 0.0) + prior_steps * geo) / (steps + prior_steps))
        out = self._monotone(out, max_depth, prior_steps)
        self._cache[(max_depth, prior_steps)] = out
        return out

    def _monotone(self, values: list[float], max_depth: int, prior_steps: float) -> list[float]:
        """Measured depths pooled into a non-decreasing run (weighted by their steps), then
        unmeasured ones kept between them (:func:`_pool_violators`, :func:`_between_measured`)."""
        measured = [k for k in range(max_depth + 1) if self.steps_at.get(k)]
        pooled = _pool_violators([values[k] for k in measured],
                                 [self.steps_at[k] + prior_steps for k in measured])
        out = list(values)
        for k, v in zip(measured, pooled, strict=True):
            out[k] = v
        return _between_measured(out, measured)

    def drafts_per_step(self, max_depth: int, prior_steps: float) -> list[float]:
        """Draft tokens a step verifies at k = 0..max_depth: measured, shrunk toward k.

        NOTE: a proposer often has fewer than k tokens to offer (an n-gram match runs out,
        a draft stops when unsure), so a step at depth k verifies fewer rows than k, and
        rows are what a step's time grows with. Unmeasured depths assume full proposals.
        """
        out = []
        for k in range(max_depth + 1):
            steps = self.steps_at.get(k, 0.0)
            out.append((self.drafts_at.get(k, 0.0) + prior_steps * k) / (steps + prior_steps))
        return [min(d, k) for k, d in enumerate(self._monotone(out, max_depth, prior_steps))]

    def observe(self, num_draft: int, num_accepted: int, depth: int, max_evidence: float,
                num_steps: int | None = None) -> None:
        """Add a request's counts; ``depth`` is the k it ran with (0 if unknown).

        Successes are the accepted tokens. Failures are the rejections, which the
        counts do not give directly: a request that ran ``num_steps`` decode steps
        at depth k (``num_draft / k`` when not given) accepted ``num_accepted /
        num_steps`` per step; under the geometric model that mean is
        ``a + ... + a^k`` and a step ends in a rejection with probability
        ``1 - a^k``, so failures are ``num_steps * (1 - a^k)`` and
        alpha / (alpha + beta) moves to ``a``. With no depth, every unaccepted
        draft token counts as a failure (an underestimate).

        NOTE: given ``num_steps`` (as :meth:`DepthPolicy.observe_request` does),
        steps where the proposer found nothing to propose count as steps with
        nothing accepted, so ``a`` is the effective acceptance that goodput needs.
        """
        if num_draft <= 0 and not num_steps:
            return
        self._cache.clear()
        num_accepted = min(max(num_accepted, 0), max(num_draft, 0))
        if depth > 0:
            steps = float(num_steps) if num_steps else num_draft / depth
            a = solve_acceptance(num_accepted / steps, depth)
            failures = steps * (1.0 - a**depth)
        else:
            failures = float(num_draft - num_accepted)
        self.alpha += num_accepted
        self.beta += failures
        total = self.alpha + self.beta
        if total > max_evidence:
            self.alpha *= max_evidence / total
            self.beta *= max_evidence / total
        if depth > 0 and num_steps:
            self._observe_steps(depth, num_steps, num_accepted, max(num_draft, 0), max_evidence)

    def _observe_steps(self, depth: int, num_steps: int, num_accepted: int, num_draft: int,
                       max_evidence: float) -> None:
        steps = self.steps_at.get(depth, 0.0) + num_steps
        tokens = self.tokens_at.get(depth, 0.0) + num_steps + num_accepted
        drafts = self.drafts_at.get(depth, 0.0) + num_draft
        if steps > max_evidence:
            tokens *= max_evidence / steps
            drafts *= max_evidence / steps
            steps = max_evidence
        self.steps_at[depth] = steps
        self.tokens_at[depth] = tokens
        self.drafts_at[depth] = drafts


def _pool_violators(values: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in weighted least squares (pool
    adjacent violators).

    NOTE: E[tokens per step] never falls with k (see :func:`_between_measured`), but
    depths measured on a few requests are noisy, and the policy's own choices pick the
    ones measured high by luck: extraction k=5 at 3.07 tokens per step beside k=8 at 2.64
    over 20x the steps made it choose 5. Pooled by evidence, a lucky few steps move little.
    """
    blocks: list[list[float]] = []  # [weighted mean, weight, count]
    for v, w in zip(values, weights, strict=True):
        blocks.append([v, w, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (v2, w2, n2), (v1, w1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [v for v, _, n in blocks for _ in range(int(n))]


def _between_measured(expected: list[float], measured: list[int]) -> list[float]:
    """Keep each unmeasured depth's E between those of the measured depths around it.

    NOTE: a proposal at depth k is a prefix of the proposal the same context gives at
    any deeper k, so E[tokens per step] (and the draft tokens verified) never falls with
    k. The geometric prior does not know that n-gram acceptance comes in whole runs: it
    saturates early, and put depths 5-7 (never measured) above a measured 8 or 16 that
    did better, so the policy picked them. Measured depths are kept as measured.
    """
    out = list(expected)
    for k in range(len(out)):
        if k in measured:
            continue
        below = [expected[j] for j in measured if j < k]
        above = [expected[j] for j in measured if j > k]
        if below:
            out[k] = max(out[k], max(below))
        if above:
            out[k] = min(out[k], min(above))
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
    # per row bucket (row_bucket): engine steps' [n, sum w, sum w x, sum w y], decayed like
    # the sums; fitted as one term per bucket only with price_rows (see row_residual)
    price_rows: bool = False
    row_prior_steps: float = 1.0
    row_sums: dict[int, np.ndarray] = field(default_factory=dict)
    row_terms: dict[int, float] = field(default_factory=dict)  # fitted seconds per row bucket
    # per (batch bucket, depth): moving means of [client's seconds per token, batch, 1 /
    # tokens per step, draft tokens per step], and samples (see calibration)
    token_costs: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    calibration_prior: float = 8.0  # samples a depth's own ratio needs to weigh as its bucket's

    def __post_init__(self) -> None:
        self._solve()

    @property
    def mean_prefill(self) -> float:
        """Prompt tokens an engine decode step shares with prefill chunks, on average (0
        until the engine reports its steps)."""
        return self.prefill_tokens / self.prefill_steps if self.prefill_steps else 0.0

    @classmethod
    def from_prior(cls, coefficients: tuple[float, ...], weight: float,
                   decay: float = 1.0, feed_decay: float = 1.0, price_rows: bool = False,
                   row_prior_steps: float = 1.0) -> StepTimeModel:
        grid = [_features(b, k, None, p) for b in _PRIOR_BATCHES for k in _PRIOR_DEPTHS
                for p in _PRIOR_PREFILL]
        x = np.array(grid)  # [G, 6]
        y = x @ np.array(_full_coefficients(coefficients))  # [G]
        w = weight / len(grid) / y**2  # [G] relative-error weights
        return cls((x * w[:, None]).T @ x, (x * w[:, None]).T @ y, decay,
                   feed_decay=feed_decay, price_rows=price_rows,
                   row_prior_steps=row_prior_steps)

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
            self._observe_residual(batch, step_s - self._predict_step(batch, k, drafted, None))
            return
        x = np.array(_features(batch, k, drafted))
        w = 1.0 / step_s**2
        self.xtx = self.decay * self.xtx + w * np.outer(x, x)
        self.xty = self.decay * self.xty + w * x * step_s
        self.num_samples += 1
        self._solve()

    def observe_sums(self, xtx: Sequence[Sequence[float]], xty: Sequence[float],
                     num_steps: int, num_prefill: float = 0.0,
                     row_sums: Mapping[int, Sequence[float]] | None = None) -> None:
        """Engine-reported decode steps: their weighted sums X^T W X [F, F], X^T W y [F], the
        prompt tokens of prefill chunks that shared those steps (unweighted), and per row
        bucket ``[steps, sum w, sum w x (F), sum w y]`` (:mod:`specdec.step_feed`)."""
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
        self._observe_rows(keep, row_sums or {})
        self._solve()

    def _observe_rows(self, keep: float, row_sums: Mapping[int, Sequence[float]]) -> None:
        for bucket in self.row_sums:
            self.row_sums[bucket] = keep * self.row_sums[bucket]
        for bucket, stats in row_sums.items():
            v = np.asarray(stats, dtype=float)
            if v.shape != (NUM_FEATURES + 3,) or not np.isfinite(v).all() or v[0] <= 0:
                continue
            self.row_sums[bucket] = self.row_sums.get(bucket, 0.0) + v

    def _solve(self) -> None:
        """Least squares with every coefficient >= 0 (a small active-set loop).

        NOTE: each coefficient is a cost (per step, per sequence, per token); noisy
        per-request averages from a shared machine can fit a negative one, which
        would make deeper k look cheaper than shallower k and the argmax meaningless.
        A feature whose coefficient comes out negative is dropped and the rest refit.
        With ``price_rows`` the row-bucket terms join the same fit (:meth:`_normal_equations`);
        they may be negative (a bucket cheaper than the line there) and are never dropped.
        """
        a, b, buckets = self._normal_equations()
        coef = np.zeros(len(b))
        active = list(range(len(b)))
        while active:
            sub = np.linalg.solve(a[np.ix_(active, active)], b[active])
            base = [n for n, i in enumerate(active) if i < NUM_FEATURES]
            if not base or sub[base].min() >= 0.0:
                coef[active] = sub
                break
            active.pop(base[int(np.argmin(sub[base]))])
        coef[0] = max(coef[0], 1e-6)  # t must stay positive
        self.coef = coef[:NUM_FEATURES]
        self._w = tuple(float(c) for c in self.coef)
        self.row_terms = {r: float(c) for r, c in zip(buckets, coef[NUM_FEATURES:], strict=True)}

    def _normal_equations(self) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """X^T W X and X^T W y over the features, plus (with ``price_rows``) one indicator per
        row bucket the engine reported: its cross terms are the bucket's ``sum w x``, its
        diagonal ``sum w`` plus a ridge of ``row_prior_steps`` of the bucket's mean step
        weight, which pulls a bucket seen in few steps towards the line."""
        a = self.prior_xtx + self.xtx
        b = self.prior_xty + self.xty
        buckets = sorted(r for r, v in self.row_sums.items() if v[0] > 0 and v[1] > 0) \
            if self.price_rows else []
        if not buckets:
            return a, b, []
        stats = np.array([self.row_sums[r] for r in buckets])  # [R, 3 + features]
        n, sw, swx, swy = stats[:, 0], stats[:, 1], stats[:, 2:-1], stats[:, -1]
        ridge = self.row_prior_steps * sw / n
        full = np.block([[a, swx.T], [swx, np.diag(sw + ridge)]])
        return full, np.concatenate([b, swy]), buckets

    def prefill_part(self, batch: float) -> float:
        """Seconds of a depth-0 step of ``batch`` sequences that its prompt tokens take (the
        engine's recent mean per step; 0 before it reports its steps)."""
        return max(self._predict_step(batch, 0, None, None)
                   - self._predict_step(batch, 0, None, 0.0), 0.0)

    def row_residual(self, num_rows: float) -> float:
        """Seconds a step of ``num_rows`` rows costs beyond the fitted line (0 without
        ``price_rows`` or before the engine reported a step in its row bucket).

        NOTE: on a GPU a step replays the captured graph of the smallest fitting bucket,
        whose time is flat within a bucket and not linear across them (H200, float32, tiny
        model: 1 row 0.32 ms, 2-4 rows 0.41, 16 rows 0.69, 32 rows 0.52), so one line through
        batch and draft tokens priced a batch-1 step at k=16 ~0.35 ms above k=4 where the
        runner measured 0.04 ms. A term per power-of-two bucket of rows (one per decoding
        sequence, its drafts, prompt tokens in the step), fitted with the line, follows it."""
        if not self.price_rows:
            return 0.0
        return self.row_terms.get(row_bucket(num_rows), 0.0)

    def _observe_residual(self, batch: int, residual_s: float) -> None:
        mean, n = self.residuals.setdefault(_batch_bucket(batch), [0.0, 0.0])
        n = min(n + 1.0, RESIDUAL_WINDOW)
        self.residuals[_batch_bucket(batch)] = [mean + (residual_s - mean) / n, n]

    def overhead(self, batch: float) -> float:
        """Seconds a client waits per step beyond the engine's step, at ``batch`` (the nearest
        measured batch bucket; 0 before any client sample after the engine's steps)."""
        if not self.residuals:
            return 0.0
        bucket = _batch_bucket(batch)
        nearest = min(self.residuals, key=lambda b: (abs(math.log2(b / bucket)), b))
        return max(self.residuals[nearest][0], 0.0)

    def observe_token_cost(self, batch: int, k: int, seconds: float, expected: float,
                           drafted: float | None = None) -> None:
        """One finished request: the ``seconds`` a token cost it as its client saw it, at its
        batch, depth, measured tokens per step and draft tokens per step."""
        if not (seconds > 0.0 and math.isfinite(seconds)) or batch <= 0 or k < 0 \
                or not (expected >= 1.0 and math.isfinite(expected)):
            return
        key = (_batch_bucket(batch), int(k))
        cell = self.token_costs.setdefault(key, [0.0, 0.0, 0.0, 0.0, 0.0])
        n = min(cell[4] + 1.0, RESIDUAL_WINDOW)
        # NOTE: 1 / E, whose mean prices the cell exactly where a token costs t / E (a cell
        # mixes domains: code at E = 3 and rag at 1.2 average to more than t / mean E)
        sample = (seconds, float(batch), 1.0 / expected, drafted if drafted is not None else 0.0)
        for i, x in enumerate(sample):
            cell[i] += (x - cell[i]) / n
        cell[4] = n

    def _log_ratio(self, k: int, cell: Sequence[float]) -> float:
        """log(measured seconds per token / the engine's step model's, now) for one cell.

        NOTE: against the model as it is now, not as it was at each sample: early in a run the
        fit moves, and ratios frozen against it misled (the first fixed-depth block's k=2
        read cheap against an early fit, and adaptive then sent 46 of 48 requests at k=2)."""
        seconds, batch, inverse_expected, drafted = cell[:4]
        model = token_cost(self, batch, k, 1.0 / inverse_expected, drafted if k > 0 else None,
                           overhead=False)
        return math.log(min(max(seconds / model, 0.25), 4.0))

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
        (:meth:`_log_ratio`) shrunk toward its bucket's mean ratio by ``calibration_prior``
        samples: over its speculating depths for k > 0
        (what makes speculation dearer than modelled is mostly common to its depths: when
        only k=0 and k=2 had run, a k=16 priced at the mean of the two was pushed below
        k=2's measured cost, and adaptive sent 37 of 192 requests at k=2, 0.74x of k=16, at
        c=4 on the H200), over all depths for k=0. A factor common to every depth cancels in
        the argmax, so only measured differences between depths move a choice. The client's
        wait per step
        (:meth:`overhead`) is a mean over all depths that moves with whichever depths ran
        last, so ratios are taken against the engine's step alone and, once there are any,
        the factors replace it (:func:`choose_depth`).
        """
        return self.calibrations(batch, k)[k]

    def calibrations(self, batch: float, max_depth: int) -> list[float]:
        """:meth:`calibration` for k = 0..max_depth (the bucket's mean computed once)."""
        if not self.token_costs:
            return [1.0] * (max_depth + 1)
        bucket = _batch_bucket(batch)
        buckets = {b for b, _ in self.token_costs}
        nearest = min(buckets, key=lambda b: (abs(math.log2(b / bucket)), b))
        cells = {k: (self._log_ratio(k, v), v[4]) for (b, k), v in self.token_costs.items()
                 if b == nearest}
        common = _weighted_mean(cells.values())
        speculating = [v for k, v in cells.items() if k > 0]
        common_spec = _weighted_mean(speculating) if speculating else common
        prior = self.calibration_prior
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
        return self._predict_step(batch, k, drafted, prefill) + self.overhead(batch)

    def _predict_step(self, batch: float, k: float, drafted: float | None,
                      prefill: float | None) -> float:
        w0, wb, wbk, wk, w_spec, w_pre, w_ver = self._w
        rows = k if drafted is None else drafted
        pre = self.mean_prefill if prefill is None else prefill
        longest = longest_proposal(batch, k, rows)
        return max(w0 + wb * batch + wbk * batch * rows + wk * longest
                   + ((w_spec + w_ver * batch) if k > 0 else 0.0) + w_pre * pre
                   + self.row_residual(batch * (1.0 + rows) + pre), 1e-6)


class DepthPolicy:
    """Learned acceptance per (worker, domain) and step time per worker -> k per request."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self._acceptance: dict[tuple[str, str], AcceptanceEstimate] = {}
        self._step_time: dict[str, StepTimeModel] = {}
        self._mix: dict[str, dict[str, float]] = {}  # worker -> domain -> decayed request count

    def acceptance(self, worker: str, domain: str) -> AcceptanceEstimate:
        est = self._acceptance.get((worker, domain))
        if est is None:
            c = self.config
            prior = dict(c.domain_priors).get(domain, c.prior_acceptance)
            est = AcceptanceEstimate(prior * c.prior_strength, (1.0 - prior) * c.prior_strength)
            self._acceptance[(worker, domain)] = est
        return est

    def step_time(self, worker: str) -> StepTimeModel:
        model = self._step_time.get(worker)
        if model is None:
            c = self.config
            model = StepTimeModel.from_prior(c.step_prior_s, c.step_prior_weight, c.step_decay,
                                             c.step_feed_decay, c.price_row_buckets,
                                             c.row_prior_steps)
            self._step_time[worker] = model
        return model

    def decide(self, worker: str, domain: str, batch: int, max_depth: int | None = None) -> int:
        """k for a request joining ``worker`` (``batch`` sequences running, counting itself)."""
        c = self.config
        cap = c.max_depth if max_depth is None else min(max_depth, c.max_depth)
        est = self.acceptance(worker, domain)
        steps = c.prior_steps_per_depth
        expected = est.tokens_per_step(cap, steps)
        drafted = est.drafts_per_step(cap, steps)
        mix = self._mix.setdefault(worker, {})
        if c.share_depth_under_load and batch > 1:
            # NOTE: with one_depth_under_load every request sharing the worker's steps gets the
            # depth of the mix: weighing its own domain by its share of the batch, requests of
            # different domains chose different depths in one batch (0, 1 and 4 at c=4 on the
            # CPU), and each step paid for the deepest while the shallow ones gained nothing.
            own = 0.0 if c.one_depth_under_load else None
            ests = [(w, self.acceptance(worker, d)) for d, w in mix.items()]
            expected = batch_tokens_per_step(
                expected, [(w, e.tokens_per_step(cap, steps)) for w, e in ests], batch, own)
            drafted = batch_tokens_per_step(
                drafted, [(w, e.drafts_per_step(cap, steps)) for w, e in ests], batch, own)
        for d in mix:
            mix[d] *= c.mix_decay
        mix[domain] = mix.get(domain, 0.0) + 1.0
        return choose_depth(est.mean, max(batch, 1), self.step_time(worker), cap, c.min_gain,
                            expected, drafted)

    def snapshot(self) -> dict[str, dict[str, object]]:
        """What has been learned, per worker (JSON-able, for /stats): the step-time model's
        coefficients (ms, in :func:`step_features` order), the clients' wait per step and
        the calibration factors per batch bucket, and per domain the acceptance and the
        expected tokens per step for k = 0..max_depth."""
        c = self.config
        domains: dict[str, dict[str, object]] = {}
        for (worker, domain), est in sorted(self._acceptance.items()):
            domains.setdefault(worker, {})[domain] = {
                "acceptance": round(float(est.mean), 4),
                "tokens_per_step": [round(float(e), 3) for e in est.tokens_per_step(
                    c.max_depth, c.prior_steps_per_depth)]}
        out: dict[str, dict[str, object]] = {w: {"domains": d} for w, d in domains.items()}
        for worker, model in self._step_time.items():
            buckets = sorted({b for b, _ in model.token_costs} | set(model.residuals))
            out.setdefault(worker, {"domains": {}}).update({
                "step_ms": [round(float(w) * 1e3, 4) for w in model.coef],
                "engine_steps": model.num_fed_steps,
                "mean_prefill_tokens": round(float(model.mean_prefill), 1),
                "client_wait_ms": {b: round(float(model.overhead(b)) * 1e3, 3) for b in buckets},
                "calibration": {b: [round(float(f), 3) for f in model.calibrations(b, c.max_depth)]
                                for b in buckets if model.token_costs}})
        return out

    def observe_acceptance(self, worker: str, domain: str, num_draft: int, num_accepted: int,
                           depth: int = 0, num_steps: int | None = None) -> None:
        self.acceptance(worker, domain).observe(num_draft, num_accepted, depth,
                                                self.config.max_evidence, num_steps)

    def observe_step(self, worker: str, batch: int, k: int, step_s: float,
                     drafted: float | None = None) -> None:
        self.step_time(worker).observe(batch, k, step_s, drafted)

    def observe_step_sums(self, worker: str, xtx: Sequence[Sequence[float]],
                          xty: Sequence[float], num_steps: int, num_prefill: float = 0.0,
                          row_sums: Mapping[int, Sequence[float]] | None = None) -> None:
        """The worker's own decode steps since the last report (:mod:`specdec.step_feed`)."""
        self.step_time(worker).observe_sums(xtx, xty, num_steps, num_prefill, row_sums)

    def observe_request(self, worker: str, domain: str, batch: int, depth: int, num_draft: int,
                        num_accepted: int, num_output_tokens: int, decode_s: float) -> None:
        """Learn from one finished request as a client sees it (counts + decode time).

        Every step emits accepted + 1 tokens, so the request's decode ran about
        ``num_output_tokens - 1 - num_accepted`` steps after the first token, and its
        mean step time is ``decode_s`` over that.
        """
        steps = num_output_tokens - 1 - num_accepted
        if depth > 0 and steps > 0:
            self.observe_acceptance(worker, domain, num_draft, num_accepted, depth, steps)
        if steps > 0 and decode_s > 0:
            drafted = max(num_draft, 0) / steps if depth > 0 else None
            if self.config.calibrate_token_cost:
                self.step_time(worker).observe_token_cost(
                    max(batch, 1), depth, decode_s / (num_output_tokens - 1),
                    (num_output_tokens - 1) / steps, drafted)
            self.observe_step(worker, batch, depth, decode_s / steps, drafted)
