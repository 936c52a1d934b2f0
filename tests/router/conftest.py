"""Fixtures for router tests (helpers live in ``router_harness.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from router_harness import Cluster


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tiny_llama, tmp_path_factory.mktemp("cluster"))
    yield c
    c.close()
