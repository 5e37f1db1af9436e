"""The routing contract: what the proxy tells a policy, and what a policy answers.

Every policy (round-robin, least-outstanding, random, adaptive) implements
:class:`RoutingPolicy`. The calling convention is one and synchronous: the
proxy builds a :class:`RequestShape` and a list of :class:`WorkerView`
snapshots, calls ``choose`` on the event loop (so it must be cheap: no I/O, no
model fitting, well under a millisecond), and later reports each finished
request to ``observe``. Policies never see request bodies or prompt text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from polyinfer.config import CompiledConfig


@dataclass(frozen=True)
class RequestShape:
    """What the router knows about a request before it runs."""

    domain: str  # one of polyinfer.config.DOMAINS
    prompt_tokens: int  # exact with the served tokenizer, else an estimate
    max_tokens: int | None  # as requested; None when the client set none
    predicted_output_tokens: int  # max_tokens, or the learned per-domain prediction
    stream: bool = False
    # chained hashes of the prompt's leading fixed-size blocks, in order (equal = shared
    # prefix up to that block; the block size is the shape estimator's, TokenConfig.block_chars)
    prefix_hashes: tuple[int, ...] = ()
    # the depth fixed before routing: the client's, else the speculation settings'
    # (router.speculation.DepthChooser.pin); None = chosen with the worker
    speculative_depth: int | None = None
    slo_ttft_s: float | None = None  # per-request or per-domain SLO, seconds
    slo_tpot_s: float | None = None
    prefix_block_tokens: float = 0.0  # prompt tokens per prefix block (0: unknown)


@dataclass
class WorkerView:
    """A snapshot of one worker as the proxy sees it at decision time."""

    name: str
    url: str
    backend: str  # engine | vllm | external
    config: CompiledConfig
    healthy: bool = True
    draining: bool = False
    outstanding_requests: int = 0  # sent by this proxy, not yet finished
    outstanding_tokens: int = 0  # prompt + predicted output tokens of those
    running: int = 0  # scraped vllm:num_requests_running
    waiting: int = 0  # scraped vllm:num_requests_waiting
    kv_cache_usage: float = 0.0  # scraped vllm:kv_cache_usage_perc, 0..1
    max_outstanding: int = 0  # the proxy's cap on outstanding_requests (0: none)

    @property
    def can_route(self) -> bool:
        return self.healthy and not self.draining


@dataclass(frozen=True)
class RouteDecision:
    worker: str  # WorkerView.name
    spec_depth: int | None = None  # speculative_depth to send (engine workers), None = default
    reason: str = ""  # short label counted in /stats ("fit", "load", "affinity", "explore", ...)


@dataclass(frozen=True)
class RequestOutcome:
    """A finished request, as reported to ``observe`` (a subset of the trace record)."""

    worker: str
    shape: RequestShape
    status: str  # "ok" | "error" | "cancelled"
    completion_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    spec_depth: int | None = None
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    batch_size: int | None = None  # worker's running requests when it was sent, if known
    extra: dict[str, float] = field(default_factory=dict)


class NoWorkerAvailable(RuntimeError):
    """No healthy, non-draining worker can take the request."""


@runtime_checkable
class RoutingPolicy(Protocol):
    """Chooses a worker (and, for engine workers, a speculative depth) per request."""

    name: str

    def choose(self, shape: RequestShape, workers: Sequence[WorkerView]) -> RouteDecision:
        """Pick among ``workers`` (already filtered to routable ones, never empty)."""
        ...

    def observe(self, outcome: RequestOutcome) -> None:
        """Learn from a finished request. Must be cheap and never raise."""
        ...


_T = TypeVar("_T")


def fast_constructor(cls: type[_T]) -> Callable[[dict[str, Any]], _T]:
    """``fields -> cls(**fields)`` for a frozen dataclass built on a hot path (every field
    given).

    NOTE: a frozen dataclass's ``__init__`` sets each field with ``object.__setattr__``;
    setting the instance's ``__dict__`` at once is the same object at a fraction of the
    cost (~1 us a request for :class:`RequestShape` and :class:`RequestOutcome`). Only
    while the class has no ``__post_init__`` or slots: else its constructor."""
    if hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"):
        return lambda fields: cls(**fields)
    new, set_attr = object.__new__, object.__setattr__

    def build(fields: dict[str, Any]) -> _T:
        obj = new(cls)
        set_attr(obj, "__dict__", fields)
        return obj
    return build
