"""Fixtures for the KV tier tests: Prometheus sample readings."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY


def _metric(name: str, **labels: str) -> float:
    total = 0.0
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


@pytest.fixture
def metric() -> Callable[..., float]:
    """``metric(name, **labels)``: current value of a sample on the default registry, summed over
    the labels not given (0 if unset)."""
    return _metric
