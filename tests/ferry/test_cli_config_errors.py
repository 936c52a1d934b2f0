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


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (
            "router: {port: 18080}\nmixed: {}\nrouter: {port: 18081}\n",
            "line 3, column 1: duplicate key 'router' (first given on line 1)",
        ),
        (
            "mixed: {replicas: 1, replicas: 2}\n",
            "line 1, column 22: duplicate key 'replicas' (first given on line 1)",
        ),
        (
            "mixed:\n  threads: 1\n  env: {A: x}\n  threads: 2\n",
            "line 4, column 3: duplicate key 'threads' (first given on line 2)",
        ),
    ],
)
def test_a_key_given_twice_is_refused_not_silently_the_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, where: str
) -> None:
    """PyYAML keeps the last of two equal keys: the file would run with half of what it says."""
    config = tmp_path / "cluster.yaml"
    config.write_text(text)
    assert main(["up", "--config", str(config), "--dry-run"]) == 2
    assert capsys.readouterr().err == f"ferry up: {config}: not valid YAML: {where}\n"


def test_merge_keys_still_override_what_they_merge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text(
        "kv_tier: redis://127.0.0.1:6399/0\nmixed: &pool {replicas: 1, threads: 3, port: 18100}\n"
        "prefill: {<<: *pool, port: 18200}\ndecode: {<<: *pool, port: 18300}\n"
    )
    assert main(["up", "--config", str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for port in (18100, 18200, 18300):
        assert f"--port {port} " in out
    assert out.count("--num-threads 3 ") == 3


def test_serve_config_file_with_a_key_given_twice_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "serve.yaml"
    # The second value alone would be refused too, so nothing starts even where the first is read.
    config.write_text("max-num-seqs: 4\nport: 8001\nmax-num-seqs: lots\n")
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--config", str(config)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"ferry serve --config {config}: not valid YAML (duplicate key 'max-num-seqs' (first given on line 1)"
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


def test_a_toml_file_is_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """TOML parses as a YAML string (or a YAML error about '<document start>'): say what it is."""
    cluster = tmp_path / "cluster.toml"
    cluster.write_text('model = "/models/llama"\n[router]\nport = 8080\n')
    assert main(["up", "--config", str(cluster), "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        f"ferry up: {cluster}: a TOML file: ferry reads YAML (JSON is YAML too); see deploy/local/cluster.yaml\n"
    )
    serve = tmp_path / "serve.toml"
    serve.write_text("port = 8001\n")
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--config", str(serve)])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        f"ferry serve --config {serve}: a TOML file: ferry reads YAML (JSON is YAML too)\n"
    )


def test_a_json_cluster_file_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = tmp_path / "cluster.json"
    cluster.write_text(
        '{"kv_tier": "memory://", "router": {"port": 18123}, "mixed": {"replicas": 2, "threads": 1}}'
    )
    assert main(["up", "--config", str(cluster), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count(" --role mixed --num-threads 1 ") == 2
    assert out.endswith("# endpoint: http://127.0.0.1:18123/v1\n")
