"""The speculative depth of a request: the ``speculation`` settings and their one owner.

A routing decision is a worker and a depth, made once per request. The
:class:`DepthChooser` owns the rules around the routing policy's part of it::

    shape = chooser.pin(shape)              # a client's depth, or mode off / fixed
    decision = policy.choose(shape, views)  # the adaptive router prices the pinned depth
    decision = chooser.complete(decision, shape, view)  # the depth to send

A depth fixed before routing (the client's ``speculative_depth``, else ``0`` in mode
``off`` or ``fixed_depth`` in mode ``fixed``) is written into the shape, so a policy that
prices depths (:class:`router.adaptive.AdaptivePolicy`) prices and records the depth that
is sent. ``complete`` gives the decision the depth sent to an engine worker: the pinned
one, else the policy's, else (mode ``adaptive``, a policy that picks no depth: the
baselines) the chooser's own :class:`specdec.policy.DepthPolicy`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from polyinfer.config import ConfigError
from router.base import RequestOutcome, RequestShape, RouteDecision, WorkerView
from specdec.policy import DepthPolicy, PolicyConfig

MODES = ("adaptive", "policy", "fixed", "off")


@dataclass(frozen=True)
class SpeculationConfig:
    """How ``speculative_depth`` is chosen for engine workers; a client's own value always wins.

    adaptive: the routing decision's depth if it gives one, else
    :class:`specdec.policy.DepthPolicy` (learned acceptance x step time);
    policy: the routing decision's depth only (none = the worker's default);
    fixed: ``fixed_depth``; off: 0.
    """

    mode: Literal["adaptive", "policy", "fixed", "off"] = "adaptive"
    fixed_depth: int = 0  # sent when mode == fixed
    max_depth: int = 6  # cap for the adaptive depth policy

    def __post_init__(self) -> None:
        for ok, key, expected, got in (
                (self.mode in MODES, "mode", f"one of {list(MODES)}", self.mode),
                (0 <= self.fixed_depth <= 16, "fixed_depth", "0..16", self.fixed_depth),
                (0 <= self.max_depth <= 16, "max_depth", "0..16", self.max_depth)):
            if not ok:
                raise ConfigError(f"speculation.{key}: expected {expected}, got {got!r}")

    def pinned_depth(self) -> int | None:
        """The depth every request gets whatever the routing (None: it is chosen per request)."""
        if self.mode == "off":
            return 0
        return self.fixed_depth if self.mode == "fixed" else None


class DepthChooser:
    """The one owner of a request's speculative depth; see the module docstring."""

    def __init__(self, config: SpeculationConfig | None = None,
                 depth_policy: DepthPolicy | None = None) -> None:
        self.config = config or SpeculationConfig()
        self.depth_policy = depth_policy if depth_policy is not None else DepthPolicy(
            PolicyConfig(max_depth=self.config.max_depth))

    def pin(self, shape: RequestShape) -> RequestShape:
        """The shape with the depth fixed before routing: the client's, else the settings'."""
        depth = self.config.pinned_depth()
        if shape.speculative_depth is not None or depth is None:
            return shape
        return replace(shape, speculative_depth=depth)

    def complete(self, decision: RouteDecision, shape: RequestShape, view: WorkerView
                 ) -> RouteDecision:
        """``decision`` with the depth to send to ``view`` (None: the worker's default, and
        always for a worker that is not the built-in engine)."""
        depth = self._depth(decision, shape, view)
        return decision if depth == decision.spec_depth else replace(decision, spec_depth=depth)

    def _depth(self, decision: RouteDecision, shape: RequestShape, view: WorkerView
               ) -> int | None:
        if view.backend != "engine":
            return None
        if shape.speculative_depth is not None:
            return shape.speculative_depth
        if decision.spec_depth is not None or self.config.mode != "adaptive":
            return decision.spec_depth
        engine = view.config.engine
        if engine.spec_method == "none":
            return None
        return self.depth_policy.decide(view.name, shape.domain, view.running + 1,
                                        engine.spec_max_depth)

    def observe(self, outcome: RequestOutcome) -> None:
        """Learn acceptance and step times from a finished request sent at a known depth."""
        if outcome.spec_depth is None or outcome.status != "ok" or not outcome.completion_tokens:
            return
        if outcome.ttft_s is None or outcome.e2e_s is None:
            return
        self.depth_policy.observe_request(
            outcome.worker, outcome.shape.domain, (outcome.batch_size or 0) + 1,
            outcome.spec_depth, outcome.spec_draft_tokens, outcome.spec_accepted_tokens,
            outcome.completion_tokens, outcome.e2e_s - outcome.ttft_s)
