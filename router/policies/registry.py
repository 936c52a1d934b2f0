"""Policy registry: name -> class. Adding a policy is a new file and one line here."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.policies.base import Policy

_POLICIES: dict[str, str] = {
    "round_robin": "router.policies.round_robin:RoundRobin",
    "least_load": "router.policies.least_load:LeastLoad",
    "power_of_two": "router.policies.power_of_two:PowerOfTwo",
    "session": "router.policies.session:Session",
    "cache_aware": "router.policies.cache_aware:CacheAware",
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)


def make_policy(name: str, **options: Any) -> Policy:
    """Build policy ``name``; ``options`` are the policy class's keyword arguments."""
    if name not in _POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    module_name, class_name = _POLICIES[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**options)
