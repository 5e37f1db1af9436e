"""The adaptive routing policy: predicted cost of this request on each worker, plus load.

For every routable worker the policy predicts this request's TTFT and TPOT
from the worker's learned profile (:mod:`router.profiles`) at the worker's
current load, with the speculative depth the depth policy
(:class:`specdec.policy.DepthPolicy`) would pick there, and scores

    cost = (TTFT + predicted_output_tokens * TPOT) x SLO penalty  +  interference

with TTFT = the profile's + the wait for a batch slot, and TPOT = the profile's + the
prefill ahead spread over the request's decode.

TTFT's prefill part counts only the prompt tokens the worker would have to
compute: the prompt less the leading blocks its prefix cache is expected to
hold (:mod:`router.affinity`: a model of each worker's cache from where
prompts were sent, sized by its KV cache, scaled by the hit ratio the worker
reports in ``usage.prompt_tokens_details.cached_tokens``). So prefix affinity
is part of the cost, not a rule: a worker that holds a request's prefix is
cheaper by the prefill it saves, and stops being chosen when its load costs
more than that.

The SLO penalty grows with the predicted relative miss of the request's
TTFT/TPOT SLO. ``prefill ahead`` is the prefill still to run on the worker for
prompts routed there earlier, spread over this request's decode (its TPOT).
``interference`` is what this prompt's own prefill costs the requests running
there: it stalls each of their decodes by its prefill time, so each one's
penalised cost with that stall, minus as predicted when it was sent
(:mod:`router.inflight`). So a long prompt is steered away from workers full
of tight-TPOT decodes, and a short one away from a worker busy prefilling,
without any rule about domains.

Profiles that have no samples yet predict their config's prior scaled by what
the other workers measured against theirs (:mod:`router.calibration`). The lowest cost wins, except that
with probability ``explore_prob`` a random unsaturated worker is tried, so
every profile keeps getting fresh samples.

Load enters three times, which is what keeps it from herding: the profiles'
TTFT depends on the batch and TPOT on the batch size; a worker past its batch
capacity (``max_num_seqs`` per engine core) pays the wait for a slot, until
enough of the requests ahead of it are predicted to finish; and below the
capacity, joining a batch is charged the slower steps it causes every request
running there (``crowding``: each one's penalised cost with its TPOT raised by
the profile's per-sequence slope for the steps they share). That last term is
the capacity-aware spill: a worker that is best for each request alone is
still the wrong place for the next one once the requests already there would
be pushed past their SLOs. So when one domain's favourite saturates, its cost
rises above the next-best worker's and traffic spreads
(tests/router/test_adaptive.py, tests/router/test_adaptive_sim.py; in the simulator, a
chunked-prefill fleet at 12 req/s met 0.926 of its SLOs with this interference and
crowding priced, 0.895 without). The same
holds for a hot prefix: its worker's saving is one prefill, its load grows with
every request sent there, and once another worker has been sent the prefix it
saves the same.

Every decision's reason is counted (``stats()``, for the proxy's /stats):
``only`` (one candidate), ``fit`` (the cheapest worker even unloaded),
``load`` (a different worker than the unloaded favourite, because of load),
``slo`` (the unloaded favourite would miss the SLO), ``affinity`` (the
cheapest worker only because of its cached prefix: another would win without
the prefix caches), ``explore``, ``balance`` (least-outstanding's pick, below).

Never worse than load-balancing: the policy measures its own prediction error online
(predicted against observed TTFT and TPOT per worker and shape class,
:mod:`router.confidence`) and routes by cost only where that cost is distinguishable
from least-outstanding's pick (LO, :class:`router.baselines.LeastOutstandingPolicy`):
where the cheapest worker's predicted cost is not lower than LO's pick's by more than
their error bands, or either worker's predictions for the shape are unproven (fewer
than ``confidence.min_samples`` outcomes), LO's pick goes, at the depth priced for it.
So a fleet or traffic the model does not fit is balanced as LO balances it, and the
outcomes of LO's picks keep measuring the model. ``stats()["prediction_error"]`` shows
the running errors.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from router.affinity import PrefixCacheModel
from router.base import RequestOutcome, RequestShape, RouteDecision, WorkerView
from router.baselines import LeastOutstandingPolicy
from router.calibration import Calibration
from router.confidence import ConfidenceConfig, PredictionErrors
from router.inflight import Flight, InFlight
from router.profiles import LatencyPrior, PriorConfig, WorkerProfile, batch_capacity
from specdec.policy import DepthPolicy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdaptiveConfig:
    explore_prob: float = 0.03  # chance of routing to a random unsaturated worker
    # prefix caches (router.affinity): the modelled cache size of a worker whose config
    # does not give one (vLLM: its KV cache on the GPU), tokens; the tokens per prefix
    # block when the shape does not say; the weight of each realised hit in a worker's ratio
    prefix_cache_tokens: int = 1 << 20
    prefix_block_tokens: float = 64.0
    hit_alpha: float = 0.1
    slo_penalty: float = 4.0  # cost multiplier per unit of relative SLO miss
    forgetting: float = 0.98  # RLS forgetting factor of the latency profiles
    prior: PriorConfig = field(default_factory=PriorConfig)
    max_pending: int = 65536  # decisions awaiting their outcome, remembered
    # when the model's pick is trusted over least-outstanding's (router.confidence); None:
    # everywhere, routing by predicted cost alone (what the cost model's own tests pin down)
    confidence: ConfidenceConfig | None = field(default_factory=ConfidenceConfig)

    def __post_init__(self) -> None:
        if not 0.0 <= self.explore_prob < 1.0:
            raise ValueError(f"explore_prob: expected [0, 1), got {self.explore_prob}")
        if self.slo_penalty < 0:
            raise ValueError(f"slo_penalty: expected >= 0, got {self.slo_penalty}")
        if self.prefix_cache_tokens < 0 or self.prefix_block_tokens <= 0:
            raise ValueError("prefix_cache_tokens must be >= 0 and prefix_block_tokens > 0")
        if not 0.0 < self.hit_alpha <= 1.0:
            raise ValueError(f"hit_alpha: expected (0, 1], got {self.hit_alpha}")
        if not 0.5 < self.forgetting <= 1.0:
            raise ValueError(f"forgetting: expected (0.5, 1], got {self.forgetting}")
        if self.max_pending <= 0:
            raise ValueError("max_pending must be > 0")


@dataclass(slots=True)
class Candidate:
    """One worker's predicted cost for the request at hand (read-only by convention).

    NOTE: not frozen: a frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``: 4.2 us for these 16 fields against 0.6 here, and a decision builds
    one per worker."""

    name: str
    cost_s: float  # predicted seconds, with saturation wait, SLO penalty and interference
    unloaded_cost_s: float  # the same at zero load: what the worker's fit alone predicts
    depth: int | None  # speculative depth to send (engine workers)
    queue: int
    batch: int
    saturated: bool
    meets_slo: bool
    ttft_s: float = 0.0  # predicted, with the slot wait
    tpot_s: float = 0.0  # predicted, with the prefill ahead spread over its decode
    prefill_s: float = 0.0  # this prompt's prefill compute on the worker (uncached part)
    wait_s: float = 0.0  # predicted wait for a batch slot, in ttft_s
    model_cached_tokens: float = 0.0  # prompt tokens the cache model says the worker holds
    cached_tokens: float = 0.0  # the same x the worker's realised hit ratio: what TTFT counts
    saved_s: float = 0.0  # what the cached prefix takes off cost_s (0 without one)
    capacity: int = 1  # the worker's batch slots (with the proxy's cap)
    penalty: float = 1.0  # the SLO cost multiplier at ttft_s / tpot_s (AdaptivePolicy._slo)


@dataclass(slots=True)
class _Worker:
    """What :meth:`AdaptivePolicy.candidate` reads of a worker's config, and its profile."""

    config: Any  # the CompiledConfig these were read from (compared by identity)
    backend: str
    prof: WorkerProfile
    capacity: int  # batch_capacity(config), before the proxy's cap
    engine: bool  # the built-in engine: the policy picks its speculative depth
    spec_none: bool  # an engine that does not speculate
    spec_max_depth: int
    caches_prefixes: bool


