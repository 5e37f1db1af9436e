"""What planning ahead with an exact model of the fleet, but no knowledge of the requests to
come, gets on the simulated prefix-mix fleet: a bound for routers that plan online.

placement_bound.py's hindsight search knows every future arrival and finds placements that
meet far more SLOs than the adaptive policy (1.42x least-outstanding against 1.20x at 80%
attainment, bench/RESULTS.md). Its moves are about timing, so the question is whether a router
that looks ahead could get there without knowing the future. :class:`LookaheadPlanner`
is the strongest such router the model allows: at each arrival it copies the true state of
every simulated worker (queues, batches, prefill left, prefix caches), places the request
on each worker in turn, runs the copy forward with no further arrivals until every request
in it has finished (or ``horizon_s``), and keeps the worker where the most of those
requests meet both SLOs (ties: the least summed lateness, as the hindsight search). It
knows each request's true output length and the engine's exact step times, which no real
router does. If it stays near the adaptive policy, what separates adaptive from the
hindsight placement is knowledge of future arrivals, not planning.

    python -m bench.sim.lookahead_bound --seeds 1-2 14   # 14 req/s, 30 s, scored from 10 s
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence

from bench.sim.fleet_sim import (
    SimClock,
    SimResult,
    SimWorker,
    StepSums,
    _advance,
    latencies,
    simulate,
)
from bench.sim.placement_bound import (
    LATE_CAP,
    SCORE_DT,
    SEARCH_DT,
    by_class,
    lateness,
    score,
    window_args,
    window_arrivals,
    window_parser,
)
from bench.sim.prefix_mix_sim import CONTEXT_S, POLICIES, bench_fleet
from router.base import RequestShape, RouteDecision, WorkerView

HORIZON_S = 3.0  # simulated seconds a look ahead runs at most


def copy_worker(w: SimWorker) -> SimWorker:
    """An independent copy of a simulated worker's state (its requests are copied; their
    shapes are immutable and shared)."""
    c = copy.copy(w)
    c.running = [dict(r) for r in w.running]
    c.waiting = [dict(r) for r in w.waiting]
    c.cache = OrderedDict(w.cache)
    c.steps = StepSums()
    return c


def request_value(req: dict, now: float) -> float:
    """1 for a request that met (or, unfinished at ``now``, is on course to meet) both SLOs;
    else minus its lateness / LATE_CAP^2, a tie-break worth less than one request met."""
    s: RequestShape = req["shape"]
    if req["first"] is None:
        late = lateness(s, now - req["arrival"], 0.0)
        return 0.0 if late <= 0 else -min(LATE_CAP, late) / LATE_CAP**2
    if "end" in req:
        ttft, tpot = latencies(req)
    else:
        ttft, tpot = req["first"] - req["arrival"], (now - req["first"]) / max(req["tokens"], 1.0)
    late = lateness(s, ttft, tpot)
    return 1.0 if late <= 0 else -min(LATE_CAP, late) / LATE_CAP**2

class LookaheadPlanner:
    """Routes each request by running an exact copy of ``fleet`` ahead (see the module)."""

    name = "lookahead"

    def __init__(self, fleet: list[SimWorker], clock: SimClock, horizon_s: float = HORIZON_S,
                 dt: float = SEARCH_DT) -> None:
        self.fleet, self.clock, self.horizon_s, self.dt = fleet, clock, horizon_s, dt

    def choose(self, shape: RequestShape, workers: Sequence[WorkerView]) -> RouteDecision:
        now = self.clock()
        best = max(workers, key=lambda v: self.value(shape, v.name, now))
        return RouteDecision(best.name, None, "lookahead")

    def observe(self, outcome: object) -> None:
        pass

    def value(self, shape: RequestShape, worker: str, now: float) -> float:
        """Summed :func:`request_value` of every request in the fleet, this one placed on
        ``worker``, once the copy has run ahead."""
        fleet = [copy_worker(w) for w in self.fleet]
        target = next(w for w in fleet if w.name == worker)
        target.waiting.append({"shape": shape, "arrival": now, "batch": len(target.running),
                               "left_prefill": None, "tokens": 0.0, "first": None,
                               "depth": None})  # as fleet_sim._route places it
        inside = [r for w in fleet for r in (*w.running, *w.waiting)]
        t = now
        while t < now + self.horizon_s and any(w.running or w.waiting for w in fleet):
            for w in fleet:
                _advance(w, t, self.dt)
            t += self.dt
        return sum(request_value(r, t) for r in inside)


def main(argv: list[str] | None = None) -> None:
    ap = window_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--horizon", type=float, default=HORIZON_S,
                    help="simulated seconds each look ahead runs at most")
    args, seeds = window_args(ap, argv)
    if args.horizon <= 0:
        ap.error("--horizon must be positive")
    for seed in seeds:
        arrivals, scored = window_arrivals(args, seed)
        tag = f"rate {args.rate:g} seed {seed}"
        met = {}
        for name in ("least_outstanding", "adaptive", "lookahead"):
            clock = SimClock()
            results: list[SimResult] = []
            fleet = bench_fleet(CONTEXT_S)
            policy = LookaheadPlanner(fleet, clock, args.horizon) if name == "lookahead" \
                else POLICIES[name](clock)
            simulate(policy, fleet, arrivals, 1.0, 1.0, dt=SCORE_DT, clock=clock,
                     results=results)
            met[name] = score(results, scored)[0]
            print(f"{tag} {name}: met {met[name]} of {len(scored)}  "
                  f"{by_class(results, scored)}", flush=True)
        lo_met = max(1, met["least_outstanding"])
        print(f"{tag} ratios to LO: adaptive {met['adaptive'] / lo_met:.2f}x, lookahead "
              f"{met['lookahead'] / lo_met:.2f}x", flush=True)


if __name__ == "__main__":
    main()
