"""AdaptivePolicy with prefix caches: the cached-prefix cost term, affinity that falls out
of it, the overload spill, no herding on a hot prefix, and the realised hit ratio."""

from __future__ import annotations

from collections import Counter

import pytest

from polyinfer.config import CompiledConfig
from router.adaptive import AdaptiveConfig, AdaptivePolicy, caches_prefixes
from router.base import RequestOutcome, RequestShape, WorkerView

CACHING = CompiledConfig().with_engine(max_num_seqs=8, max_num_batched_tokens=512)
NO_CACHE = CACHING.with_engine(enable_prefix_caching=False)
NO_EXPLORE = AdaptiveConfig(explore_prob=0.0, confidence=None)  # the cost model alone
BLOCK = 100.0  # prompt tokens per prefix block in these shapes


def views(config: CompiledConfig = CACHING) -> list[WorkerView]:
    return [WorkerView("a", "http://a", "engine", config),
            WorkerView("b", "http://b", "engine", config)]


def shape(prefix: tuple[int, ...], prompt: int = 1000, out: int = 20) -> RequestShape:
    return RequestShape("rag", prompt, None, out, prefix_hashes=prefix,
                        prefix_block_tokens=BLOCK)


def teach(policy: AdaptivePolicy, view: WorkerView, n: int = 40) -> None:
    """Prefill costs 0.5 s per 1000 computed prompt tokens, decode 10 ms a token."""
    for i in range(n):
        prompt = 200 + 100 * (i % 10)
        s = RequestShape("rag", prompt, None, 20)
        policy.choose(s, [view])
        ttft = 0.02 + 0.5 * prompt / 1000
        policy.observe(RequestOutcome(view.name, s, "ok", completion_tokens=20, ttft_s=ttft,
                                      tpot_s=0.01, e2e_s=ttft + 19 * 0.01))


def taught(config: CompiledConfig = CACHING) -> tuple[AdaptivePolicy, list[WorkerView]]:
    p, ws = AdaptivePolicy(NO_EXPLORE), views(config)
    for w in ws:
        teach(p, w)
    return p, ws


def finish(p: AdaptivePolicy, s: RequestShape, worker: str, cached: float | None = None) -> None:
    """Report ``s`` done (its TPOT only: these tests teach TTFT in ``teach``)."""
    extra = {} if cached is None else {"cached_tokens": float(cached)}
    p.observe(RequestOutcome(worker, s, "ok", completion_tokens=20, tpot_s=0.01, extra=extra))


def test_which_workers_cache_prefixes() -> None:
    assert caches_prefixes(WorkerView("e", "u", "engine", CACHING))
    assert not caches_prefixes(WorkerView("e", "u", "engine", NO_CACHE))
    assert caches_prefixes(WorkerView("v", "u", "vllm", CompiledConfig(backend="vllm")))
    assert not caches_prefixes(WorkerView("x", "u", "external", CompiledConfig(backend="external")))


def test_the_cached_prefix_comes_off_the_predicted_ttft() -> None:
    p, ws = taught()
    first = shape((1, 2, 3, 4, 5, 6))
    assert p.choose(first, [ws[0]]).worker == "a"
    finish(p, first, "a")
    s = shape((1, 2, 3, 4, 5, 6, 7, 8), prompt=1000)  # shares 6 blocks = 600 tokens
    on_a, on_b = p.candidate(s, ws[0]), p.candidate(s, ws[1])
    assert (on_a.cached_tokens, on_b.cached_tokens) == (600.0, 0.0)
    # prefill of 400 instead of 1000 computed tokens: 0.5 s/1000 x 600 = 0.3 s less (as
    # learned: the bucket fits are not exact)
    assert on_b.ttft_s - on_a.ttft_s == pytest.approx(0.3, rel=0.25)
    assert on_a.prefill_s == pytest.approx(on_b.prefill_s * 0.4, rel=0.1)
    d = p.choose(s, ws)
    assert (d.worker, d.reason) == ("a", "affinity")
    assert p.stats()["reasons"]["affinity"] == 1


def test_affinity_yields_to_load() -> None:
    p, ws = taught()
    first = shape((1, 2, 3))
    p.choose(first, [ws[0]])
    finish(p, first, "a")
    ws[0].outstanding_requests = 12  # past its 8 slots: the saved 0.15 s is not worth a wait
    d = p.choose(shape((1, 2, 3, 9)), ws)
    assert d.worker == "b" and d.reason != "affinity"


