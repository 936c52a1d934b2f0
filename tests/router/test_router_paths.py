"""`ferry router --root-path` (behind a proxy that adds a path prefix) and `--uds` (a Unix socket),
as `ferry serve` takes them: routes, relays and the API key work with or without the prefix."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from router_harness import REPO, Cluster, Proc, wait_until

BODY = {"prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def replica(cluster: Cluster) -> Proc:
    (one,) = cluster.replicas(1)
    return one


def test_root_path_routes_relays_and_guards_with_or_without_the_prefix(cluster: Cluster, replica) -> None:
    a = replica
    router = cluster.router("--replica", a.url, "--root-path", "/api", "--api-key", "k")
    key = {"Authorization": "Bearer k"}
    assert wait_until(lambda: httpx.get(router.url + "/api/health").status_code == 200, 60)
    assert httpx.get(router.url + "/health").status_code == 200
    for prefix in ("/api", ""):
        r = httpx.post(router.url + prefix + "/v1/completions", json=BODY, headers=key, timeout=60)
        assert r.status_code == 200, r.text  # relayed without the prefix: the replica knows none
        denied = httpx.post(router.url + prefix + "/v1/completions", json=BODY, timeout=60)
        assert denied.status_code == 401  # the prefix never skips the key
    assert httpx.get(router.url + "/api/v1/models", headers=key).json()["data"]


def test_a_router_on_a_unix_socket(replica, tmp_path: Path) -> None:
    a = replica
    sock = tmp_path / "router.sock"
    log = open(tmp_path / "router.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ferry",
            "router",
            "--replica",
            a.url,
            "--uds",
            str(sock),
            "--health-interval",
            "0.2",
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        client = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://router", timeout=60
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = client.post("/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
