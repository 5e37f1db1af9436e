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


@dataclass(frozen=True)
class Flight:
    """One routed request, as predicted when it was sent (times: policy clock, seconds)."""

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
        cost_s = self.ttft_s + max(self.num_tokens - 1, 0) * self.tpot_s
        object.__setattr__(self, "cost_s", cost_s)
        object.__setattr__(self, "active_until_s",
                           self.sent_s + STALE_FACTOR * max(cost_s, 1e-3))
        object.__setattr__(self, "num_gaps", max(self.num_tokens - 1, 1))
        object.__setattr__(self, "first_token_s", self.sent_s + self.ttft_s)
        object.__setattr__(self, "ttft_miss", max(0.0, self.ttft_s / self.slo_ttft_s - 1.0)
                           if self.slo_ttft_s else 0.0)

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

    def __len__(self) -> int:
        return len(self._all)

    def add(self, key: int, flight: Flight) -> None:
        self.pop(key)
        self._all[key] = flight
        self._by_worker.setdefault(flight.worker, {})[key] = flight
        while len(self._all) > self.capacity:
            old_key, old = self._all.popitem(last=False)
            self._by_worker[old.worker].pop(old_key, None)

    def pop(self, key: int) -> Flight | None:
        flight = self._all.pop(key, None)
        if flight is not None:
            self._by_worker[flight.worker].pop(key, None)
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
        flights = [f for f in self.on_worker(worker) if now_s < f.active_until_s]
        # NOTE: Flight.remaining_s written out (this runs for every candidate at capacity)
        left = sorted([max(f.sent_s + f.cost_s - now_s, 0.1 * f.cost_s) for f in flights])
        if num_ahead <= len(left):
            return left[num_ahead - 1]
        mean_s = sum(f.cost_s for f in flights) / len(flights) if flights else fallback_s
        return (left[-1] if left else 0.0) + (num_ahead - len(left)) / capacity * mean_s

    def prefill_ahead_s(self, worker: str, now_s: float) -> float:
        """Prefill time still to run on ``worker`` for requests sent before now."""
        total = 0.0
        for f in self._by_worker.get(worker, {}).values():
            # NOTE: active and prefilling (the first token not yet due), tested inline: this
            # runs over every flight on the worker for every candidate
            if now_s < f.first_token_s and now_s < f.active_until_s:
                total += min(f.prefill_s, f.first_token_s - now_s)
        return total
