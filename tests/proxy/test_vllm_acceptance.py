"""Scraped vllm:spec_decode_* deltas attributed per (worker, domain) (proxy.vllm_acceptance)."""

from __future__ import annotations

import json

import pytest

from polyinfer.config import CompiledConfig, VllmConfig
from proxy.breaker import CircuitBreaker
from proxy.config import WorkerSpec
from proxy.pool import Worker
from proxy.record import RequestRecord
from proxy.stats import Stats
from proxy.vllm_acceptance import ScrapedAcceptance
from router.base import RequestShape, WorkerView
from specdec.policy import DepthPolicy


def _worker(name: str = "ngram", url: str = "http://127.0.0.1:1", backend: str = "vllm") -> Worker:
    spec_json = json.dumps({"method": "ngram", "num_speculative_tokens": 2})
    config = CompiledConfig(backend=backend, vllm=VllmConfig(speculative_config=spec_json))  # type: ignore[arg-type]
    spec = WorkerSpec(name=name, url=url, config=config)
    view = WorkerView(name=name, url=url, backend=backend, config=config)
    return Worker(spec=spec, url=url, breaker=CircuitBreaker(3, 1.0), view=view)


def _finish(acc: ScrapedAcceptance, worker: str, domain: str, tokens: int,
            status: str = "ok") -> None:
    rec = RequestRecord(request_id="r", ts=0.0, t0=0.0, endpoint="completions", worker=worker,
                        status=status, completion_tokens=tokens,
                        shape=RequestShape(domain=domain, prompt_tokens=10, max_tokens=tokens,
                                           predicted_output_tokens=tokens))
    acc.on_finish(rec)


def _scrape(acc: ScrapedAcceptance, w: Worker, draft: float, accepted: float) -> None:
    w.scraped_draft_tokens, w.scraped_accepted_tokens = draft, accepted
    acc.on_scrape(w, "")


def test_deltas_split_by_output_tokens_per_domain():
    stats, policy = Stats(), DepthPolicy()
    acc, w = ScrapedAcceptance(stats, policy), _worker()
    _finish(acc, "ngram", "code", 50)
    _scrape(acc, w, 1000, 900)  # first sight: history before the proxy is not attributed
    assert stats.spec_tokens == {}
    _finish(acc, "ngram", "code", 30)
    _finish(acc, "ngram", "chat", 10)
    _finish(acc, "ngram", "chat", 5, status="error")  # failed requests do not count
    _scrape(acc, w, 1200, 1020)  # +200 drafted, +120 accepted: 3/4 code, 1/4 chat
    assert stats.spec_tokens == {("ngram", "code"): [150, 90], ("ngram", "chat"): [50, 30]}
    before = policy.acceptance("ngram", "code").mean
    _finish(acc, "ngram", "code", 10)
    _scrape(acc, w, 1300, 1100)  # 80% accepted: the estimate moves up
    assert stats.spec_tokens[("ngram", "code")] == [250, 170]
    assert policy.acceptance("ngram", "code").mean > before


def test_window_without_drafts_is_dropped_and_reset_counters_rebase():
    stats = Stats()
    acc, w = ScrapedAcceptance(stats), _worker()
    _scrape(acc, w, 100, 50)
    _finish(acc, "ngram", "qa", 10)
    _scrape(acc, w, 100, 50)  # nothing drafted: nothing to attribute, window closed
    _finish(acc, "ngram", "code", 10)
    _scrape(acc, w, 40, 30)  # went down: the server restarted; its totals are the delta
    assert stats.spec_tokens == {("ngram", "code"): [40, 30]}


def test_counters_are_per_url_and_engine_workers_are_skipped():
    stats = Stats()
    acc = ScrapedAcceptance(stats)
    old, new = _worker(url="http://127.0.0.1:1"), _worker(url="http://127.0.0.1:2")
    _scrape(acc, old, 500, 400)
    _finish(acc, "ngram", "code", 10)
    _scrape(acc, new, 20, 10)  # a replacement under the same name: a new baseline
    assert stats.spec_tokens == {}
    engine = _worker(name="eng", backend="engine")
    _scrape(acc, engine, 0, 0)
    _finish(acc, "eng", "code", 10)
    _scrape(acc, engine, 100, 50)
    assert ("eng", "code") not in stats.spec_tokens


def test_a_broken_worker_config_never_raises_into_the_scrape_loop(caplog: pytest.LogCaptureFixture):
    acc, w = ScrapedAcceptance(Stats()), _worker()
    _scrape(acc, w, 10, 5)
    _finish(acc, "ngram", "code", 10)
    w.view.config = None  # type: ignore[assignment]
    _scrape(acc, w, 20, 10)
    assert "acceptance attribution failed" in caplog.text


def test_drafts_of_running_requests_wait_for_them_to_finish():
    stats = Stats()
    acc, w = ScrapedAcceptance(stats), _worker()
    _scrape(acc, w, 0, 0)
    _scrape(acc, w, 100, 80)  # a long request is drafting; nothing has finished yet
    _scrape(acc, w, 200, 160)
    _finish(acc, "ngram", "code", 300)
    _scrape(acc, w, 210, 168)
    assert stats.spec_tokens == {("ngram", "code"): [210, 168]}
