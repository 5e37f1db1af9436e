"""The per-worker prefix-cache model and the realised hit ratio, answers written out."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.affinity import HitRatio, PrefixCacheModel


def test_matches_leading_blocks_per_worker() -> None:
    cache = PrefixCacheModel()
    cache.record("a", (11, 22, 33), tokens_per_block=64, capacity_tokens=1000)
    assert cache.matched_blocks("a", (11, 22, 44)) == 2
    assert cache.matched_blocks("a", (11, 22, 33, 55)) == 3
    assert cache.matched_blocks("a", (99, 22, 33)) == 0  # only a leading run counts
    assert cache.matched_blocks("b", (11, 22, 33)) == 0
    assert cache.matched_blocks("a", ()) == 0


def test_evicts_least_recently_used_blocks_past_the_capacity() -> None:
    cache = PrefixCacheModel()
    cache.record("a", (1, 2), tokens_per_block=100, capacity_tokens=300)
    cache.record("a", (7,), tokens_per_block=100, capacity_tokens=300)
    cache.record("a", (1, 2), tokens_per_block=100, capacity_tokens=300)  # touches 1, 2
    cache.record("a", (9,), tokens_per_block=100, capacity_tokens=300)  # evicts 7
    assert cache.matched_blocks("a", (7,)) == 0
    assert cache.matched_blocks("a", (1, 2)) == 2 and cache.matched_blocks("a", (9,)) == 1
    assert len(cache) == 3
    assert cache.snapshot()["a"]["tokens"] == 300


def test_a_prefix_longer_than_the_cache_keeps_only_its_tail_blocks() -> None:
    cache = PrefixCacheModel()
    cache.record("a", tuple(range(10)), tokens_per_block=100, capacity_tokens=500)
    assert cache.matched_blocks("a", tuple(range(10))) == 0  # the leading blocks went first
    assert len(cache) == 5


def test_forget_worker_empties_its_cache_and_ratio() -> None:
    cache = PrefixCacheModel()
    cache.record("a", (1, 2), 64, 1000)
    cache.observe_hit("a", 128, 0)
    cache.forget_worker("a")
    assert cache.matched_blocks("a", (1, 2)) == 0 and cache.hit_ratio("a") == 1.0


def test_hit_ratio_tracks_realised_over_predicted_tokens() -> None:
    r = HitRatio(alpha=0.5)
    assert r.value == 1.0
    r.observe(predicted_tokens=0, realised_tokens=500)  # nothing promised: no evidence
    assert r.value == 1.0 and r.num_observed == 0
    r.observe(1000, 250)
    assert r.value == pytest.approx(0.25)
    r.observe(1000, 1000)  # (0.5*250 + 0.5*1000) / (0.5*1000 + 0.5*1000)
    assert r.value == pytest.approx(0.625)
    r.observe(100, 5000)  # more than promised counts as the promise: the ratio caps at 1
    assert r.value <= 1.0


def test_bad_hit_alpha_is_refused() -> None:
    with pytest.raises(ValueError, match="hit_alpha"):
        PrefixCacheModel(hit_alpha=0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 30), max_size=12), st.integers(1, 200)),
                max_size=40), st.integers(0, 2000))
def test_the_modelled_cache_never_exceeds_its_capacity(
        requests: list[tuple[list[int], int]], capacity: int) -> None:
    cache = PrefixCacheModel()
    for blocks, tokens in requests:
        cache.record("w", blocks, tokens, capacity)
        snap = cache.snapshot().get("w")
        if snap is not None:
            assert snap["tokens"] <= capacity
        # what was just recorded is the most recent: its tail survives as long as it fits
        matched = cache.matched_blocks("w", blocks)
        assert 0 <= matched <= len(blocks)
