"""Routing policies: which replica gets a request. One file a policy, one line in ``registry.py``."""

from router.policies.base import Policy, RouteRequest
from router.policies.registry import POLICY_NAMES, make_policy

__all__ = ["Policy", "RouteRequest", "POLICY_NAMES", "make_policy"]
