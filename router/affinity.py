"""What each worker's prefix cache probably holds, so the cost of a request can count
only the prompt tokens it would have to prefill there.

The router cannot see a worker's cache; it sees where it sent each prompt. So every
worker gets a model of its cache: an LRU of the prefix-block hashes routed there
(:attr:`router.base.RequestShape.prefix_hashes`, chained, so a block's hash names the
whole prefix up to it), holding at most as many tokens as the worker's KV cache. That
is how an engine with automatic prefix caching behaves: finished requests' blocks stay
cached and the least recently used are evicted when space is needed. Round-robin makes
every worker hold the whole prefix working set and evict it; routing a prefix back to
the worker that has it partitions the working set.

``matched_blocks`` is the number of leading blocks of a request found in a worker's
model. The model can be wrong (the worker's KV is also busy with running requests,
another proxy sends it work, the worker restarts), so each worker also has a
:class:`HitRatio`: the tokens the worker reported as cached (``usage.prompt_tokens_
details.cached_tokens``) over the tokens the model predicted, smoothed. Predictions
are multiplied by it, so a model that promises hits the worker does not deliver stops
attracting traffic. Example::

    cache = PrefixCacheModel()
    cache.record("a", (11, 22, 33), tokens_per_block=64, capacity_tokens=32768)
    cache.matched_blocks("a", (11, 22, 44))  # -> 2
    cache.matched_blocks("b", (11, 22, 44))  # -> 0
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class HitRatio:
    """Realised over predicted cached tokens for one worker, an exponentially weighted
    ratio of sums (so one long prompt counts for its tokens, not as one sample)."""

    alpha: float = 0.1  # weight of each observation
    realised: float = 1.0  # smoothed tokens reported cached ...
    predicted: float = 1.0  # ... over smoothed tokens predicted cached (starts at 1:1)
    num_observed: int = 0

    @property
    def value(self) -> float:
        return min(self.realised / self.predicted, 1.0) if self.predicted > 0 else 1.0

    def observe(self, predicted_tokens: float, realised_tokens: float) -> None:
        if predicted_tokens <= 0:
            return  # nothing was promised: a hit elsewhere says nothing about the model
        a = self.alpha
        # NOTE: the first observation replaces the 1:1 start rather than averaging with it
        if self.num_observed == 0:
            self.realised, self.predicted = 0.0, 0.0
            a = 1.0
        self.realised += a * (min(realised_tokens, predicted_tokens) - self.realised)
        self.predicted += a * (predicted_tokens - self.predicted)
        self.num_observed += 1


class WorkerCache:
    """One worker's modelled prefix cache: block hash -> tokens in the block, LRU order."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[int, float] = OrderedDict()
        self.num_tokens = 0.0

    def __len__(self) -> int:
        return len(self._blocks)

    def matched_blocks(self, prefix_hashes: Sequence[int]) -> int:
        n = 0
        for h in prefix_hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def record(self, prefix_hashes: Sequence[int], tokens_per_block: float,
               capacity_tokens: float) -> None:
        blocks = self._blocks
        for h in prefix_hashes:
            old = blocks.pop(h, None)
            self.num_tokens += tokens_per_block - (old or 0.0)
            blocks[h] = tokens_per_block
        while self.num_tokens > capacity_tokens and blocks:
            _, tokens = blocks.popitem(last=False)
            self.num_tokens -= tokens


class PrefixCacheModel:
    """Per-worker modelled prefix caches and their realised hit ratios."""

    def __init__(self, hit_alpha: float = 0.1) -> None:
        if not 0.0 < hit_alpha <= 1.0:
            raise ValueError(f"hit_alpha: expected (0, 1], got {hit_alpha}")
        self.hit_alpha = hit_alpha
        self._caches: dict[str, WorkerCache] = {}
        self._hits: dict[str, HitRatio] = {}

    def __len__(self) -> int:
        """Block hashes modelled, over all workers."""
        return sum(len(c) for c in self._caches.values())

    def matched_blocks(self, worker: str, prefix_hashes: Sequence[int]) -> int:
        cache = self._caches.get(worker)
        return cache.matched_blocks(prefix_hashes) if cache is not None else 0

    def hit_ratio(self, worker: str) -> float:
        ratio = self._hits.get(worker)
        return ratio.value if ratio is not None else 1.0

    def record(self, worker: str, prefix_hashes: Sequence[int], tokens_per_block: float,
               capacity_tokens: float) -> None:
        """``worker`` now holds these blocks (most recently used), within its capacity."""
        if not prefix_hashes:
            return
        cache = self._caches.get(worker)
        if cache is None:
            cache = self._caches[worker] = WorkerCache()
        cache.record(prefix_hashes, tokens_per_block, capacity_tokens)

    def observe_hit(self, worker: str, predicted_tokens: float, realised_tokens: float) -> None:
        ratio = self._hits.get(worker)
        if ratio is None:
            ratio = self._hits[worker] = HitRatio(self.hit_alpha)
        ratio.observe(predicted_tokens, realised_tokens)

    def forget_worker(self, worker: str) -> None:
        """A restarted or replaced worker starts with an empty cache."""
        self._caches.pop(worker, None)
        self._hits.pop(worker, None)

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {w: {"blocks": len(c), "tokens": round(c.num_tokens),
                    "hit_ratio": round(self.hit_ratio(w), 3),
                    "hits_observed": self._hits[w].num_observed if w in self._hits else 0}
                for w, c in self._caches.items()}
