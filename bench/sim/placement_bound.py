"""How much goodput any placement could get on the simulated prefix-mix fleet: a hindsight
search over where each request goes, to tell a routing policy's shortfall from the fleet's.

The policies route online, knowing nothing of the requests to come. This search knows
the whole window in advance (every arrival, prompt and output length) and looks for the
placement -- one worker per request, as a router decides -- that meets the most SLOs on
the model of bench/routing.py's ``equal`` fleet (prefix_mix_sim.py, with the device's
context cost and the SLOs by the bench's rule). It is a local search, so what it finds is
a lower bound on the best placement: if even it stays under a target ratio to
least-outstanding, routing alone cannot reach that target on this fleet and load (in the
model); if it clears it, the gap is the policy's.

Search: start from the better of adaptive's and least-outstanding's placements; then, in
passes over the requests in a seeded random order, move one request to another worker
whenever that meets more SLOs (ties: less total lateness), until a pass changes nothing or
``max_passes`` is spent. Each try replays the whole window (the model is deterministic).

    python -m bench.sim.placement_bound --seeds 1-2 14   # 14 req/s, 30 s, scored from 10 s
"""

from __future__ import annotations

import argparse
import random
from collections import Counter
from collections.abc import Sequence

from bench.sim.fleet_sim import SimClock, SimResult
from bench.sim.prefix_mix_sim import (
    CONTEXT_S,
    POLICIES,
    class_of,
    prefix_mix,
    rule_slos,
    run_results,
)
from router.base import RequestShape, RouteDecision, RoutingPolicy, WorkerView

WORKERS = ("spec", "batch", "long")
# a try is judged at this step; the placement found is scored again at prefix_mix_sim's DT
SEARCH_DT = 0.004
SCORE_DT = 0.001
LATE_CAP = 10.0  # a missed request's lateness counts up to this many times its SLO


class FixedPlacement:
    """Routes the ``i``-th request it is asked about to ``placement[i]``; records nothing."""

    name = "fixed"

    def __init__(self, placement: Sequence[str]) -> None:
        self.placement = list(placement)
        self._next = 0

    def choose(self, shape: RequestShape, workers: Sequence[WorkerView]) -> RouteDecision:
        worker = self.placement[self._next]
        self._next += 1
        return RouteDecision(worker=worker, reason="fixed")

    def observe(self, outcome: object) -> None:
        return None


class Recorder:
    """Wraps a policy and records the worker it picks for each request, in arrival order."""

    name = "recorder"

    def __init__(self, policy: object) -> None:
        self.policy = policy
        self.placement: list[str] = []
        self.depth_policy = getattr(policy, "depth_policy", None)

    def choose(self, shape: RequestShape, workers: Sequence[WorkerView]) -> RouteDecision:
        decision = self.policy.choose(shape, workers)  # type: ignore[attr-defined]
        self.placement.append(decision.worker)
        return decision

    def observe(self, outcome: object) -> None:
        self.policy.observe(outcome)  # type: ignore[attr-defined]


def replay(policy: RoutingPolicy, arrivals: list[tuple[float, RequestShape]], dt: float
           ) -> list[SimResult]:
    """One run of the simulated fleet, with the device's context cost."""
    return run_results(lambda clock: policy, arrivals, CONTEXT_S, dt)


def score(results: list[SimResult], scored: set[int] | None = None) -> tuple[int, float]:
    """(requests meeting both SLOs, minus their summed lateness): more is better. ``scored``:
    the ids of the shapes that count (None: all)."""
    met, late = 0, 0.0
    for r in results:
        if scored is not None and id(r.shape) not in scored:
            continue
        if r.ttft_ok and r.tpot_ok:
            met += 1
            continue
        late += min(LATE_CAP, lateness(r.shape, r.ttft_s, r.tpot_s))
    return met, -late


def lateness(shape: RequestShape, ttft_s: float, tpot_s: float) -> float:
    """How far a request ran past the worse of its two SLOs, as a fraction of that SLO
    (<= 0: both met)."""
    return max(ttft_s / (shape.slo_ttft_s or 1.0), tpot_s / (shape.slo_tpot_s or 1.0)) - 1.0


def policy_placement(name: str, arrivals: list[tuple[float, RequestShape]], dt: float
                     ) -> tuple[list[str], list[SimResult]]:
    recorders: list[Recorder] = []

    def make(clock: SimClock) -> RoutingPolicy:
        recorders.append(Recorder(POLICIES[name](clock)))
        return recorders[-1]
    results = run_results(make, arrivals, CONTEXT_S, dt)
    return recorders[0].placement, results


