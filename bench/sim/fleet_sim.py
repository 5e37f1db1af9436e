"""SimulatedFleet: a time-stepped model of continuous-batching workers, for closed-loop
policy tests (heterogeneous, loaded fleets cannot run on the 2-core test box).

Each worker runs up to ``max_seqs`` requests; the rest wait FIFO. A step takes
``base_s + per_seq_s * batch`` seconds; a request needs ``prompt * prefill_s``
seconds of prefill before its first token, then emits one token per
``step * factor[domain]`` seconds (``factor`` < 1 models speculation that pays
off on that domain). With ``chunk`` set, prefill shares the steps instead
(chunked prefill, as the engine does): each step carries up to ``chunk`` prompt
tokens, which add ``prefill_s`` each to that step's time, so a long prompt slows
every decode on its worker. With ``cache_tokens`` set the worker keeps a prefix
cache of that many tokens (LRU over the requests' prefix blocks, as the engine's
automatic prefix caching): a request admitted there prefills only the prompt past
its leading cached blocks and reports the rest as ``cached_tokens``. With ``context_s``
set, a step also takes that many seconds per prompt token of every request decoding in
it (attention over their contexts), so a long prompt decodes slower than a short one. Policies see
WorkerView snapshots and get RequestOutcomes, exactly as in the proxy; a policy with a
``depth_policy`` also gets each worker's decode steps every ``feed_s`` simulated seconds,
as the proxy's scrape hands it the engine's step sums (:mod:`specdec.step_feed`). With
``acceptance`` set (per domain), speculation follows the depth each request is sent at instead
of ``factor``: a request of acceptance a at depth k emits E(a, k) = (1 - a^(k+1)) / (1 - a)
tokens a step, each step costs ``verify_s`` more per draft token verified in it and
``spec_seq_s`` more per sequence speculating, and the outcome reports the draft and accepted
tokens as the engine does.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from polyinfer.config import CompiledConfig
from router.base import RequestOutcome, RequestShape, RoutingPolicy, WorkerView
from specdec.policy import DepthPolicy, expected_tokens_per_step
from specdec.step_model import NUM_FEATURES, step_features

FEED_S = 0.25  # simulated seconds between step feeds (the bench's metrics scrape interval)


@dataclass
class SimWorker:
    name: str
    config: CompiledConfig
    base_s: float
    per_seq_s: float
    prefill_s: float  # per prompt token
    factor: dict[str, float] = field(default_factory=dict)
    chunk: int | None = None  # prompt tokens per step (chunked prefill); None: prefill apart
    cache_tokens: int = 0  # prefix-cache capacity, tokens (0: no prefix cache)
    context_s: float = 0.0  # step seconds per prompt token of each decoding request
    prefix_factor: float | None = None  # step factor of shared-prefix requests (None: by domain)
    acceptance: dict[str, float] = field(default_factory=dict)  # per domain: depth-driven spec
    verify_s: float = 0.0  # step seconds per draft token verified (with ``acceptance``)
    spec_seq_s: float = 0.0  # step seconds per sequence speculating (with ``acceptance``)
    running: list[dict] = field(default_factory=list)
    waiting: list[dict] = field(default_factory=list)
    cache: OrderedDict[int, float] = field(default_factory=OrderedDict)  # block -> tokens
    num_prompt_tokens: int = 0
    num_cached_tokens: float = 0.0
    steps: StepSums = field(default_factory=lambda: StepSums())

    def admit(self, shape: RequestShape) -> float:
        """Prompt tokens found in the prefix cache; the request's blocks become cached."""
        if not self.cache_tokens:
            return 0.0
        cached = 0.0
        for h in shape.prefix_hashes:
            if h not in self.cache:
                break
            cached += shape.prefix_block_tokens
        for h in shape.prefix_hashes:
            self.cache.pop(h, None)
            self.cache[h] = shape.prefix_block_tokens
        while sum(self.cache.values()) > self.cache_tokens:
            self.cache.popitem(last=False)
        cached = min(cached, shape.prompt_tokens - 1.0)
        self.num_prompt_tokens += shape.prompt_tokens
        self.num_cached_tokens += cached
        return cached

    def view(self) -> WorkerView:
        return WorkerView(self.name, f"sim://{self.name}", "engine", self.config,
                          outstanding_requests=len(self.running) + len(self.waiting),
                          running=len(self.running), waiting=len(self.waiting))


