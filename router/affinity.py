"""Prefix-cache affinity: a bounded LRU from prompt prefix-block hash to the worker that has it.

Requests sharing leading 512-token blocks should land where those blocks are
already cached. ``lookup`` returns the worker that last served the longest
known prefix of the request; ``record`` remembers every block of a routed
request. Memory is bounded by ``capacity`` entries (oldest evicted first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixAffinity:
    def __init__(self, capacity: int = 65536) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity: expected > 0, got {capacity}")
        self.capacity = capacity
        self._map: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def lookup(self, prefix_hashes: Sequence[int]) -> tuple[str, int] | None:
        """(worker, number of matching leading blocks) for the longest known prefix."""
        for i in range(len(prefix_hashes) - 1, -1, -1):
            worker = self._map.get(prefix_hashes[i])
            if worker is not None:
                return worker, i + 1
        return None

    def record(self, prefix_hashes: Sequence[int], worker: str) -> None:
        m = self._map
        for h in prefix_hashes:
            m[h] = worker
            m.move_to_end(h)
        while len(m) > self.capacity:
            m.popitem(last=False)

    def forget_worker(self, worker: str) -> None:
        for h in [h for h, w in self._map.items() if w == worker]:
            del self._map[h]