def caches_prefixes(view: WorkerView) -> bool:
    """Whether the worker keeps prompt prefixes cached across requests: the built-in engine
    when its config turns automatic prefix caching on (the default), vLLM always (automatic
    prefix caching is its default); an external server's cache is unknown: no."""
    if view.backend == "engine":
        return view.config.engine.enable_prefix_caching
    return view.backend == "vllm"


class AdaptivePolicy:
    """Cost-based routing over learned per-worker profiles; see the module docstring."""

    name = "adaptive"

    def __init__(self, config: AdaptiveConfig | None = None,
                 depth_policy: DepthPolicy | None = None, seed: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or AdaptiveConfig()
        self.depth_policy = depth_policy if depth_policy is not None else DepthPolicy()
        self.prefix_cache = PrefixCacheModel(self.config.hit_alpha)
        self._rng = random.Random(seed)
        self._profiles: dict[str, WorkerProfile] = {}
        self._workers: dict[str, _Worker] = {}  # see _worker
        # NOTE: one calibration for the whole fleet: what one worker measured against its
        # prior tells the others how fast this machine is (router.calibration).
        self.calibration = Calibration()
        self.clock = clock
        self._inflight = InFlight(self.config.max_pending)
        self.errors = PredictionErrors(self.config.confidence or ConfidenceConfig())
        self._balance = LeastOutstandingPolicy()
        self.reasons: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()
        self.depths: Counter[int] = Counter()

    # --- RoutingPolicy -------------------------------------------------------------------

    def choose(self, shape: RequestShape, workers: Sequence[WorkerView]) -> RouteDecision:
        cands = [self.candidate(shape, w) for w in workers]
        pick, reason = self._pick(cands)
        if self.config.confidence is not None and reason not in ("only", "explore"):
            pick, reason = self._unless_indistinct(shape, workers, cands, pick, reason)
        # NOTE: by identity: list.index compares with ==, a dataclass's field by field
        view = workers[0]
        for i, c in enumerate(cands):  # a loop, not next() over a generator: every request
            if c is pick:
                view = workers[i]
                break
        pick = self._commit_depth(shape, view, pick)
        self._remember(shape, pick, view)
        self.reasons[reason] += 1
        self.decisions[pick.name] += 1
        if pick.depth is not None:
            self.depths[pick.depth] += 1
        return RouteDecision(pick.name, pick.depth, reason)

    def observe(self, outcome: RequestOutcome) -> None:
        try:
            self._observe(outcome)
        except Exception:  # NOTE: contract: observe never raises into the request path
            logger.exception("adaptive policy failed to learn from an outcome")

    # --- scoring ---------------------------------------------------------------------------

    def profile(self, view: WorkerView) -> WorkerProfile:
        prof = self._profiles.get(view.name)
        if prof is None or (prof.prior.config is not view.config
                            and prof.prior.config != view.config):
            # NOTE: a new compiled config (optimizer reload) restarts the worker's profile,
            # and its prefix cache: the engine empties its cache on every reload.
            if prof is not None:
                self.prefix_cache.forget_worker(view.name)
            prof = WorkerProfile(LatencyPrior(view.config, self.config.prior),
                                 self.config.forgetting, self.calibration)
            self._profiles[view.name] = prof
        return prof

    def _worker(self, view: WorkerView) -> _Worker:
        """The worker's profile and what the policy reads of its config at every decision,
        kept while the view carries the same config object and backend."""
        w = self._workers.get(view.name)
        if w is not None and w.config is view.config and w.backend == view.backend \
                and self._profiles.get(view.name) is w.prof:
            return w
        prof = self.profile(view)
        e = view.config.engine
        engine = view.backend == "engine"
        w = self._workers[view.name] = _Worker(
            view.config, view.backend, prof, batch_capacity(view.config), engine,
            engine and e.spec_method == "none", e.spec_max_depth, caches_prefixes(view))
        return w

    def candidate(self, shape: RequestShape, view: WorkerView) -> Candidate:
        # NOTE: this runs for every worker of every decision: the worker's config terms are
        # kept (_worker), the loaded, idle and uncached predictions come from one call
        # (WorkerProfile.predict_candidate), and _depth's, _slo_depth's, _cost's and _slo's
        # plain formulas are written out, min / max as comparisons that pick the same operand
        # (tests/router/test_same_decisions.py, bench/router_cost.py: the same decisions).
        w = self._worker(view)
        prof = w.prof
        cap = w.capacity
        if view.max_outstanding and view.max_outstanding < cap:  # the proxy's cap
            cap = view.max_outstanding  # (proxy.admission)
        queue = view.outstanding_requests  # load_of
        scraped = view.running + view.waiting
        if scraped > queue:
            queue = scraped
        batch = queue + 1 if queue + 1 < cap else cap
        if not w.engine:  # _depth
            depth = None
        elif w.spec_none:
            depth = 0
        elif shape.speculative_depth is not None:
            depth = min(shape.speculative_depth, w.spec_max_depth)
        else:
            # NOTE: every candidate is priced at its depth; only the pick's is recorded
            # (_commit_depth), so a worker's domain mix and k=0 probe count its own requests.
            depth = self.depth_policy.peek(view.name, shape.domain, batch, w.spec_max_depth)
        d = depth or 0
        prompt_tokens = shape.prompt_tokens
        model_cached = 0.0  # _model_cached_tokens
        if shape.prefix_hashes and w.caches_prefixes:
            model_cached = self._model_cached_tokens(shape, view)
        cached = model_cached * self.prefix_cache.hit_ratio(view.name)
        ttft_p, tpot_p, prefill_s, idle_ttft, idle_tpot, full_ttft = prof.predict_candidate(
            shape.domain, prompt_tokens, queue, batch, d, cached)
        slo_tpot = shape.slo_tpot_s
        if depth is not None and slo_tpot and not tpot_p <= slo_tpot \
                and shape.speculative_depth is None and not w.spec_none:
            depth, tpot_p = self._slo_depth_tpot(shape, view, batch, depth, tpot_p)
        saved_s = 0.0
        if cached > 0:  # what the cached prefix takes off TTFT
            saved_s = full_ttft - ttft_p
            if 0.0 > saved_s:
                saved_s = 0.0
        now = self.clock()
        n_out = shape.predicted_output_tokens
        gaps = n_out - 1 if n_out > 1 else 0  # max(n - 1, 0)
        pred_cost_s = ttft_p + gaps * tpot_p  # _cost
        # NOTE: below capacity it joins the batch and slows every request running there
        # (crowding); at capacity it waits instead and slows no one.
        crowd_s = prof.tpot_per_seq_s() if queue < cap else 0.0
        # past capacity the request waits for a slot: until enough of those ahead finish;
        # the prefill routed there before that is still to run is spread over its decode
        # (TPOT); the harm is what it costs the flights there (_interference); one pass
        wait, ahead, harm = self._inflight.load_terms(
            view.name, now, queue + 1 - cap, cap, pred_cost_s, prefill_s, crowd_s, pred_cost_s,
            self.config.slo_penalty)
        ttft_s = ttft_p + wait
        tpot_s = tpot_p + ahead / (gaps if gaps > 1 else 1)  # max(n - 1, 1)
        cost = ttft_s + gaps * tpot_s
        miss = 0.0  # _slo
        slo_ttft = shape.slo_ttft_s
        if slo_ttft:
            x = ttft_s / slo_ttft - 1.0
            if x > 0.0:
                miss += x
        if slo_tpot:
            x = tpot_s / slo_tpot - 1.0
            if x > 0.0:
                miss += x
        penalty = 1.0 + self.config.slo_penalty * miss
        return Candidate(view.name, cost * penalty + harm, idle_ttft + gaps * idle_tpot, depth,
                         queue, batch, queue >= cap, miss == 0.0, ttft_s, tpot_s, prefill_s,
                         wait, model_cached, cached, saved_s * penalty, cap, penalty)

    def _model_cached_tokens(self, shape: RequestShape, view: WorkerView) -> float:
        """Prompt tokens in the leading prefix blocks the worker's modelled cache holds."""
        if not shape.prefix_hashes or not caches_prefixes(view):
            return 0.0
        num_blocks = self.prefix_cache.matched_blocks(view.name, shape.prefix_hashes)
        return min(num_blocks * self._block_tokens(shape), float(shape.prompt_tokens))

    def _block_tokens(self, shape: RequestShape) -> float:
        return shape.prefix_block_tokens or self.config.prefix_block_tokens

    def cache_capacity_tokens(self, view: WorkerView) -> float:
        """The worker's modelled prefix-cache size: its KV cache (per engine core), else
        ``prefix_cache_tokens``."""
        if view.backend == "engine":
            e = view.config.engine
            return float(e.kv_cache_tokens * max(e.data_parallel_size, 1))
        return float(self.config.prefix_cache_tokens)

    def _interference(self, worker: str, now: float, prefill_s: float, crowd_s: float,
                      cost_s: float) -> float:
        """The penalised delay this request adds to the requests running on the worker,
        seconds; see :mod:`router.inflight`.

        The delay to each running request is this prompt's prefill (it stalls their
        steps) plus ``crowd_s`` per step they share with this one while both run (a bigger
        batch makes every step slower): the externality that keeps the policy from piling
        requests onto the worker that looks best for each one alone. Each flight is
        priced as predicted when it was sent, with this request's delay alone
        (:meth:`router.inflight.InFlight.load_terms`, which :meth:`candidate` calls once
        for this, the slot wait and the prefill ahead together)."""
        return self._inflight.load_terms(worker, now, 0, 1, 0.0, prefill_s, crowd_s, cost_s,
                                         self.config.slo_penalty)[2]

    def _slo_of(self, slo_ttft_s: float | None, slo_tpot_s: float | None, ttft_s: float,
                tpot_s: float) -> tuple[float, bool]:
        """(cost multiplier, meets): 1 + slo_penalty x the summed relative misses."""
        miss = 0.0
        if slo_ttft_s:
            miss += max(0.0, ttft_s / slo_ttft_s - 1.0)
        if slo_tpot_s:
            miss += max(0.0, tpot_s / slo_tpot_s - 1.0)
        return 1.0 + self.config.slo_penalty * miss, miss == 0.0

    def _slo_depth_tpot(self, shape: RequestShape, view: WorkerView, batch: int, depth: int,
                        tpot_s: float) -> tuple[int, float]:
        """(depth, TPOT) for the request on the worker where the TPOT predicted at the depth
        policy's ``depth`` misses the request's TPOT SLO (:meth:`candidate` checks that, and
        that the depth is the policy's): the depth fastest for the request itself and the
        TPOT scaled by the depth policy's token times (DepthPolicy.token_times).

        NOTE: the depth policy picks one depth for the worker's domain mix under load (its
        tokens per second), which can leave a request of a well-accepted domain short of a
        tight TPOT SLO that a deeper depth would meet: on the device the spec worker ran at
        k=0 in one call and its repetitive requests met 2 of 55, at k=3 in another and they
        met 37 of 80. Routing by the request's own depth met 1.04x the SLOs of routing at
        the mix depth (826 / 797, two calls pooled)."""
        times = self.depth_policy.token_times(view.name, shape.domain, batch,
                                              view.config.engine.spec_max_depth)
        own = min(range(len(times)), key=times.__getitem__)
        if own == depth or depth >= len(times):
            return depth, tpot_s
        return own, tpot_s * times[own] / times[depth]

    def _commit_depth(self, shape: RequestShape, view: WorkerView, pick: Candidate) -> Candidate:
        """The pick with the depth the depth policy records for it (another when it probes)."""
        if pick.depth is None or shape.speculative_depth is not None \
                or view.config.engine.spec_method == "none":
            return pick
        depth = self.depth_policy.commit(view.name, shape.domain, pick.batch, pick.depth,
                                         view.config.engine.spec_max_depth)
        return pick if depth == pick.depth else replace(pick, depth=depth)

    def _pick(self, cands: list[Candidate]) -> tuple[Candidate, str]:
        if len(cands) == 1:
            return cands[0], "only"
        # NOTE: min(key=...) written out (the first of the least, as min), one pass
        best = favourite = cands[0]
        any_open = False
        for c in cands:
            if c.cost_s < best.cost_s:
                best = c
            if c.unloaded_cost_s < favourite.unloaded_cost_s:
                favourite = c
            if not c.saturated:
                any_open = True
        if any_open and self._rng.random() < self.config.explore_prob:
            return self._rng.choice([c for c in cands if not c.saturated]), "explore"
        if best.saved_s > 0 and min(cands, key=lambda c: c.cost_s + c.saved_s) is not best:
            return best, "affinity"
        if best.name == favourite.name:
            return best, "fit"
        return best, ("slo" if not favourite.meets_slo and best.meets_slo else "load")

    def _unless_indistinct(self, shape: RequestShape, workers: Sequence[WorkerView],
                           cands: list[Candidate], pick: Candidate, reason: str
                           ) -> tuple[Candidate, str]:
        """The pick, if its predicted cost beats least-outstanding's pick's by more than
        their prediction errors (router.confidence); else LO's pick, reason ``balance``."""
        # NOTE: cands are in the workers' order, one each
        other = cands[self._balance.pick(workers)]
        if other is pick:
            return pick, reason
        bands = [self.errors.band(c.name, shape.domain, shape.prompt_tokens) for c in (pick, other)]
        if self.errors.distinguishable(pick.cost_s, bands[0], other.cost_s, bands[1]):
            return pick, reason
        return other, "balance"

    # --- learning --------------------------------------------------------------------------

    def _remember(self, shape: RequestShape, pick: Candidate, view: WorkerView) -> None:
        if shape.prefix_hashes and caches_prefixes(view):
            self.prefix_cache.record(pick.name, shape.prefix_hashes, self._block_tokens(shape),
                                     self.cache_capacity_tokens(view))
        # NOTE: the proxy hands back the same RequestShape object in the outcome, so its
        # id() recovers the load this decision saw; entries are bounded and evicted FIFO.
        self._inflight.add(id(shape), Flight(
            pick.name, pick.queue, pick.batch, pick.depth or 0, self.clock(), pick.ttft_s,
            pick.tpot_s, max(shape.predicted_output_tokens, 1), pick.prefill_s,
            shape.slo_ttft_s, shape.slo_tpot_s, pick.penalty, wait_s=pick.wait_s,
            model_cached_tokens=pick.model_cached_tokens))

    def _observe(self, outcome: RequestOutcome) -> None:
        pending = self._inflight.pop(id(outcome.shape))
        if pending is not None and pending.worker != outcome.worker:
            pending = None  # a retry went elsewhere
        if outcome.status != "ok":
            return
        prof = self._profiles.get(outcome.worker)
        if prof is None:
            return
        shape = outcome.shape
        if pending is not None:
            self.errors.observe(outcome.worker, shape.domain, shape.prompt_tokens,
                                (pending.ttft_s, pending.tpot_s),
                                (outcome.ttft_s, outcome.tpot_s), outcome.completion_tokens)
        queue = pending.queue if pending else (outcome.batch_size or 0)
        batch = pending.batch if pending else max(1, outcome.batch_size or 1)
        depth = outcome.spec_depth if outcome.spec_depth is not None else (
            pending.depth if pending else 0)
        cached = self._observe_cached(outcome, pending)
        ttft_s, tpot_s = outcome.ttft_s, outcome.tpot_s
        wait_s = pending.wait_s if pending is not None else 0.0
        if ttft_s is not None and pending is not None and wait_s > 0:
            # NOTE: the TTFT model prices the batch a request shares; the wait for a slot
            # is priced apart (router.inflight), so it is not learned twice. Floor: a
            # quarter of the prediction without it (it may be overestimated).
            ttft_s = max(ttft_s - wait_s, 0.25 * (pending.ttft_s - wait_s))
        if ttft_s is None and outcome.e2e_s is not None and outcome.completion_tokens > 1:
            # NOTE: a non-streamed request shows only e2e; attribute the predicted TTFT
            # to its prefill and learn TPOT from the rest (TTFT itself stays unobserved).
            pred = prof.predict(shape.domain, shape.prompt_tokens, queue, batch, depth, cached)
            decode_s = outcome.e2e_s - pred.ttft_s
            if decode_s <= 0:  # the TTFT prediction overshoots: split e2e by predicted shares
                decode_pred = pred.tpot_s * (outcome.completion_tokens - 1)
                total = pred.ttft_s + decode_pred
                decode_s = outcome.e2e_s * (decode_pred / total if total > 0 else 0.5)
            tpot_s = decode_s / (outcome.completion_tokens - 1)
        prof.observe(shape.domain, shape.prompt_tokens, queue, batch, depth, ttft_s, tpot_s,
                     cached)
        worker = self._workers.get(outcome.worker)
        if worker is None or worker.engine:
            self._observe_depth(outcome, batch, depth)

    def _observe_cached(self, outcome: RequestOutcome, pending: Flight | None) -> float:
        """Prompt tokens the request found cached: as the worker reported them (then the
        worker's hit ratio learns from it), else as predicted at the decision."""
        predicted = pending.model_cached_tokens if pending is not None else 0.0
        realised = outcome.extra.get("cached_tokens")
        if realised is None or not math.isfinite(realised) or realised < 0:
            return predicted * self.prefix_cache.hit_ratio(outcome.worker)
        self.prefix_cache.observe_hit(outcome.worker, predicted, realised)
        return realised

    def _observe_depth(self, outcome: RequestOutcome, batch: int, depth: int) -> None:
        """Hand the request to the depth policy, at depth 0 too: a request of the built-in
        engine (:meth:`_observe` hands only those), the only backend whose depth the policy
        picks and prices (:meth:`candidate`).

        NOTE: a vLLM or external worker's requests are not the engine's decode steps, and
        their step-time model was read by no decision; fitting it (the depth policy's
        least squares, in numpy) was most of an outcome's cost on such a fleet.

        NOTE: requests that drafted nothing used to be skipped; then the policy never saw
        what a token costs at k=0, and its calibration (``StepTimeModel.calibration``) could
        not tell a speculation dearer than modelled (the draft proposer on the H200: 7-15x
        slower than k=0) from a cost common to every depth.
        """
        if outcome.ttft_s is None or outcome.e2e_s is None:
            return
        self.depth_policy.observe_request(
            outcome.worker, outcome.shape.domain, batch, depth, outcome.spec_draft_tokens,
            outcome.spec_accepted_tokens, outcome.completion_tokens,
            max(outcome.e2e_s - outcome.ttft_s, 0.0))

    # --- introspection ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Decision reasons, picks per worker, depths sent and profile summaries (JSON-able)."""
        return {"policy": self.name, "reasons": dict(self.reasons),
                "decisions": dict(self.decisions),
                "depths": {str(k): v for k, v in sorted(self.depths.items())},
                "prefix_cache": self.prefix_cache.snapshot(), "in_flight": len(self._inflight),
                "calibration": self.calibration.snapshot(),
                "prediction_error": {"fleet": self.errors.summary(),
                                     "workers": self.errors.snapshot()},
                "profiles": {n: p.snapshot() for n, p in self._profiles.items()}}