@dataclass
class StepSums:
    """A worker's decode steps since the last feed, as the engine sums them: X^T W X, X^T W y
    with w = 1 / step^2 (each dt of simulated time is dt / step of a step)."""

    xtx: np.ndarray = field(default_factory=lambda: np.zeros((NUM_FEATURES, NUM_FEATURES)))
    xty: np.ndarray = field(default_factory=lambda: np.zeros(NUM_FEATURES))
    num_steps: float = 0.0
    prefill_tokens: float = 0.0

    def add(self, num_decoding: int, prefill_tokens: float, step: float, dt: float,
            depths: list[int] | None = None) -> None:
        if num_decoding <= 0:
            return
        ks = [k for k in depths or () if k > 0]
        x = np.array(step_features(num_decoding, sum(ks), max(ks, default=0), prefill_tokens,
                                   len(ks)))
        share = dt / step
        self.xtx += share / step**2 * np.outer(x, x)
        self.xty += share / step * x
        self.num_steps += share
        self.prefill_tokens += share * prefill_tokens

    def feed(self, name: str, depth_policy: DepthPolicy) -> None:
        """Hand the whole steps summed so far to ``depth_policy``, and start over."""
        if self.num_steps < 1.0:
            return
        depth_policy.observe_step_sums(name, self.xtx.tolist(), self.xty.tolist(),
                                       int(self.num_steps), self.prefill_tokens)
        self.xtx[:], self.xty[:], self.num_steps, self.prefill_tokens = 0.0, 0.0, 0.0, 0.0


class SimClock:
    """Simulated seconds, for a policy's ``clock`` argument."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class SimResult:
    """One finished request: where it ran, its latencies (seconds) and which SLO it met."""

    worker: str
    shape: RequestShape
    ttft_s: float
    tpot_s: float
    ttft_ok: bool
    tpot_ok: bool


def simulate(policy: RoutingPolicy, workers: list[SimWorker], arrivals: list[tuple[float, RequestShape]],
             slo_ttft_s: float, slo_tpot_s: float, dt: float = 0.005,
             clock: SimClock | None = None, results: list[SimResult] | None = None) -> float:
    """Fraction of requests meeting both SLOs (goodput per offered request); ``results``,
    if given, gets every finished request."""
    pending = sorted(arrivals, key=lambda a: a[0])
    now, i, num_good, num_done = 0.0, 0, 0, 0
    depth_policy = getattr(policy, "depth_policy", None)
    next_feed = FEED_S
    while num_done < len(arrivals):
        if clock is not None:
            clock.now = now
        if isinstance(depth_policy, DepthPolicy) and now >= next_feed:
            for w in workers:
                w.steps.feed(w.name, depth_policy)
            next_feed += FEED_S
        while i < len(pending) and pending[i][0] <= now:
            _route(policy, workers, pending[i][0], pending[i][1])
            i += 1
        for w in workers:
            for req in _advance(w, now, dt):
                num_done += 1
                res = _report(policy, w, req, slo_ttft_s, slo_tpot_s)
                num_good += res.ttft_ok and res.tpot_ok
                if results is not None:
                    results.append(res)
        now += dt
    return num_good / len(arrivals)


def _route(policy: RoutingPolicy, workers: list[SimWorker], t: float, shape: RequestShape) -> None:
    decision = policy.choose(shape, [w.view() for w in workers])
    w = next(w for w in workers if w.name == decision.worker)
    w.waiting.append({"shape": shape, "arrival": t, "batch": len(w.running), "left_prefill": None,
                      "tokens": 0.0, "first": None, "depth": decision.spec_depth})


def _advance(w: SimWorker, now: float, dt: float) -> list[dict]:
    while w.waiting and len(w.running) < w.config.engine.max_num_seqs:
        req = w.waiting.pop(0)
        req["cached"] = w.admit(req["shape"])
        req["left_prefill"] = (req["shape"].prompt_tokens - req["cached"]) * w.prefill_s
        w.running.append(req)
    if w.chunk is not None:
        return _advance_chunked(w, now, dt)
    decoding = [r for r in w.running if r["left_prefill"] <= 0]
    depths = [_depth(w, r) for r in decoding]
    step = w.base_s + w.per_seq_s * len(w.running) + _context_s(w, w.running) \
        + _spec_s(w, depths)
    w.steps.add(len(decoding), 0.0, step, dt, depths)
    done = []
    for req in w.running:
        if req["left_prefill"] > 0:
            req["left_prefill"] -= dt
            continue
        if _decode(w, req, now, dt, step):
            done.append(req)
    w.running = [r for r in w.running if r not in done]
    return done


def _context_s(w: SimWorker, decoding: list[dict]) -> float:
    """What the decoding requests' contexts add to a step, seconds (0 without context_s)."""
    if not w.context_s:
        return 0.0
    return w.context_s * sum(r["shape"].prompt_tokens for r in decoding
                             if r["left_prefill"] is not None and r["left_prefill"] <= 0)


