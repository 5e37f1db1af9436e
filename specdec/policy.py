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
- a step-time model per worker (:class:`specdec.step_model.StepTimeModel`): the engine's
  step time at a batch and depth, fitted online, and its price per emitted token
  (:func:`specdec.step_model.token_cost`) calibrated by what finished requests measured.

All methods are synchronous and cheap (a decision is a loop over k <= 16).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.errors import ProposerConfigError
from specdec.step_model import NUM_FEATURES, StepTimeModel, batch_bucket, token_costs

logger = logging.getLogger(__name__)

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
    # Under load k is chosen for the worker's domain mix (see batch_tokens_per_step);
    # the mix forgets old requests by this factor per decision.
    mix_decay: float = 0.98
    # Prior step time in seconds, coefficients of [1, batch, batch*k, k] and optionally
    # [k > 0] (the fixed cost of verifying), prefill tokens in the step and sequences
    # verifying a proposal (0 when left out).
    step_prior_s: tuple[float, ...] = (0.010, 0.0005, 0.0003, 0.0005, 0.0, 0.0002)
    step_prior_weight: float = 4.0  # prior weight, in measured samples
    step_decay: float = 0.99  # weight kept by older samples at each new one
    # Weight kept by older engine-reported decode steps at each new step (specdec.step_feed).
    step_feed_decay: float = 0.999
    # Each depth's predicted cost per token is scaled by what finished requests measured
    # (StepTimeModel.calibration). For that, a request the policy would speculate for goes
    # at k=0 every probe_depth0_every-th decision per worker and batch bucket while that
    # bucket's k=0 cost rests on fewer than the calibration's prior samples, then every
    # probe_depth0_refresh-th (0 = never): see DepthPolicy.decide.
    probe_depth0_every: int = 10
    probe_depth0_refresh: int = 250
    # So that a depth the calibration priced out is measured again, every
    # probe_speculation_every-th request per worker and batch bucket that the policy sends
    # at k=0 goes at the depth the step model alone would choose, where that is k > 0
    # (0 = never): see DepthPolicy.commit.
    probe_speculation_every: int = 20

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
            (self.probe_depth0_every >= 0, "probe_depth0_every", ">= 0"),
            (self.probe_depth0_refresh >= 0, "probe_depth0_refresh", ">= 0"),
            (self.probe_speculation_every >= 0, "probe_speculation_every", ">= 0"),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise ProposerConfigError(
                    f"policy.{name}: expected {expected}, got {getattr(self, name)!r}")


# Per-token n-gram acceptance per domain, measured on the bundled pair
# (bench/spec_depth.py); a starting point for a worker the policy has not seen yet.
NGRAM_DOMAIN_PRIORS: tuple[tuple[str, float], ...] = (
    ("translation", 0.69), ("qa", 0.60), ("chat", 0.50), ("extraction", 0.49),
    ("code", 0.40), ("math", 0.29), ("summarization", 0.19), ("rag", 0.17))


def choose_depth(acceptance: float, batch: int, step_time: StepTimeModel, max_depth: int,
                 min_gain: float = 1.0, tokens_per_step: Sequence[float] | None = None,
                 drafts_per_step: Sequence[float] | None = None, calibrated: bool = True) -> int:
    """The k in 0..max_depth maximising E[accepted + 1] / t(batch, k); 0 unless it pays.

    ``tokens_per_step[k]``, when given, replaces the geometric E for k (see
    :meth:`AcceptanceEstimate.tokens_per_step`); ``drafts_per_step[k]`` the k draft tokens
    a sequence is assumed to verify per step (:meth:`AcceptanceEstimate.drafts_per_step`);
    ``calibrated=False`` prices by the step model alone (:func:`depth_token_times`).

    NOTE: the prompt tokens that share a step (:meth:`StepTimeModel.prefill_part`) are work
    per request, not per step: under steady load, requests that finish sooner bring their
    successors' prompts sooner (a closed loop), or the prompts arriving during a longer step
    make it longer still (an open one). So speculation does not spread that part of a step
    over more tokens: a token costs ``(t(k) - prefill) / E(k) + prefill``. Spread with the
    rest, 125 prompt tokens per step (52 of a 65-ms step) made k=4 look 1.06x faster than
    k=0 at concurrency 16 on the 2-core CPU, where it measured 0.84x.
    """
    times = depth_token_times(acceptance, batch, step_time, max_depth, tokens_per_step,
                              drafts_per_step, calibrated)
    best_k, best = 0, min_gain / times[0]
    for k in range(1, max_depth + 1):
        goodput = 1.0 / times[k]
        if goodput > best:
            best_k, best = k, goodput
    return best_k


