"""Routing policies by name, built lazily so a policy's imports load only when used.

``routing.policy`` in the config (or ``PUT /admin/policy``) names one of
:data:`POLICIES`, or gives ``"package.module:Class"`` for any class that
implements :class:`router.base.RoutingPolicy`.
"""

from __future__ import annotations

import importlib
import inspect
from types import MappingProxyType

from polyinfer.config import ConfigError
from router.base import RoutingPolicy
from specdec.policy import DepthPolicy, PolicyConfig

POLICIES: MappingProxyType[str, str] = MappingProxyType({
    "round_robin": "router.baselines:RoundRobinPolicy",
    "least_outstanding": "router.baselines:LeastOutstandingPolicy",
    "random": "router.baselines:RandomPolicy",
    "adaptive": "router.adaptive:AdaptivePolicy",
    "declared_fit": "router.fit:DeclaredFitPolicy",
})


def is_policy_name(name: str) -> bool:
    return name in POLICIES or (":" in name and not name.startswith(":"))


def build_policy(name: str, seed: int = 0, max_depth: int | None = None) -> RoutingPolicy:
    """Instantiate a policy; ``seed`` is passed to policies that take one, and to those
    that pick depths (take a ``depth_policy``) a depth policy capped at ``max_depth``
    (``speculation.max_depth``; None: the depth policy's default cap)."""
    target = POLICIES.get(name, name)
    module_name, _, class_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"routing.policy: {name!r} is not available ({e})") from e
    params = inspect.signature(cls).parameters
    kwargs: dict[str, object] = {"seed": seed} if "seed" in params else {}
    if "depth_policy" in params and max_depth is not None:
        kwargs["depth_policy"] = DepthPolicy(PolicyConfig(max_depth=max_depth))
    policy = cls(**kwargs)
    if not isinstance(policy, RoutingPolicy):
        raise ConfigError(f"routing.policy: {target} does not implement RoutingPolicy")
    return policy
