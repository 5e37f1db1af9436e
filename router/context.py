"""Context load: what a long prompt's decode does to every request sharing its worker's steps.

A decode step attends over the context of every sequence in the batch, so one sequence
with a long prompt makes *every* step on its worker slower, not only its own tokens. On
the device (session 8 round 7, probe) the spec worker decoded the 800-2,000-token shared-
prefix prompts at 6.1 ms a token unloaded against 1.6-2.0 ms for the short prompts: while
one of them decodes there, a short request shares 4-4.5 ms more per step, enough to push
the tight classes (3.9 / 4.9-ms TPOT SLOs) past their SLO. The batch-size slope (crowding,
:mod:`router.adaptive`) prices an added sequence alike whatever its context, and in round 7
adaptive sent spec 75 long-prompt requests that met their SLO as well elsewhere; the tight
classes on spec decoded at 4.7-5.4 ms (p50) and met theirs in 26 of 80.

A request's *extra* on a worker is its predicted TPOT at batch 1 less a short prompt's of
the same domain there (the profile's prompt-band fits, :meth:`WorkerProfile.context_extra_s`:
0 for a short prompt, or before both bands have samples). The policy prices it three ways:

- **prediction**: a request's TPOT on a worker carries the extra of the requests predicted to
  decode there during its own decode (:meth:`ContextLoad.mean_s`, time-averaged over its
  window); the profiles learn TPOT with that taken out, as they do the prefill stalls;
- **in flight**: each request running there is slowed by the extra per step it shares with
  this one, added to crowding's per-step slope (the policy's interference term);
- **future arrivals**: the requests that will arrive there while this one is in service are
  slowed alike. They are taken to be like the recent arrivals there (the last ``recent``
  routed, as predicted when sent) at the worker's decaying arrival rate:
  ``rate x service x mean over recent g of harm(g, extra x shared_g / tpot_g)``, with
  ``shared_g = min(service / 2, cost_g)`` (an arrival at a uniform time in the service shares
  on average half of it, at most its own cost), each harm at most what ``g`` would have lost
  on its best other worker when it was sent (an arrival with a good alternative takes it:
  the reserve's exclusivity (:mod:`router.reserve`), made soft). This is what keeps a
  slack-rich long prompt off a scarce fast worker whose traffic is tight but not running at
  the moment.

Example: spec's recent arrivals are short requests of 55 tokens predicted at 2.5 ms a token
(cost 0.14 s) against a 3.9-ms SLO, arriving at 2 / s. A prefix request with an extra of
4.5 ms and 0.9 s in service there meets 1.8 of them, each slowed by 4.5 ms x 0.14 / 0.0025 =
0.25 s (7 ms a token, a miss), and is charged that penalised harm; on a worker where its
extra is 0.5 ms the same arrivals lose 0.03 s each and meet their SLO.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from router.inflight import Flight
from router.reserve import decayed
from router.stalls import Prefill


@dataclass(frozen=True)
class ContextConfig:
    window_s: float = 10.0  # time constant of each worker's arrival rate, seconds
    recent: int = 32  # recent arrivals per worker: the sample future arrivals are drawn from
    max_events: int = 512  # decode windows remembered per worker (for mean_s)
    # a prompt band's extra is priced once it and the short band each rest on this many
    # samples on the worker (fewer: the two fits' difference is their start's, not evidence)
    min_samples: int = 8
    future: bool = True  # also price the arrivals to come while the request is in service

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s: expected > 0, got {self.window_s}")
        if self.recent <= 0 or self.max_events <= 0 or self.min_samples < 1:
            raise ValueError("recent and max_events must be > 0, min_samples >= 1")


@dataclass
class _Arrivals:
    """One worker's routed arrivals: a decaying count and the most recent ones."""

    recent: deque[Flight]
    count: float = 0.0  # decayed arrivals as of last_s
    last_s: float = 0.0


