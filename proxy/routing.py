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

POLICIES: MappingProxyType[str, str] = MappingProxyType({
    "round_robin": "router.baselines:RoundRobinPolicy",
    "least_outstanding": "router.baselines:LeastOutstandingPolicy",
    "random": "router.baselines:RandomPolicy",
    "adaptive": "router.adaptive:AdaptivePolicy",
    "declared_fit": "router.fit:DeclaredFitPolicy",
})


def is_policy_name(name: str) -> bool:
    return name in POLICIES or (":" in name and not name.startswith(":"))


def build_policy(name: str, seed: int = 0) -> RoutingPolicy:
    """Instantiate a policy; ``seed`` is passed to policies that take one."""
    target = POLICIES.get(name, name)
    module_name, _, class_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"routing.policy: {name!r} is not available ({e})") from e
    params = inspect.signature(cls).parameters
    policy = cls(seed=seed) if "seed" in params else cls()
    if not isinstance(policy, RoutingPolicy):
        raise ConfigError(f"routing.policy: {target} does not implement RoutingPolicy")
    return policy
