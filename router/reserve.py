"""Slot reserves: keeping a worker's slots for the requests that can meet their SLO only there.

The adaptive policy (:mod:`router.adaptive`) prices each request by its own predicted
latency. A request with slack takes a scarce fast worker's slot as readily as one that
needs it, so when the fleet has one fast worker (say 4 slots) that alone meets a tight
class's SLO, a slack-rich class fills it and the tight class misses (on the device,
Mooncake prompts took 115 of the fast worker's slots in one routing run).

A request is *exclusive* to a worker when the policy predicts it meets its SLO there
given a free slot and no prefill queued ahead, and on no other worker (the policy's
own predictions at decision time: nothing per domain). For each worker this module
keeps, from its exclusive requests,

- their arrival rate, an exponentially decaying count (time constant ``window_s``):
  rate = sum over arrivals of exp(-(now - t_i) / window_s) / window_s;
- their mean predicted time in service there, TTFT slack there (SLO less the predicted
  TTFT with a free slot), and loss: what each would cost more on its best other worker
  (the policy's penalised cost, seconds) -- EWMAs.

By Little's law their mean number in service is rate x service (``m``). The number in
service at a random moment is Poisson(m) (M/G/infinity), so the slots they need are its
``quantile`` (:func:`poisson_quantile`). While at least one slot is reserved, any other
request placed there is charged what it would cost the exclusive traffic
(:func:`hold_s`): the exclusive arrivals during the time it keeps the reserve not ready
(rate x hold) times their loss. It holds the reserve for its time in service when it
takes a reserved slot, and for the part of its prefill beyond their TTFT slack (an
exclusive request arriving then would wait it out and miss). The policy adds the charge
to its cost there and counts the decisions it changes as ``reserve``.

Example: exclusive arrivals at 0.8 / s, 0.3 s in service each: m = 0.24;
P(0) = e^-0.24 = 0.787 < 0.9 <= P(<= 1) = 0.976, so 1 slot is reserved. On a 4-slot
worker with 3 requests ahead, a request with 0.5 s in service holds the reserve 0.5 s:
charged 0.8 x 0.5 = 0.4 exclusive requests' loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReserveConfig:
    window_s: float = 10.0  # time constant of the exclusive arrival rate, seconds
    service_alpha: float = 0.1  # EWMA weight of each exclusive request's service time
    quantile: float = 0.9  # reserved slots: this quantile of Poisson(rate x service)
    # "charge": a request that would hold the reserve pays rate x hold x loss on that
    # worker; "refuse": it goes to the cheapest other worker that meets its SLO and holds
    # no reserve, when there is one
    mode: str = "charge"

    def __post_init__(self) -> None:
        if self.mode not in ("charge", "refuse"):
            raise ValueError(f"mode: expected 'charge' or 'refuse', got {self.mode!r}")
        if not self.window_s > 0:
            raise ValueError(f"window_s: expected > 0, got {self.window_s}")
        if not 0.0 < self.service_alpha <= 1.0:
            raise ValueError(f"service_alpha: expected (0, 1], got {self.service_alpha}")
        if not 0.0 < self.quantile < 1.0:
            raise ValueError(f"quantile: expected (0, 1), got {self.quantile}")


def poisson_quantile(mean: float, q: float, limit: int) -> int:
    """The smallest k with P(N <= k) >= q for N ~ Poisson(``mean``), at most ``limit``."""
    if mean <= 0 or limit <= 0:
        return 0
    term = cdf = math.exp(-mean)
    k = 0
    while cdf < q and k < limit:
        k += 1
        term *= mean / k
        cdf += term
    return k


def hold_s(free_after: int, reserved: int, service_s: float, prefill_s: float,
           slack_s: float) -> float:
    """Seconds a request keeps a worker's reserve of ``reserved`` slots not ready: its
    time in service if it leaves ``free_after`` < ``reserved`` slots free, else 0, or the
    part of its prefill beyond the exclusive requests' TTFT slack, whichever is longer."""
    if reserved <= 0:
        return 0.0
    slot = service_s if free_after < reserved else 0.0
    return max(slot, prefill_s - slack_s, 0.0)


def decayed(count: float, since_s: float, window_s: float) -> float:
    """An exponentially decaying count ``since_s`` seconds after it was ``count``."""
    return count * math.exp(-max(since_s, 0.0) / window_s)


