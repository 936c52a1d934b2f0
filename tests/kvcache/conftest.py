"""Fixtures for the KV tier tests: Prometheus sample readings."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY


def _metric(name: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


@pytest.fixture
def metric() -> Callable[..., float]:
    """``metric(name, **labels)``: current value of one sample on the default registry (0 if unset)."""
    return _metric