def search(arrivals: list[tuple[float, RequestShape]], start: list[str], seed: int,
           max_passes: int, movable: Sequence[int], scored: set[int] | None = None,
           dt: float = SEARCH_DT, log: bool = True) -> list[str]:
    """The best placement found from ``start`` by moving the requests at the ``movable``
    indices one at a time (see the module), judged on the ``scored`` shapes."""
    best = list(start)
    best_score = score(replay(FixedPlacement(best), arrivals, dt), scored)
    rng = random.Random(seed)
    for p in range(max_passes):
        order = list(movable)
        rng.shuffle(order)
        moved = 0
        for i in order:
            for w in WORKERS:
                if w == best[i]:
                    continue
                trial = best[:i] + [w] + best[i + 1:]
                s = score(replay(FixedPlacement(trial), arrivals, dt), scored)
                if s > best_score:
                    best, best_score, moved = trial, s, moved + 1
        if log:
            print(f"  pass {p + 1}: {moved} moves, met {best_score[0]}", flush=True)
        if not moved:
            break
    return best


def by_class(results: list[SimResult], scored: set[int]) -> str:
    met: Counter[str] = Counter()
    sent: Counter[str] = Counter()
    for r in results:
        if id(r.shape) not in scored:
            continue
        key = f"{class_of(r.shape)}@{r.worker}"
        sent[key] += 1
        met[key] += r.ttft_ok and r.tpot_ok
    return " ".join(f"{k} {met[k]}/{sent[k]}" for k in sorted(sent))


def window_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every simulated-window tool here takes: rate, seeds, window, scoring."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("rate", type=float, help="req/s")
    ap.add_argument("--seeds", default="1-1", help="A-B: the arrival seeds")
    ap.add_argument("--window", type=float, default=30.0, help="seconds of arrivals")
    ap.add_argument("--score-after", type=float, default=10.0,
                    help="seconds: only requests arriving from then on are scored (the "
                         "fleet's caches and the policies' profiles start cold)")
    return ap


def window_args(ap: argparse.ArgumentParser, argv: list[str] | None
                ) -> tuple[argparse.Namespace, range]:
    """Parsed arguments of :func:`window_parser` (checked; errors name the flag) and the seeds."""
    args = ap.parse_args(argv)
    if args.rate <= 0 or args.window <= 0:
        ap.error("rate and --window must be positive")
    if not 0 <= args.score_after < args.window:
        ap.error("need 0 <= --score-after < --window")
    try:
        lo, hi = (int(x) for x in args.seeds.split("-"))
    except ValueError:
        ap.error(f"--seeds must be A-B, got {args.seeds!r}")
    if lo > hi:
        ap.error(f"--seeds: {lo} is after {hi}")
    return args, range(lo, hi + 1)


def window_arrivals(args: argparse.Namespace, seed: int
                    ) -> tuple[list[tuple[float, RequestShape]], set[int]]:
    """One seed's window of :func:`window_parser` arguments: the arrivals (SLOs by the bench's
    rule) and the ids of the shapes that are scored."""
    arrivals = prefix_mix(args.rate, max(1, round(args.rate * args.window)), seed, tight=True,
                          slos=rule_slos(CONTEXT_S))
    return arrivals, {id(s) for t, s in arrivals if t >= args.score_after}


def main(argv: list[str] | None = None) -> None:
    ap = window_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--move-after", type=float, default=5.0,
                    help="seconds: only requests arriving from then on are moved")
    ap.add_argument("--max-passes", type=int, default=3)
    args, seeds = window_args(ap, argv)
    if args.max_passes < 0:
        ap.error("--max-passes must be at least 0")
    if not 0 <= args.move_after <= args.score_after:
        ap.error("need 0 <= --move-after <= --score-after")
    for seed in seeds:
        arrivals, scored = window_arrivals(args, seed)
        movable = [i for i, (t, _) in enumerate(arrivals) if t >= args.move_after]
        tag = f"rate {args.rate:g} seed {seed}"
        met, placements = {}, {}
        for name in POLICIES:
            placements[name], results = policy_placement(name, arrivals, SCORE_DT)
            met[name] = score(results, scored)[0]
            print(f"{tag} {name}: met {met[name]} of {len(scored)}  "
                  f"{by_class(results, scored)}", flush=True)
        start_name = max(("adaptive", "least_outstanding"), key=lambda n: score(
            replay(FixedPlacement(placements[n]), arrivals, SEARCH_DT), scored))
        found = search(arrivals, placements[start_name], seed, args.max_passes, movable, scored)
        # NOTE: the search judges at a coarser step; at the scoring step its placement could
        # come out below the one it started from, which is a placement too
        results = max((replay(FixedPlacement(p), arrivals, SCORE_DT)
                       for p in (found, placements[start_name])),
                      key=lambda res: score(res, scored))
        bound = score(results, scored)[0]
        print(f"{tag} hindsight (from {start_name}): met {bound} of {len(scored)}  "
              f"{by_class(results, scored)}", flush=True)
        lo_met, rr_met = max(1, met["least_outstanding"]), max(1, met["round_robin"])
        print(f"{tag} ratios: adaptive/LO {met['adaptive'] / lo_met:.2f}x, hindsight/LO "
              f"{bound / lo_met:.2f}x; adaptive/RR {met['adaptive'] / rr_met:.2f}x, "
              f"hindsight/RR {bound / rr_met:.2f}x", flush=True)


if __name__ == "__main__":
    main()
