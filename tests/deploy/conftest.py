"""Fixtures for the deploy/ tests: rendered Kubernetes overlays, a replica on loopback."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from deploy_support import K8S, MODEL, OVERLAYS, FerryProcess, kubectl

from tests.conftest import RedisServer


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


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The deploy tests' own redis-server (over the session one): their replica lives for the rest of
    its worker's session, KV events on, and an idle replica re-publishes its blocks after a flush, so
    in the shared server it would write into every later test's freshly flushed database."""
    srv = RedisServer(tmp_path_factory.mktemp("deploy-redis"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def deploy_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deploy-logs")


@pytest.fixture(scope="session")
def replica(tiny_llama: Path, redis_server, deploy_logs: Path) -> Iterator[FerryProcess]:  # noqa: ANN001
    """One `ferry serve` for the session: tiny Llama served as "tiny", KV tier in the private Redis,
    KV block events on, advertised under its URL (as the Kubernetes manifests run replicas)."""
    redis_server.flush()
    args = ["--model", str(tiny_llama), "--served-model-name", MODEL, "--num-threads", "1", "--num-kv-blocks", "256",
            "--max-num-seqs", "8", "--kv-tier", redis_server.url, "--drain-timeout", "5", "--kv-events"]  # fmt: skip
    proc = FerryProcess("serve", args, deploy_logs)
    proc.args += ["--advertise-url", proc.url]
    proc.start()
    yield proc
    proc.stop()
