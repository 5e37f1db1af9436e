"""Engine workers' per-step timings, scraped from ``/metrics``, into the depth policies.

Two :class:`specdec.policy.DepthPolicy` objects can pick k in a proxy: the relay's
(speculation mode ``adaptive``) and the routing policy's own (the adaptive router asks
it for the depth on each worker it scores). Both need ``t(batch, k)``, and the engine
knows it per step: it exports the least-squares sums of its steps
(:mod:`specdec.step_feed`), which each scrape hands to both. The routing policy can be
switched at run time, so the policies are looked up at every scrape; a worker that
exports no sums (vLLM, an external server) is skipped by the parser.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from specdec.policy import DepthPolicy
from specdec.step_feed import StepFeed

if TYPE_CHECKING:
    from proxy.pool import Worker
    from proxy.relay import Relay

logger = logging.getLogger(__name__)


class StepTimeFeeds:
    """A scrape hook: one :class:`StepFeed` per depth policy in use."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self._feeds: dict[int, StepFeed] = {}  # id(policy) -> its feed

    def policies(self) -> list[DepthPolicy]:
        return self.relay.depth_policies()

    def on_scrape(self, worker: Worker, text: str) -> None:
        try:
            # NOTE: rebuilt each time so a policy switched out is dropped, not kept alive
            self._feeds = {id(p): self._feeds.get(id(p)) or StepFeed(p) for p in self.policies()}
            for feed in self._feeds.values():
                feed.on_metrics(worker.name, text)
        except Exception:  # NOTE: learning must never stop the scrape loop
            logger.exception("step-time feed failed for worker %s", worker.name)