def depth_token_times(acceptance: float, batch: int, step_time: StepTimeModel, max_depth: int,
                      tokens_per_step: Sequence[float] | None = None,
                      drafts_per_step: Sequence[float] | None = None,
                      calibrated: bool = True) -> list[float]:
    """Predicted seconds per emitted token of a sequence at each k in 0..max_depth (what
    :func:`choose_depth` compares; the arguments are its own): the step's token cost,
    times the calibration factor measured for k (with the client's wait per step and no
    factors when not ``calibrated``)."""
    calibrated = calibrated and bool(step_time.token_costs)
    factors = step_time.calibrations(batch, max_depth) if calibrated else [1.0] * (max_depth + 1)
    wait = not calibrated  # once calibrated, the factors carry the client's wait
    prefill = step_time.shared_prefill(batch, wait)
    expected: list[float] = [1.0]
    drafted: list[float | None] = [None]
    for k in range(1, max_depth + 1):
        expected.append(tokens_per_step[k]
                        if tokens_per_step is not None and k < len(tokens_per_step)
                        else expected_tokens_per_step(acceptance, k))
        drafted.append(drafts_per_step[k]
                       if drafts_per_step is not None and k < len(drafts_per_step) else None)
    costs = token_costs(step_time, batch, expected, drafted, wait, prefill)
    return [cost * factor for cost, factor in zip(costs, factors, strict=True)]


def batch_tokens_per_step(own: Sequence[float], mix: Sequence[tuple[float, Sequence[float]]],
                          batch: int) -> list[float]:
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
    share = (batch - 1) / batch
    return [(1.0 - share) * own[k] + share * sum(w * e[k] for w, e in mix) / total
            for k in range(len(own))]


