"""Speculative acceptance per (worker, domain) for vLLM workers, from their scraped counters.

vLLM reports no per-request speculation counts, only worker-lifetime counters
(``vllm:spec_decode_num_draft_tokens_total``,
``vllm:spec_decode_num_accepted_tokens_total``). Between two scrapes of a
worker, the counters' deltas are split over the domains of the requests that
finished on it in that window, in proportion to their output tokens::

    draft(worker, domain) += delta_draft * tokens(domain) / tokens(all)

A scrape with no finished request in its window keeps the baseline, so the
drafts of long requests are attributed when they finish. That is exact for a
one-domain window and an estimate for a mixed one (drafts of requests still
running at the end of a window go to the domains that finished in it); over
many windows it converges to the per-domain rates. The result goes where the
engine workers' per-request counts go: the proxy's ``/stats`` acceptance table
(and so :func:`specdec.schedule.acceptance_from_counts`) and the depth policy.

A counter that goes down (the worker restarted, or a blue-green replacement
gave the name a new server) starts a new baseline; counters are tracked per
worker URL for the same reason.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.pool import Worker
    from proxy.record import RequestRecord
    from proxy.stats import Stats
    from specdec.policy import DepthPolicy

logger = logging.getLogger(__name__)

# Backends whose acceptance comes from scraped counters: the engine reports
# per-request counts in usage.spec_decode instead, which the relay reads.
SCRAPED_BACKENDS = ("vllm", "external")


class ScrapedAcceptance:
    """Attributes scraped speculation counters to domains; hooks for the relay and the pool."""

    def __init__(self, stats: Stats, depth_policy: DepthPolicy | None = None) -> None:
        self.stats = stats
        self.depth_policy = depth_policy
        self._tokens: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._last: dict[str, tuple[float, float]] = {}  # worker URL -> (draft, accepted)

    def on_finish(self, rec: RequestRecord) -> None:
        """Count a finished request's output tokens toward its worker's current window."""
        if rec.status == "ok" and rec.worker and rec.completion_tokens and not \
                rec.spec_draft_tokens:
            self._tokens[rec.worker][rec.domain or "none"] += rec.completion_tokens

    def on_scrape(self, worker: Worker, _text: str) -> None:
        """Split the counters' growth since the last scrape over the window's domains
        (read from the worker's parsed counters; the text is not needed)."""
        if worker.backend not in SCRAPED_BACKENDS:
            return
        try:
            self._on_scrape(worker)
        except Exception:  # NOTE: learning must never stop the scrape loop
            logger.exception("acceptance attribution failed for worker %s", worker.name)

    def _on_scrape(self, worker: Worker) -> None:
        current = (worker.scraped_draft_tokens, worker.scraped_accepted_tokens)
        previous = self._last.get(worker.url)
        if previous is None:  # first sight of this server: its history is not ours
            self._last[worker.url] = current
            self._tokens.pop(worker.name, None)
            return
        if current[0] < previous[0] or current[1] < previous[1]:
            previous = (0.0, 0.0)  # counters went down: the server restarted
        window = self._tokens.pop(worker.name, None)
        if not window:
            # NOTE: keep the old baseline: drafts of requests still running are
            # attributed when they finish, not dropped.
            self._last[worker.url] = previous
            return
        self._last[worker.url] = current
        draft, accepted = current[0] - previous[0], current[1] - previous[1]
        if draft > 0:
            self._attribute(worker, window, draft, min(accepted, draft))

    def _attribute(self, worker: Worker, window: dict[str, float], draft: float,
                   accepted: float) -> None:
        total = sum(window.values())
        spec = worker.view.config.vllm.speculative or {}
        depth = int(spec.get("num_speculative_tokens") or 0)
        for domain, tokens in window.items():
            share = tokens / total
            pair = self.stats.spec_tokens.setdefault((worker.name, domain), [0, 0])
            pair[0] += round(draft * share)
            pair[1] += round(accepted * share)
            if self.depth_policy is not None:
                self.depth_policy.observe_acceptance(worker.name, domain, round(draft * share),
                                                     round(accepted * share), depth)
