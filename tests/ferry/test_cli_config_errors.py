"""A user's mistakes on `ferry up` and `ferry router` are one clear line and a non-zero exit, never a
traceback or another tool's log line: a cluster file that is not UTF-8 or not YAML, a router host
that does not resolve, a router port already taken."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ferry.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_cluster_file_that_is_not_utf8_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = tmp_path / "cluster.yaml"
    binary.write_bytes(b"\xff\xfe\x00router: {}\n")
    assert main(["up", "--config", str(binary), "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        f"ferry up: {binary}: cannot read {binary}: not UTF-8 text (byte 0: invalid start byte)\n"
    )


def test_invalid_yaml_is_said_on_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "cluster.yaml"
    broken.write_text("router: {port: 8080\n")
    assert main(["up", "--config", str(broken), "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        f"ferry up: {broken}: not valid YAML: line 2, column 1: expected ',' or '}}', but got"
        " '<stream end>' (while parsing a flow mapping)\n"
    )


def test_router_host_that_does_not_resolve_is_not_called_a_port_in_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text("kv_tier: memory://\nmixed: {}\nrouter: {host: no-such-host.invalid, port: 18080}\n")
    assert main(["up", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ferry up: router.host: cannot listen on 'no-such-host.invalid': "), err
    assert "already in use" not in err and err.count("\n") == 1


@pytest.mark.parametrize("host", ["127.0.0.1", "no-such-host.invalid"])
def test_router_that_cannot_listen_says_so_and_exits_2(host: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "ferry", "router", "--host", host, "--port", str(port)]
            + ["--replica", "http://127.0.0.1:9"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"ferry router: error: cannot listen on {host}:{port}: "), done.stderr
    if host == "127.0.0.1":
        assert done.stderr == f"ferry router: error: cannot listen on {host}:{port}: Address already in use\n"
