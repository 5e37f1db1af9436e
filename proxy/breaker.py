"""A per-worker circuit breaker: passive failure detection on the request path.

closed --(N consecutive failures)--> open --(cooldown)--> half-open
half-open --(success)--> closed;  half-open --(failure)--> open again.

While open the worker gets no traffic; in half-open it gets traffic again and
the next outcome decides. Active health probes also close it on recovery.
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

    def record_failure(self, now: float | None = None) -> None:
        self.consecutive_failures += 1
        half_open = self.opened_at is not None
        if half_open or self.consecutive_failures >= self.max_failures:
            self.opened_at = time.monotonic() if now is None else now
            self.num_opened += 1