class ContextLoad:
    """Per worker: the decode windows routed there with their extra TPOT, and the recent
    arrivals; see the module docstring."""

    def __init__(self, config: ContextConfig | None = None) -> None:
        self.config = config or ContextConfig()
        self._windows: dict[str, OrderedDict[int, Prefill]] = {}
        self._arrivals: dict[str, _Arrivals] = {}

    def record(self, worker: str, key: int, start_s: float, end_s: float, extra_s: float
               ) -> None:
        """A request (``key``) routed to ``worker`` is predicted to decode over
        [start_s, end_s] and to add ``extra_s`` to the TPOT of every request decoding there
        meanwhile."""
        if not (extra_s > 0 and end_s > start_s and math.isfinite(extra_s + start_s + end_s)):
            return
        windows = self._windows.setdefault(worker, OrderedDict())
        windows.pop(key, None)
        windows[key] = Prefill(start_s, end_s, extra_s * (end_s - start_s))
        while len(windows) > self.config.max_events:
            windows.popitem(last=False)

    def finish(self, worker: str, key: int, start_s: float, end_s: float) -> float:
        """The request ``key`` decoded on ``worker`` over [start_s, end_s] (as measured): its
        window becomes that, at the same extra per token, which is returned (0 if none)."""
        windows = self._windows.get(worker)
        w = None if windows is None else windows.get(key)
        if windows is None or w is None:
            return 0.0
        span = w.end_s - w.start_s
        extra = w.seconds / span if span > 0 else 0.0
        if end_s > start_s and math.isfinite(start_s + end_s):
            windows[key] = Prefill(start_s, end_s, extra * (end_s - start_s))
        else:
            del windows[key]
        return extra

    def mean_s(self, worker: str, start_s: float, end_s: float) -> float:
        """The extra TPOT a request decoding on ``worker`` over [start_s, end_s] meets, time-
        averaged over that window, from every recorded window (its own included, if any)."""
        if not end_s > start_s:
            return 0.0
        total = sum(w.within_s(start_s, end_s) for w in self._windows.get(worker, {}).values())
        return total / (end_s - start_s)

    def arrive(self, worker: str, now_s: float, flight: Flight) -> None:
        """A request was routed to ``worker`` at ``now_s``, predicted as ``flight``."""
        a = self._arrivals.get(worker)
        if a is None:
            a = self._arrivals[worker] = _Arrivals(deque(maxlen=self.config.recent))
        a.count = decayed(a.count, now_s - a.last_s, self.config.window_s) + 1.0
        a.last_s = now_s
        a.recent.append(flight)

    def rate(self, worker: str, now_s: float) -> float:
        """Arrivals routed to ``worker`` per second, as of ``now_s``."""
        a = self._arrivals.get(worker)
        if a is None:
            return 0.0
        return decayed(a.count, now_s - a.last_s, self.config.window_s) / self.config.window_s

    def future_harm(self, worker: str, now_s: float, extra_s: float, service_s: float,
                    harm: Callable[[Flight, float], float]) -> float:
        """What a request adding ``extra_s`` per token for ``service_s`` seconds on ``worker``
        costs the arrivals to come: ``harm(g, delay)`` is the policy's penalised cost of
        ``delay`` more seconds in the decode of a request predicted as ``g``, at most what
        ``g`` would have lost on its best other worker (``g.loss_s``: an arrival that meets
        its SLO as well elsewhere is not harmed, it goes there)."""
        a = self._arrivals.get(worker)
        if (not self.config.future or a is None or not a.recent or not extra_s > 0
                or not 0 < service_s < math.inf):
            return 0.0
        total = 0.0
        for g in a.recent:
            delay_s = extra_s * min(0.5 * service_s, g.cost_s) / max(g.tpot_s, 1e-4)
            total += min(harm(g, delay_s), g.loss_s)
        mean = total / len(a.recent)
        return self.rate(worker, now_s) * service_s * mean

    def forget_worker(self, worker: str) -> None:
        self._windows.pop(worker, None)
        self._arrivals.pop(worker, None)

    def snapshot(self, now_s: float) -> dict[str, dict[str, float]]:
        """worker -> arrival rate (1 / s) and the extra TPOT now (s)."""
        names = sorted(set(self._windows) | set(self._arrivals))
        return {w: {"rate": round(self.rate(w, now_s), 4),
                    "extra_now_s": round(self.mean_s(w, now_s, now_s + 1e-3), 6)}
                for w in names}
