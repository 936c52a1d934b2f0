"""Fixtures for the deploy/ tests: rendered Kubernetes overlays, and ferry processes on loopback."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip(
            "kubectl is not installed: cannot render the kustomize overlays (install kubectl to run this)"
        )
    return path


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    """Every overlay rendered by `kubectl kustomize`, as lists of parsed objects."""
    binary = kubectl()
    out: dict[str, list[dict]] = {}
    for name in OVERLAYS:
        proc = subprocess.run(
            [binary, "kustomize", str(K8S / "overlays" / name)], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, f"overlay {name} does not render:\n{proc.stderr}"
        out[name] = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    return out
