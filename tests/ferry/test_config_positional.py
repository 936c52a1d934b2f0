"""`ferry serve MODEL --config FILE`: a file whose last flag takes several values (``served-model-name:
[a, b]``) must not take the positional MODEL as one more value (the demo model was served instead)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ferry.cli import build_parser
from ferry.config_file import expand_config
from server.args import add_serve_args
from server.main import check_serve_args

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("entry", "dest", "value"),
    [
        ("served-model-name: [a, b]", "served_model_name", ["a", "b"]),
        ("served-model-name: a", "served_model_name", ["a"]),
        (
            "allowed-media-domains: [x.example, y.example]",
            "allowed_media_domains",
            ["x.example", "y.example"],
        ),
    ],
)
def test_a_files_last_multi_value_flag_leaves_the_positional_model(
    tmp_path: Path, entry: str, dest: str, value: list[str]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"port: 8001\n{entry}\n")
    argv = expand_config("serve", ["/models/b", "--config", str(path), "--max-num-seqs", "3"], add_serve_args)
    args = build_parser().parse_args(["serve", *argv])
    assert check_serve_args(args) is None
    assert args.model == "/models/b" and getattr(args, dest) == value
    assert (args.port, args.max_num_seqs) == (8001, 3)


def test_serve_model_with_a_config_file_ending_in_a_list_serves_that_model(
    tiny_llama: Path, tmp_path: Path
) -> None:
    port = free_port()
    config = tmp_path / "c.yaml"
    config.write_text(f"port: {port}\nnum-threads: 1\nserved-model-name: [a, b]\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ferry", "serve", str(tiny_llama), "--config", str(config)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "ferry serve did not become healthy"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        cards = httpx.get(url + "/v1/models", timeout=5).json()["data"]
        assert [c["id"] for c in cards] == ["a", "b"]
        assert {c["root"] for c in cards} == {str(tiny_llama)}  # not the built-in demo model
    finally:
        proc.terminate()
        proc.wait(30)