@functools.lru_cache(maxsize=4096)
def solve_acceptance(mean_accepted: float, k: int) -> float:
    """The per-token acceptance a with sum_{i=1..k} a^i = mean_accepted (bisection).

    NOTE: a pure function of (accepted / steps, k), solved for every finished request that
    speculated (40 steps of bisection); the ratios of small counts repeat, so kept."""
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
    _drafts_cache: dict[tuple[int, float], list[float]] = field(default_factory=dict,
                                                                repr=False, compare=False)
    # bumped at every observation (what DepthPolicy.peek keeps of the estimate is valid
    # while it is unchanged)
    version: int = field(default=0, repr=False, compare=False)

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
        Cached until the next observation, as :meth:`tokens_per_step` (a decision under load
        reads it for every domain in the worker's mix: 151 -> 40 us a decision).
        """
        cached = self._drafts_cache.get((max_depth, prior_steps))
        if cached is not None:
            return cached
        out = []
        for k in range(max_depth + 1):
            steps = self.steps_at.get(k, 0.0)
            out.append((self.drafts_at.get(k, 0.0) + prior_steps * k) / (steps + prior_steps))
        out = [min(d, k) for k, d in enumerate(self._monotone(out, max_depth, prior_steps))]
        self._drafts_cache[(max_depth, prior_steps)] = out
        return out

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
        self._drafts_cache.clear()
        self.version += 1
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


class DepthPolicy:
    """Learned acceptance per (worker, domain) and step time per worker -> k per request."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self._acceptance: dict[tuple[str, str], AcceptanceEstimate] = {}
        self._step_time: dict[str, StepTimeModel] = {}
        self._mix: dict[str, dict[str, float]] = {}  # worker -> domain -> decayed request count
        self._decisions: dict[tuple[str, int], int] = {}  # (worker, batch bucket) -> decisions
        self._zero_decisions: dict[tuple[str, int], int] = {}  # the same, those sent at k=0
        # what peek derives and keeps while its inputs are unchanged (see peek's NOTE):
        # per worker, its mix's version (bumped by commit) and the mix's sums per k
        self._mix_version: dict[str, int] = {}
        self._mix_sums: dict[str, tuple] = {}
        # per (worker, batch, depth cap, calibrated), the step model's terms of a token cost
        self._step_terms: dict[tuple[str, int, int, bool], tuple] = {}

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
                                             c.step_feed_decay)
            self._step_time[worker] = model
        return model

    def decide(self, worker: str, domain: str, batch: int, max_depth: int | None = None) -> int:
        """k for a request joining ``worker`` (``batch`` sequences running, counting itself):
        :meth:`peek`, then :meth:`commit`."""
        return self.commit(worker, domain, batch, self.peek(worker, domain, batch, max_depth),
                           max_depth)

    def peek(self, worker: str, domain: str, batch: int, max_depth: int | None = None,
             calibrated: bool = True) -> int:
        """The k :meth:`decide` would choose, recording nothing: for pricing a worker the
        request may not go to.

        NOTE: a router prices every candidate worker at the depth it would run there. When
        that pricing recorded the decision, every worker's domain mix took in every request,
        wherever it went, and the k=0 probe counted candidates, not requests: a probe then
        priced the worker at k=0 and steered that very request away.
        ``calibrated=False``: the depth the step model alone would choose.

        NOTE: this runs for every speculating candidate of every routing decision. It is
        :func:`choose_depth` over :func:`batch_tokens_per_step` of the worker's mix, written
        out: the mix's sums per k (:meth:`_mix_sums_of`) and the step model's terms at the
        batch (:meth:`_step_terms_of`) are kept until what they are made of changes (a commit
        to the worker, an observation of an estimate in its mix, a change of its step
        model), and the rest is :func:`token_costs`' loop with the same operations in the
        same order, so the depth is the plain formulas' bit for bit
        (tests/router/test_same_decisions.py). With its terms kept a call took ~4-6 us on the
        2-core dev box, ~20 us before (bench/router_cost.py's state at 64 in flight).
        """
        times = self.peek_times(worker, domain, batch, max_depth, calibrated)
        best_k, best = 0, self.config.min_gain / times[0]  # choose_depth
        for k in range(1, len(times)):
            goodput = 1.0 / times[k]
            if goodput > best:
                best_k, best = k, goodput
        return best_k

    def peek_times(self, worker: str, domain: str, batch: int, max_depth: int | None = None,
                   calibrated: bool = True) -> list[float]:
        """What :meth:`peek` compares: :func:`depth_token_times` of the request's domain
        and the worker's mix at ``batch`` (see :meth:`peek`'s NOTE)."""
        c = self.config
        cap = c.max_depth if max_depth is None else min(max_depth, c.max_depth)
        est = self.acceptance(worker, domain)
        steps = c.prior_steps_per_depth
        expected = est.tokens_per_step(cap, steps)
        drafted = est.drafts_per_step(cap, steps)
        share = 0.0
        if batch > 1:
            total, sum_e, sum_d = self._mix_sums_of(worker, cap, steps)
            if total > 0.0:  # batch_tokens_per_step
                share = (batch - 1) / batch
                keep = 1.0 - share
        (t0, factors, prefill, head, per_row, wk, seqs, verify, pre, overhead,
         wait) = self._step_terms_of(worker, 1 if 1 > batch else batch, cap, calibrated)
        times = [t0]  # depth_token_times: expected[0] = 1, drafted[0] = None
        for k in range(1, cap + 1):
            if share:
                e = keep * expected[k] + share * sum_e[k] / total
                rows = keep * drafted[k] + share * sum_d[k] / total
            else:
                e, rows = expected[k], drafted[k]
            longest = seqs * rows  # token_costs, written out
            if not longest < k:
                longest = k
            step = head + per_row * rows + wk * longest + verify + pre
            if 1e-6 > step:
                step = 1e-6
            if overhead:
                step = step + wait
            left = step - prefill
            if 1e-9 > left:
                left = 1e-9
            times.append((left / (1.0 if 1.0 > e else e) + prefill) * factors[k])
        return times

    def _mix_sums_of(self, worker: str, cap: int, steps: float
                     ) -> tuple[float, list[float], list[float]]:
        """(total weight, sum of weight x E per k, the same of drafts per step) over the
        worker's domain mix: :func:`batch_tokens_per_step`'s sums, kept while the mix and its
        estimates are unchanged."""
        version = self._mix_version.get(worker, 0)
        kept = self._mix_sums.get(worker)
        if kept is not None and kept[0] == version and kept[1] == cap and kept[2] == steps:
            for e, v in kept[3]:
                if e.version != v:
                    break
            else:
                return kept[4]
        mix = self._mix.get(worker, {})
        ests = [(w, self.acceptance(worker, d)) for d, w in mix.items()]
        tokens = [(w, e.tokens_per_step(cap, steps)) for w, e in ests]
        drafts = [(w, e.drafts_per_step(cap, steps)) for w, e in ests]
        total = sum(w for w, _ in tokens)
        sums = (total, [sum(w * e[k] for w, e in tokens) for k in range(cap + 1)],
                [sum(w * e[k] for w, e in drafts) for k in range(cap + 1)])
        self._mix_sums[worker] = (version, cap, steps, [(e, e.version) for _, e in ests], sums)
        return sums

    def _step_terms_of(self, worker: str, batch: int, cap: int, calibrated: bool) -> tuple:
        """What :func:`depth_token_times` and :func:`token_costs` derive from the worker's
        step model at ``batch`` before their loop over k, and the k=0 time: kept while the
        model's version is unchanged."""
        model = self.step_time(worker)
        key = (worker, batch, cap, calibrated)
        kept = self._step_terms.get(key)
        if kept is not None and kept[0] is model:
            if kept[1] == model.version:
                return kept[2]
            calibrated = calibrated and bool(model.token_costs)
            if calibrated and kept[3] and kept[4] == model.fit_version:
                # only calibration cells changed: the factors, and t0 with them
                factors = model.calibrations(batch, cap)
                terms = (kept[5] * factors[0], factors, *kept[2][2:])
                self._step_terms[key] = (model, model.version, terms, True,
                                         model.fit_version, kept[5])
                return terms
        calibrated = calibrated and bool(model.token_costs)
        factors = model.calibrations(batch, cap) if calibrated else [1.0] * (cap + 1)
        overhead = not calibrated  # once calibrated, the factors carry the client's wait
        prefill = model.shared_prefill(batch, overhead)
        w0, wb, wbk, wk, w_spec, w_pre, w_ver = model._w
        wait = model.overhead(batch) if overhead else 0.0
        head = w0 + wb * batch
        per_row = wbk * batch
        seqs = 1.0 if 1.0 > batch else batch
        verify = w_spec + w_ver * batch
        pre = w_pre * model.mean_prefill
        cost0 = token_costs(model, batch, [1.0], [None], overhead, prefill)[0]
        terms = (cost0 * factors[0], factors, prefill, head, per_row, wk, seqs, verify, pre,
                 overhead, wait)
        # NOTE: calibrated, the terms but the factors are the fit's alone (no client wait)
        self._step_terms[key] = (model, model.version, terms, calibrated, model.fit_version,
                                 cost0)
        return terms

    def token_times(self, worker: str, domain: str, batch: int, max_depth: int | None = None
                    ) -> list[float]:
        """Predicted seconds per emitted token of one request of ``domain`` on ``worker`` at
        each depth k = 0..cap, ``batch`` sequences running (counting it): by its own
        domain's tokens per step, not the worker's mix, and the step time of the whole
        batch at k (an upper bound when only this request speculates that deep). What a
        router compares to the request's TPOT SLO; records nothing."""
        c = self.config
        cap = c.max_depth if max_depth is None else min(max_depth, c.max_depth)
        est = self.acceptance(worker, domain)
        return depth_token_times(est.mean, max(batch, 1), self.step_time(worker), cap,
                                 est.tokens_per_step(cap, c.prior_steps_per_depth),
                                 est.drafts_per_step(cap, c.prior_steps_per_depth))

    def commit(self, worker: str, domain: str, batch: int, k: int,
               max_depth: int | None = None) -> int:
        """Record that a request of ``domain`` joins ``worker`` at depth ``k`` (the worker's
        domain mix; the probes' counts); returns the depth to send: ``k``, or the depth a
        probe measures instead (0 for :meth:`_probe_depth0`; the step model's own choice,
        under ``max_depth``, for :meth:`_probe_speculation`)."""
        mix = self._mix.setdefault(worker, {})
        self._mix_version[worker] = self._mix_version.get(worker, 0) + 1
        for d in mix:
            mix[d] *= self.config.mix_decay
        mix[domain] = mix.get(domain, 0.0) + 1.0
        if k > 0:
            return 0 if self._probe_depth0(worker, batch) else k
        return self._probe_speculation(worker, domain, batch, max_depth)

    def _probe_speculation(self, worker: str, domain: str, batch: int,
                           max_depth: int | None) -> int:
        """0, or on every ``probe_speculation_every``-th k=0 decision per worker and batch
        bucket the depth the step model alone would choose (0 if it would not speculate).

        NOTE: the calibration's factor for a depth moves only with requests sent at it. Once
        it priced speculation out of a bucket (two stalled requests put every k > 0 of the
        spec worker's 2-sequence bucket at x4 on the device; in one routing call the spec
        worker ran k=0 for 647 of 693 requests), nothing measured it again. A
        probe costs at most one request's speculation loss in 20.
        """
        c = self.config
        every = c.probe_speculation_every
        if every <= 0 or max_depth == 0:
            return 0
        key = (worker, batch_bucket(batch))
        n = self._zero_decisions[key] = self._zero_decisions.get(key, 0) + 1
        if n % every:
            return 0
        return self.peek(worker, domain, batch, max_depth, calibrated=False)

    def _probe_depth0(self, worker: str, batch: int) -> bool:
        """Is this decision one that measures k=0 instead (see ``PolicyConfig``)?

        NOTE: the calibration can tell a speculation dearer than modelled from a cost common
        to every depth only where k=0 was measured too. A worker the policy always speculates
        on would never measure it: the draft proposer on the H200, 7-15x slower than k=0, kept
        drafting without a measured k=0. A probe costs one request's speculation gain.
        """
        c = self.config
        key = (worker, batch_bucket(batch))
        n = self._decisions[key] = self._decisions.get(key, 0) + 1
        model = self.step_time(worker)
        thin = model.samples_at(batch, 0) < model.calibration_prior
        every = c.probe_depth0_every if thin else c.probe_depth0_refresh
        return every > 0 and n % every == 0

    def snapshot(self) -> dict[str, dict[str, object]]:
        """What has been learned, per worker (JSON-able, for /stats): the step-time model's
        coefficients (ms, in :func:`specdec.step_model.step_features` order), the clients' wait per step and
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
                          xty: Sequence[float], num_steps: int, num_prefill: float = 0.0) -> None:
        """The worker's own decode steps since the last report (:mod:`specdec.step_feed`)."""
        self.step_time(worker).observe_sums(xtx, xty, num_steps, num_prefill)

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
            self.step_time(worker).observe_token_cost(
                max(batch, 1), depth, decode_s / (num_output_tokens - 1),
                (num_output_tokens - 1) / steps, drafted, num_output_tokens - 1)
            self.observe_step(worker, batch, depth, decode_s / steps, drafted)