def test_no_cached_prefix_without_prefix_caching() -> None:
    p, ws = taught(NO_CACHE)
    first = shape((1, 2, 3, 4, 5, 6))
    p.choose(first, [ws[0]])
    finish(p, first, "a")
    s = shape((1, 2, 3, 4, 5, 6, 7))
    assert p.candidate(s, ws[0]).cached_tokens == 0.0
    assert p.choose(s, ws).reason != "affinity"


def test_a_hot_prefix_spreads_instead_of_herding() -> None:
    p, ws = taught()
    picks: Counter[str] = Counter()
    for i in range(40):  # one shared 800-token prefix, nothing finishes: load grows
        d = p.choose(shape((1, 2, 3, 4, 5, 6, 7, 8, 100 + i)), ws)
        picks[d.worker] += 1
        next(w for w in ws if w.name == d.worker).outstanding_requests += 1
    assert min(picks.values()) >= 15, picks  # both end up holding the prefix and share it
    cached = [p.candidate(shape((1, 2, 3, 4, 5, 6, 7, 8)), w).model_cached_tokens for w in ws]
    assert cached == [800.0, 800.0]


def test_a_worker_that_does_not_deliver_its_hits_loses_the_affinity() -> None:
    p, ws = taught()
    first = shape((1, 2, 3, 4, 5, 6))
    p.choose(first, [ws[0]])
    finish(p, first, "a", cached=0)
    for i in range(10):  # every request hits the model on "a", the worker reports 0 cached
        s = shape((1, 2, 3, 4, 5, 6, 50 + i))
        assert p.choose(s, [ws[0]]).worker == "a"
        finish(p, s, "a", cached=0)
    s = shape((1, 2, 3, 4, 5, 6, 99))
    assert p.candidate(s, ws[0]).model_cached_tokens == 600.0
    assert p.candidate(s, ws[0]).cached_tokens < 50.0
    assert p.prefix_cache.hit_ratio("a") < 0.1 and p.prefix_cache.hit_ratio("b") == 1.0


def test_the_realised_cached_tokens_teach_the_ttft_model() -> None:
    p, ws = taught()
    for i in range(40):  # prompts of 1000 tokens, 800 found cached: TTFT of 200 computed
        s = shape((1, 2, 3, 4, 5, 6, 7, 8, 200 + i))
        p.choose(s, [ws[0]])
        p.observe(RequestOutcome("a", s, "ok", completion_tokens=20, ttft_s=0.12, tpot_s=0.01,
                                 e2e_s=0.31, extra={"cached_tokens": 800.0}))
    cold = RequestShape("rag", 1000, None, 20)
    assert p.candidate(cold, ws[0]).ttft_s == pytest.approx(0.52, rel=0.15)


def test_capacity_follows_the_kv_cache_and_evicts() -> None:
    small = CACHING.with_engine(kv_cache_tokens=1024)
    p, ws = AdaptivePolicy(NO_EXPLORE), views(small)
    assert p.cache_capacity_tokens(ws[0]) == 1024.0
    p.choose(shape((1, 2, 3, 4, 5)), [ws[0]])  # 500 tokens
    p.choose(shape((7, 8, 9, 10, 11, 12)), [ws[0]])  # 600 more: the oldest blocks go
    assert p.candidate(shape((1, 2, 3, 4, 5)), ws[0]).model_cached_tokens == 0.0
    assert p.candidate(shape((7, 8, 9)), ws[0]).model_cached_tokens == 300.0
    vllm = WorkerView("v", "u", "vllm", CompiledConfig(backend="vllm"))
    assert p.cache_capacity_tokens(vllm) == float(AdaptiveConfig().prefix_cache_tokens)


def test_prefix_config_validation() -> None:
    with pytest.raises(ValueError, match="prefix_block_tokens"):
        AdaptiveConfig(prefix_block_tokens=0)
    with pytest.raises(ValueError, match="hit_alpha"):
        AdaptiveConfig(hit_alpha=1.5)


def test_a_reloaded_worker_starts_with_an_empty_modelled_cache() -> None:
    p, ws = taught()
    first = shape((1, 2, 3, 4))
    p.choose(first, [ws[0]])
    finish(p, first, "a")
    assert p.candidate(shape((1, 2, 3, 4, 5)), ws[0]).model_cached_tokens == 400.0
    ws[0].config = CACHING.with_engine(max_num_seqs=12)  # the optimizer reloaded it
    assert p.candidate(shape((1, 2, 3, 4, 5)), ws[0]).model_cached_tokens == 0.0


def test_a_bad_reported_cached_count_is_ignored() -> None:
    p, ws = taught()
    for bad in (float("nan"), -5.0):
        s = shape((1, 2, 3))
        p.choose(s, [ws[0]])
        finish(p, s, "a", cached=bad)
    assert p.prefix_cache.hit_ratio("a") == 1.0
