"""Requests the adaptive policy has routed and not yet heard back about, per worker.

Each entry keeps what the decision predicted (TTFT, TPOT, the prompt's prefill
time on that worker) and when it was sent, so the policy can tell, at the next
decision, which of them are still prefilling and which are decoding. That is
what prefill/decode interference needs: on a continuous-batching worker a
prompt's prefill runs in the same steps as everyone else's decodes, so

- a request sent to a worker that is prefilling long prompts waits out their
  prefill in its own decode (:meth:`InFlight.prefill_ahead_s`), and
- a request with a long prompt delays every request decoding there by its
  prefill time (:meth:`InFlight.active`, priced by the policy);
- every request joining a batch slows the others' steps for as long as they
  overlap (crowding, priced by the policy from :meth:`Flight.remaining_s`), and
  a request arriving at a full batch waits for the running ones to finish
  (:meth:`InFlight.slot_wait_s`).

Bounded: entries are dropped in FIFO order past ``capacity`` (a lost outcome
must not grow it forever) and ignored once far past their predicted end.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

STALE_FACTOR = 4.0  # an entry counts until sent + STALE_FACTOR x its predicted e2e


@dataclass(slots=True)
class Flight:
    """One routed request, as predicted when it was sent (times: policy clock, seconds).
    Read-only by convention: not frozen, as :class:`router.adaptive.Candidate` (a frozen
    dataclass sets each field through ``object.__setattr__``, and a decision builds one)."""

    worker: str
    queue: int  # load the decision saw
    batch: int
    depth: int
    sent_s: float
    ttft_s: float  # predicted
    tpot_s: float  # predicted
    num_tokens: int  # predicted output tokens
    prefill_s: float  # predicted prefill compute on this worker: the stall it causes others
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    penalty: float = 1.0  # the policy's SLO cost multiplier for these predictions
    wait_s: float = 0.0  # predicted wait for a batch slot, included in ttft_s
    model_cached_tokens: float = 0.0  # prompt tokens the prefix-cache model said were cached
    # NOTE: derived once (__post_init__): the policy reads them for every flight on a
    # worker at every decision, which made them most of its cost at a few hundred in flight
    cost_s: float = field(init=False, repr=False, compare=False)  # predicted e2e, seconds
    active_until_s: float = field(init=False, repr=False, compare=False)  # see STALE_FACTOR
    num_gaps: int = field(init=False, repr=False, compare=False)  # TPOT's gaps, at least 1
    first_token_s: float = field(init=False, repr=False, compare=False)  # predicted, sent + TTFT
    # its predicted relative TTFT SLO miss, max(0, TTFT / SLO - 1); 0 without the SLO
    ttft_miss: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.cost_s = cost_s = self.ttft_s + max(self.num_tokens - 1, 0) * self.tpot_s
        self.active_until_s = self.sent_s + STALE_FACTOR * max(cost_s, 1e-3)
        self.num_gaps = max(self.num_tokens - 1, 1)
        self.first_token_s = self.sent_s + self.ttft_s
        self.ttft_miss = max(0.0, self.ttft_s / self.slo_ttft_s - 1.0) \
            if self.slo_ttft_s else 0.0

    def terms(self) -> tuple[float, ...]:
        """What :meth:`InFlight.load_terms` reads of the flight, in its loop's order: the
        derived fields and the products it would otherwise compute at every decision."""
        tpot_s = self.tpot_s
        return (self.active_until_s, self.sent_s + self.cost_s, 0.1 * self.cost_s,
                self.cost_s, self.first_token_s, self.prefill_s,
                1e-4 if 1e-4 > tpot_s else tpot_s, tpot_s, self.ttft_miss,
                self.slo_tpot_s or 0.0, self.num_gaps, self.cost_s * self.penalty)

    def remaining_s(self, now_s: float) -> float:
        """Predicted time left; a request running late counts a tenth of its cost."""
        return max(self.sent_s + self.cost_s - now_s, 0.1 * self.cost_s)

    def prefilling(self, now_s: float) -> bool:
        return now_s < self.first_token_s


class InFlight:
    """Flights by key (the proxy's RequestShape identity), indexed by worker."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._all: OrderedDict[int, Flight] = OrderedDict()
        self._by_worker: dict[str, dict[int, Flight]] = {}
        self._terms: dict[str, dict[int, tuple[float, ...]]] = {}  # Flight.terms, as _by_worker

    def __len__(self) -> int:
        return len(self._all)

    def add(self, key: int, flight: Flight) -> None:
        self.pop(key)
        self._all[key] = flight
        self._by_worker.setdefault(flight.worker, {})[key] = flight
        self._terms.setdefault(flight.worker, {})[key] = flight.terms()
        while len(self._all) > self.capacity:
            old_key, old = self._all.popitem(last=False)
            self._by_worker[old.worker].pop(old_key, None)
            self._terms[old.worker].pop(old_key, None)

    def pop(self, key: int) -> Flight | None:
        flight = self._all.pop(key, None)
        if flight is not None:
            self._by_worker[flight.worker].pop(key, None)
            self._terms[flight.worker].pop(key, None)
        return flight

    def active(self, worker: str, now_s: float) -> Iterator[Flight]:
        """Flights on ``worker`` that should still be running at ``now_s``."""
        for f in self._by_worker.get(worker, {}).values():
            if now_s < f.active_until_s:
                yield f

    def on_worker(self, worker: str) -> Iterable[Flight]:
        """Every flight on ``worker``, active or not (a loop that tests activity inline)."""
        return self._by_worker.get(worker, {}).values()

    def slot_wait_s(self, worker: str, now_s: float, num_ahead: int, capacity: int,
                    fallback_s: float) -> float:
        """Seconds until ``num_ahead`` of the requests on ``worker`` have finished, so a new
        one gets a slot in a batch of ``capacity``. The known ones' predicted remaining
        times, soonest first; past them (more ahead than this policy routed: another proxy,
        a scrape) each further request takes 1 / ``capacity`` of the mean known request's
        cost, or of ``fallback_s`` when none is known."""
        if num_ahead <= 0:
            return 0.0
        return self.load_terms(worker, now_s, num_ahead, capacity, fallback_s)[0]

    def prefill_ahead_s(self, worker: str, now_s: float) -> float:
        """Prefill time still to run on ``worker`` for requests sent before now."""
        return self.load_terms(worker, now_s)[1]

    def load_terms(self, worker: str, now_s: float, num_ahead: int = 0, capacity: int = 1,
                   fallback_s: float = 0.0, prefill_s: float = 0.0, crowd_s: float = 0.0,
                   cost_s: float = 0.0, slo_penalty: float = 0.0
                   ) -> tuple[float, float, float]:
        """(:meth:`slot_wait_s`, :meth:`prefill_ahead_s`, interference) on ``worker`` at
        ``now_s``, in one pass over its flights: what a router's candidate needs of them.

        Interference (with ``prefill_s`` or ``crowd_s`` > 0) is the penalised delay a new
        request costing ``cost_s`` adds to the active flights: each is stalled by its prefill
        ``prefill_s`` plus ``crowd_s`` per step they share while both run
        (``min(remaining, cost_s)`` of the flight's steps of ``max(TPOT, 0.1 ms)``), and
        priced as predicted when it was sent, with that delay spread over its TPOT gaps:
        ``(cost + delay) x (1 + slo_penalty x miss) - cost x penalty``
        (:class:`router.adaptive.AdaptivePolicy` explains why).

        NOTE: this loop runs over every flight on the worker for every candidate of every
        decision: one loop, the flight's constants precomputed (:meth:`Flight.terms`), min /
        max as comparisons that pick the same operand and the arithmetic in the plain
        formulas' order, so each sum is theirs bit for bit
        (tests/router/test_same_decisions.py)."""
        wait = ahead = harm = 0.0
        terms = self._terms.get(worker)
        if not terms:
            if num_ahead > 0:
                wait = num_ahead / capacity * fallback_s
            return wait, ahead, harm
        priced = prefill_s > 0 or crowd_s > 0
        if priced and num_ahead <= 0:
            # NOTE: a candidate below its capacity (most of them): the loop below without
            # the slot wait's list and the pricing's test, the same operations otherwise
            for (until, end, late, f_cost, first, f_prefill, tpot_div, tpot_s, ttft_miss,
                 slo_tpot, gaps, base) in terms.values():
                if not now_s < until:  # active
                    continue
                if now_s < first:
                    x = first - now_s
                    ahead += x if x < f_prefill else f_prefill
                left = end - now_s
                if late > left:
                    left = late
                delay = prefill_s + crowd_s * (cost_s if cost_s < left else left) / tpot_div
                if slo_tpot:
                    tpot_miss = (tpot_s + delay / gaps) / slo_tpot - 1.0
                    if tpot_miss > 0.0:
                        harm += (f_cost + delay) * (1.0 + slo_penalty * (ttft_miss + tpot_miss)) \
                            - base
                        continue
                harm += (f_cost + delay) * (1.0 + slo_penalty * ttft_miss) - base
            return wait, ahead, harm
        if priced:
            # NOTE: a candidate past its capacity: the same loop, keeping every active
            # flight's time left and cost for the slot wait
            lefts_: list[float] = []
            costs_: list[float] = []
            for (until, end, late, f_cost, first, f_prefill, tpot_div, tpot_s, ttft_miss,
                 slo_tpot, gaps, base) in terms.values():
                if not now_s < until:  # active
                    continue
                if now_s < first:
                    x = first - now_s
                    ahead += x if x < f_prefill else f_prefill
                left = end - now_s
                if late > left:
                    left = late
                lefts_.append(left)
                costs_.append(f_cost)
                delay = prefill_s + crowd_s * (cost_s if cost_s < left else left) / tpot_div
                if slo_tpot:
                    tpot_miss = (tpot_s + delay / gaps) / slo_tpot - 1.0
                    if tpot_miss > 0.0:
                        harm += (f_cost + delay) * (1.0 + slo_penalty * (ttft_miss + tpot_miss)) \
                            - base
                        continue
                harm += (f_cost + delay) * (1.0 + slo_penalty * ttft_miss) - base
            return self._slot_wait(lefts_, costs_, num_ahead, capacity, fallback_s), ahead, harm
        lefts: list[float] | None = [] if num_ahead > 0 else None
        costs: list[float] = []
        for (until, end, late, f_cost, first, f_prefill, tpot_div, tpot_s, ttft_miss,
             slo_tpot, gaps, base) in terms.values():
            if not now_s < until:  # active
                continue
            if now_s < first:  # prefilling: min(prefill, first - now) still to run
                x = first - now_s
                ahead += x if x < f_prefill else f_prefill
            left = end - now_s  # Flight.remaining_s: max(sent + cost - now, 0.1 x cost)
            if late > left:
                left = late
            if lefts is not None:
                lefts.append(left)
                costs.append(f_cost)
            if priced:
                shared = cost_s if cost_s < left else left  # while both run
                delay = prefill_s + crowd_s * shared / tpot_div
                miss = ttft_miss
                if slo_tpot:
                    tpot_miss = (tpot_s + delay / gaps) / slo_tpot - 1.0
                    if tpot_miss > 0.0:
                        miss += tpot_miss
                harm += (f_cost + delay) * (1.0 + slo_penalty * miss) - base
        if lefts is not None:
            wait = self._slot_wait(lefts, costs, num_ahead, capacity, fallback_s)
        return wait, ahead, harm

    @staticmethod
    def _slot_wait(lefts: list[float], costs: list[float], num_ahead: int, capacity: int,
                   fallback_s: float) -> float:
        """:meth:`slot_wait_s` from the active flights' times left and costs."""
        lefts.sort()
        if num_ahead <= len(lefts):
            return lefts[num_ahead - 1]
        mean_s = sum(costs) / len(costs) if costs else fallback_s
        return (lefts[-1] if lefts else 0.0) + (num_ahead - len(lefts)) / capacity * mean_s
