"""Admission: how many requests the proxy takes on, and which waits go first.

:class:`InFlightLimit` bounds the requests in flight to what the proxy's own event loop
serves within its lag target (past it, new requests are refused at the door).

:class:`AdmissionQueue` holds requests waiting for room under the workers' concurrency caps.

A worker's ``max_outstanding`` (config) caps the requests this proxy has sent it and not
yet seen finish. While every routable worker of a request's model is at its cap, the
request waits here rather than in some worker's own queue:

- it is bound to a worker only when one has room (late binding), so it goes to whichever
  frees first, and the routing policy chooses among the workers with room at that moment;
- the next to go is the waiter whose TTFT deadline (arrival + its TTFT SLO) comes first,
  among those still before it (earliest deadline first);
- a waiter already past its deadline goes after every one that is not, in arrival order:
  it has missed its SLO, and sent ahead of the others it would only make them miss too.
  It is still served (nothing is dropped), when the others have gone or at
  ``limits.max_queue_s`` after arrival, when it goes whatever the caps say.

Every slot that frees wakes every waiter in that order; each looks again, and the first
that finds room takes it before the next resumes (one event loop, and taking a slot does
not wait), so the order holds. A waiter also looks again every ``RECHECK_S`` on its own,
for what frees room without a request finishing (a worker recovering, a cap changed).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

RECHECK_S = 0.5


@dataclass(slots=True)
class _Waiter:
    deadline: float  # perf_counter seconds: arrival + the request's TTFT SLO
    arrival: float  # perf_counter seconds
    future: asyncio.Future[None]


class AdmissionQueue:
    """The waiters, in no order; :meth:`release` wakes them in priority order."""

    def __init__(self) -> None:
        self._waiters: list[_Waiter] = []

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, deadline: float, arrival: float, timeout_s: float) -> None:
        """Until a slot frees somewhere (:meth:`release`) or ``timeout_s`` passes."""
        waiter = _Waiter(deadline, arrival, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                await waiter.future
        except TimeoutError:
            pass
        finally:
            self._waiters.remove(waiter)

    def release(self) -> None:
        """A slot freed: wake every waiter, the most urgent first."""
        if not self._waiters:
            return
        now = time.perf_counter()
        for w in sorted(self._waiters, key=lambda w: priority(w.deadline, w.arrival, now)):
            if not w.future.done():
                w.future.set_result(None)


def priority(deadline: float, arrival: float, now: float) -> tuple[bool, float]:
    """Sort key of a waiter: before its deadline, by deadline; past it, after all of those,
    by arrival."""
    late = now > deadline
    return late, arrival if late else deadline


class InFlightLimit:
    """How many requests the proxy takes on at once: at most ``limits.max_in_flight``, above
    a burst floor only as far as what is in flight has used, and lowered while the proxy's
    own event loop is saturated (AIMD, as TCP's window).

    One rule per loop sample (every 50 ms, ``Relay.measure_loop_lag``)::

        saturated (loop busy and late)  -> cut to in_flight x target/lag  (x0.9 .. x0.5)
        calm, under the floor            -> +5% (at least one), up to the floor
        calm, in use (in_flight >= 1/2)  -> +5%, up to limits.max_in_flight
        calm, unused (in_flight < 1/2)   -> -1%, down to max(floor, 2 x in_flight)

    NOTE: past capacity the loop still runs every ready callback each iteration, so the
    excess does not pile up where a queue could be watched: every admitted request is one
    more sharing the loop, each of its steps waits longer (the loop's lag is that wait),
    and the connections behind them wait in the kernel. Door shedding on a lag threshold
    alone switched on and off: off, it let in everything that had queued meanwhile (p50
    0.8 s, p99 20 s at 3x capacity, bench/overload.py). Holding the number in flight to
    what the loop serves within its lag target bounds both: the rest is refused at once
    with a 429 that costs a small fraction of a request (proxy.fastpath).

    NOTE: why the floor, and growth only while in use: the number in flight is the
    queueing delay a new request would see, counted at the door per request (each admitted
    request is ~0.2-0.3 ms of the loop's CPU, bench/overload.py --door-cost), and the cut
    needs a sample or two (~0.1 s) to see a saturated loop. A limit that had climbed back
    to limits.max_in_flight while the proxy was idle or lightly loaded let in ~1,500
    requests at the onset of 3x load (H200 host): answers slowed to seconds, the clients
    opened a connection per request, each costing the loop ~5x a 429 on an open one, and
    the proxy never recovered (goodput 0.45x of capacity, accepted p99 17 s). Held to a
    floor of BURST (~70 ms of loop work) plus twice what has lately been in use, a step
    of any size is refused at the door from the request that fills it, within the loop
    iteration it arrives in; a real rise in concurrency (a slower worker, longer streams)
    raises the limit 5% a calm sample (256 -> 4096 in ~3 s), and a burst from idle past
    BURST gets 429s with Retry-After meanwhile (adaptive concurrency limiters' trade)."""

    # per saturated sample: of the number in flight (or the limit, if lower), by how far the
    # lag is over its target (target / lag), within these bounds
    DECREASE = 0.9
    MAX_DECREASE = 0.5
    INCREASE = 0.05  # per calm sample in use (or under the floor), at least one request more
    DECAY = 0.01  # per calm sample unused: ~3.5 s to halve
    BURST = 256  # the floor: admitted at once from idle (see the class NOTE)
    MINIMUM = 16  # never fewer: an idle worker round trip must not starve the proxy

    def __init__(self, maximum: int) -> None:
        self.maximum = maximum
        self.minimum = min(self.MINIMUM, maximum)
        self.floor = min(self.BURST, maximum)
        self.value = self.floor  # requests in flight admitted at most

    def update(self, saturated: bool, num_in_flight: int, overshoot: float = 1.0) -> None:
        """One loop-lag sample: ``saturated`` = its thread busy and late past its target;
        ``overshoot`` = its lag / the target.

        NOTE: a cut by how far the lag overshoots: at 3x capacity the number in flight
        climbs by thousands a second from the first sample, and cuts of 10% a sample
        took a second or more to bring it back, the requests admitted meanwhile waiting
        that long; no deeper than a half a sample (TCP's), the sample being late itself."""
        value = self.value
        if saturated:
            factor = max(self.MAX_DECREASE, min(self.DECREASE, 1.0 / max(overshoot, 1e-9)))
            self.value = max(self.minimum, int(min(value, num_in_flight) * factor))
        elif value < self.floor or (2 * num_in_flight >= value and value < self.maximum):
            cap = self.maximum if 2 * num_in_flight >= value else self.floor
            self.value = min(cap, value + max(1, int(value * self.INCREASE)))
        elif 2 * num_in_flight < value and value > self.floor:  # unused
            self.value = max(self.floor, 2 * num_in_flight, int(value * (1.0 - self.DECAY)))


def cpu_share(proc_cgroup: str | None = None, root: Path = Path("/sys/fs/cgroup")) -> float:
    """The share of one core this process's cgroup CPU quota lets one thread use: quota /
    period, the tightest along the cgroup's path (cgroup v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us``), at most 1; 1 with no quota (or none readable).

    NOTE: the loop's busy share is its thread's CPU time over the wall time; under a quota
    of 0.5 CPU a loop saturated by its own work is on the CPU half the time, which reads as
    a noisy neighbour (lag, not busy) unless its busy share is taken over this."""
    return cpu_quota(proc_cgroup, root)[0]


def quota_lag_s(share: float, period_s: float) -> float:
    """How late a quota alone can wake a thread that has used it up: the rest of the period
    (the scheduler holds the cgroup until the next one); 0 without a quota.

    NOTE: under 0.25 of a core (100 ms periods) a loop near its capacity runs 25 ms and
    waits 75: a lag that is the quota's, not a queue's. Cut by it, the in-flight limit fell
    to half at every period and idled the loop 13% of the time at 3x load
    (bench/overload.py --cpu-quota 0.25 with 128-chunk streams: goodput 0.84x)."""
    return period_s * (1.0 - share) if share < 1.0 else 0.0


def cpu_quota(proc_cgroup: str | None = None, root: Path = Path("/sys/fs/cgroup")
              ) -> tuple[float, float]:
    """(:func:`cpu_share`, the period in seconds of the quota that sets it; 0 with none)."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return 1.0
    quotas = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2, the unified hierarchy
            for folder in _up_from(root, path):
                quotas.append(_quota_v2(folder / "cpu.max"))
        elif "cpu" in controllers.split(","):
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                for folder in _up_from(mount, path):
                    quotas.append(_quota_v1(folder))
                if mount.is_dir():
                    break
    found = [q for q in quotas if q is not None and q[0] > 0]
    return min([(1.0, 0.0), *found])


def _up_from(mount: Path, path: str) -> list[Path]:
    """``mount``/``path`` and each folder above it up to ``mount`` (in a cgroup namespace the
    path may name a folder that is not there: then only those that are)."""
    parts = [p for p in path.split("/") if p]
    folders = [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [f for f in folders if f.is_dir()]


def _quota_v2(file: Path) -> tuple[float, float] | None:
    try:
        quota, period = file.read_text().split()[:2]
        return None if quota == "max" else (int(quota) / int(period), int(period) / 1e6)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _quota_v1(folder: Path) -> tuple[float, float] | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else (quota / period, period / 1e6)
