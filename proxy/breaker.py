"""A per-worker circuit breaker: passive failure detection on the request path.

closed --(N consecutive failures)--> open --(cooldown)--> half-open
half-open --(success)--> closed;  half-open --(failure)--> open again.

While open the worker gets no traffic; in half-open it gets traffic again and
the next outcome decides. Active health probes also close it on recovery.

A failure counts what it says about the worker: a connection error, a timeout, a
broken stream always count; an error answer (5xx) counts once per distinct request
body (``request_key``) in a streak, so that one client resending a body the worker
cannot serve does not take the worker out for everyone, and :meth:`forgive` takes a
request's failure back once other workers have failed it too (it was the request).
"""

from __future__ import annotations

import time


class CircuitBreaker:
    def __init__(self, max_failures: int, cooldown_s: float) -> None:
        self.max_failures = max_failures
        self.cooldown_s = cooldown_s
        self.consecutive_failures = 0
        self.opened_at: float | None = None  # monotonic seconds, None = closed
        self.num_opened = 0
        self._streak_keys: set[int] = set()  # request keys of the answers counted in the streak
        self.last_success_s = float("-inf")  # monotonic seconds

    def allows(self, now: float | None = None) -> bool:
        """True when closed, or open for longer than the cooldown (half-open)."""
        if self.opened_at is None:
            return True
        return (time.monotonic() if now is None else now) - self.opened_at >= self.cooldown_s

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.allows() else "open"

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.opened_at = None
        if self._streak_keys:
            self._streak_keys.clear()
        self.last_success_s = time.monotonic()

    def succeeded_within(self, seconds: float) -> bool:
        """Whether the worker served a request successfully in the last ``seconds``."""
        return time.monotonic() - self.last_success_s <= seconds

    def record_failure(self, now: float | None = None, request_key: int | None = None) -> None:
        """A failure; ``request_key`` (a hash of the request's body) for an error answer,
        counted once per key in a streak; None (a connection error...) always counts."""
        if request_key is not None:
            if request_key in self._streak_keys:
                return
            self._streak_keys.add(request_key)
        self.consecutive_failures += 1
        half_open = self.opened_at is not None
        if half_open or self.consecutive_failures >= self.max_failures:
            self.opened_at = time.monotonic() if now is None else now
            self.num_opened += 1

    def forgive(self, request_key: int) -> None:
        """Take back the error answer counted for ``request_key``: the request failed
        elsewhere too, so it said nothing about this worker."""
        if request_key not in self._streak_keys:
            return
        self._streak_keys.discard(request_key)
        self.consecutive_failures = max(0, self.consecutive_failures - 1)
        if self.opened_at is not None and self.consecutive_failures < self.max_failures:
            self.opened_at = None