@dataclass
class _Demand:
    """One worker's exclusive traffic: a decaying arrival count and the mean service."""

    count: float = 0.0  # decayed arrivals as of last_s
    last_s: float = 0.0
    service_s: float = 0.0  # EWMA of predicted time in service, seconds
    slack_s: float = math.inf  # EWMA of TTFT slack (SLO - predicted, free slot), seconds
    loss_s: float = 0.0  # EWMA of the extra penalised cost on the best other worker, s

    def add(self, now_s: float, service_s: float, slack_s: float, loss_s: float,
            config: ReserveConfig) -> None:
        first = self.count == 0.0
        self.count = decayed(self.count, now_s - self.last_s, config.window_s) + 1.0
        self.last_s = now_s
        a = 1.0 if first else config.service_alpha
        self.service_s += a * (service_s - self.service_s)
        self.loss_s += a * (loss_s - self.loss_s)
        if math.isinf(self.slack_s):
            self.slack_s = slack_s
        elif not math.isinf(slack_s):  # a request without a TTFT SLO tells nothing of it
            self.slack_s += a * (slack_s - self.slack_s)

    def rate(self, now_s: float, config: ReserveConfig) -> float:
        """Exclusive arrivals per second, as of ``now_s``."""
        return decayed(self.count, now_s - self.last_s, config.window_s) / config.window_s


class SlotReserve:
    """Per-worker reserves from the exclusive traffic seen; see the module docstring."""

    def __init__(self, config: ReserveConfig | None = None) -> None:
        self.config = config or ReserveConfig()
        self._demand: dict[str, _Demand] = {}

    def observe(self, worker: str, now_s: float, service_s: float, loss_s: float,
                slack_s: float = math.inf) -> None:
        """A request exclusive to ``worker`` arrived; it would be in service there for
        ``service_s`` seconds, cost ``loss_s`` more on its best other worker, and meet its
        TTFT SLO with ``slack_s`` to spare given a free slot (predicted; inf: no TTFT SLO).
        A sample with a non-finite service or loss is ignored (it would poison the EWMAs)."""
        if not (math.isfinite(service_s) and math.isfinite(loss_s)) or math.isnan(slack_s):
            return
        self._demand.setdefault(worker, _Demand()).add(
            now_s, max(service_s, 0.0), max(slack_s, 0.0), max(loss_s, 0.0), self.config)

    def mean_in_service(self, worker: str, now_s: float) -> float:
        """Little's law: exclusive requests in service on ``worker`` on average."""
        d = self._demand.get(worker)
        return 0.0 if d is None else d.rate(now_s, self.config) * d.service_s

    def slots(self, worker: str, now_s: float, capacity: int) -> int:
        """Slots of ``worker`` (out of ``capacity``) its exclusive traffic needs."""
        return poisson_quantile(self.mean_in_service(worker, now_s), self.config.quantile,
                                capacity)

    def hold_s(self, worker: str, now_s: float, queue: int, capacity: int,
               service_s: float, prefill_s: float) -> float:
        """Seconds a request that is not exclusive to ``worker`` would keep its reserve
        not ready there (:func:`hold_s`). ``queue``: requests ahead of it there;
        ``service_s``, ``prefill_s``: its own, predicted."""
        d = self._demand.get(worker)
        if d is None:
            return 0.0
        reserved = self.slots(worker, now_s, capacity)
        return hold_s(capacity - queue - 1, reserved, service_s, prefill_s, d.slack_s)

    def charge_s(self, worker: str, now_s: float, hold_s: float) -> float:
        """What holding ``worker``'s reserve ``hold_s`` seconds costs its exclusive traffic,
        seconds of the policy's cost: their arrivals meanwhile x their mean loss."""
        d = self._demand.get(worker)
        return 0.0 if d is None else d.rate(now_s, self.config) * hold_s * d.loss_s

    def forget_worker(self, worker: str) -> None:
        self._demand.pop(worker, None)

    def snapshot(self, now_s: float) -> dict[str, Any]:
        """worker -> exclusive rate (1 / s), mean service (s) and mean in service."""
        return {w: {"rate": round(d.rate(now_s, self.config), 4),
                    "service_s": round(d.service_s, 4),
                    "ttft_slack_s": None if math.isinf(d.slack_s) else round(d.slack_s, 4),
                    "loss_s": round(d.loss_s, 4),
                    "in_service": round(self.mean_in_service(w, now_s), 4)}
                for w, d in self._demand.items()}
