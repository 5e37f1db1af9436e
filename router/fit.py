"""Declared-fit routing: each request goes to a worker whose compiled config was tuned for it.

For vLLM workers the speculative depth is fixed per worker (or per batch size),
so routing is how a request gets the speculation that suits it: an n-gram
worker declared for ``code`` and ``extraction`` gets those, a plain worker the
rest. This policy reads only the workers' declared fit
(:class:`polyinfer.config.DeclaredFit`) and their load, which makes it
predictable; the adaptive policy learns the same from measurements.

Per request, each routable worker gets a rank::

    2  its fit lists the request's domain (and covers the prompt length)
    1  its fit declares no domains but covers the prompt length
    0  its fit does not cover the request

The highest rank wins, ties go to the fewest outstanding (then scraped
running + waiting) requests, rotating among equals. With no worker of rank
> 0, every routable worker is a candidate (reason ``fallback``), so a request is
never refused for want of a fitting worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.base import RequestOutcome, RequestShape, RouteDecision, WorkerView


def fit_rank(shape: RequestShape, view: WorkerView) -> int:
    """2 = declared for this domain, 1 = declared for any domain, 0 = not covering."""
    fit = view.config.fit
    if not fit.covers(shape.domain, shape.prompt_tokens):
        return 0
    return 2 if fit.domains else 1


class DeclaredFitPolicy:
    """Best declared fit first, then least outstanding; see the module docstring."""

    name = "declared_fit"

    def __init__(self) -> None:
        self._tie = 0

    def choose(self, shape: RequestShape, workers: Sequence[WorkerView]) -> RouteDecision:
        self._tie += 1
        n = len(workers)
        ranks = [fit_rank(shape, w) for w in workers]
        best = min(range(n), key=lambda i: (-ranks[i], workers[i].outstanding_requests,
                                            workers[i].running + workers[i].waiting,
                                            (i - self._tie) % n))
        return RouteDecision(worker=workers[best].name,
                             reason="fit" if ranks[best] > 0 else "fallback")

    def observe(self, outcome: RequestOutcome) -> None:
        return None