def _depth(w: SimWorker, req: dict) -> int:
    """The depth a request speculates at on the worker (0 without ``acceptance``)."""
    if not w.acceptance or w.config.engine.spec_method == "none":
        return 0
    return min(req["depth"] or 0, w.config.engine.spec_max_depth)


def _tokens_per_step(w: SimWorker, req: dict) -> float:
    a = w.acceptance.get(req["shape"].domain, 0.0)
    return expected_tokens_per_step(a, _depth(w, req))


def _spec_s(w: SimWorker, depths: list[int]) -> float:
    """What the decoding requests' speculation (their ``depths``) adds to a step, seconds."""
    return w.verify_s * sum(depths) + w.spec_seq_s * sum(1 for k in depths if k > 0)


def _decode(w: SimWorker, req: dict, now: float, dt: float, step: float) -> bool:
    """One dt of decoding for a request past its prefill; True once it has all its tokens."""
    if req["first"] is None:
        req["first"] = now
    shape = req["shape"]
    factor = w.factor.get(shape.domain, 1.0)
    if shape.prefix_hashes and w.prefix_factor is not None:
        factor = w.prefix_factor
    if w.acceptance:
        factor = 1.0 / _tokens_per_step(w, req)
    req["tokens"] += dt / (step * factor)
    if req["tokens"] >= req["shape"].predicted_output_tokens:
        req["end"] = now
        return True
    return False


def _advance_chunked(w: SimWorker, now: float, dt: float) -> list[dict]:
    """One dt of a worker whose prefill runs inside the decode steps (``chunk`` per step)."""
    assert w.chunk is not None
    filling = [r for r in w.running if r["left_prefill"] > 0]
    # left_prefill counts seconds of prefill compute; in tokens it is left / prefill_s
    budget, take = float(w.chunk), {}
    for req in filling:  # the step's prompt tokens go to the oldest prefills first
        # NOTE: the share is fixed by the prompt's full length, so a prompt that fits in
        # one step's budget finishes in one step (no geometric tail as it shrinks)
        take[id(req)] = min(budget, float(req["shape"].prompt_tokens - req["cached"]))
        budget -= take[id(req)]
    decoding = [r for r in w.running if r["left_prefill"] <= 0]
    depths = [_depth(w, r) for r in decoding]
    step = (w.base_s + w.per_seq_s * len(w.running) + w.prefill_s * (w.chunk - budget)
            + _context_s(w, decoding) + _spec_s(w, depths))
    w.steps.add(len(decoding), w.chunk - budget, step, dt, depths)
    done = []
    for req in w.running:
        if req["left_prefill"] > 0:
            req["left_prefill"] -= take[id(req)] * w.prefill_s * dt / step
            if req["left_prefill"] <= 1e-9:
                req["left_prefill"] = 0.0
            continue
        if _decode(w, req, now, dt, step):
            done.append(req)
    w.running = [r for r in w.running if r not in done]
    return done


def latencies(req: dict) -> tuple[float, float]:
    """(TTFT, TPOT) of a finished request, seconds, as its outcome reports them."""
    n = req["shape"].predicted_output_tokens
    return req["first"] - req["arrival"], (req["end"] - req["first"]) / max(n - 1, 1)


def _report(policy: RoutingPolicy, w: SimWorker, req: dict, slo_ttft_s: float,
            slo_tpot_s: float) -> SimResult:
    shape: RequestShape = req["shape"]
    n = shape.predicted_output_tokens
    ttft, tpot = latencies(req)
    extra = {"cached_tokens": req["cached"]} if w.cache_tokens else {}
    k = _depth(w, req)
    steps = n / _tokens_per_step(w, req) if k else 0.0  # as the engine counts them
    policy.observe(RequestOutcome(w.name, shape, "ok", completion_tokens=n, ttft_s=ttft,
                                  tpot_s=tpot, e2e_s=req["end"] - req["arrival"],
                                  spec_depth=req["depth"], batch_size=req["batch"], extra=extra,
                                  spec_draft_tokens=round(k * steps),
                                  spec_accepted_tokens=round((n - steps) if k else 0)))
    return SimResult(w.name, shape, ttft, tpot, ttft <= (shape.slo_ttft_s or slo_ttft_s),
                     tpot <= (shape.slo_tpot_s or slo_tpot_s))


def poisson_mix(rate: float, num: int, mix: dict[str, float], prompt: int, output: int,
                seed: int = 0) -> list[tuple[float, RequestShape]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    domains, weights = zip(*mix.items(), strict=True)
    for _ in range(num):
        t += rng.expovariate(rate)
        domain = rng.choices(domains, weights)[0]
        out.append((t, RequestShape(domain, prompt, output, output)))
    return out
