"""`ferry serve` and `ferry router` refuse bad flags with one clear line and exit code 2, as argparse
does for its own errors: no traceback for an operator to read through."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def ferry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ferry", *args, "--port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-size", "0"], "--block-size must be positive"),
        (["--decode-penalty-tokens", "-1"], "--load-penalty-tokens and --decode-penalty-tokens must be >= 0"),
        (["--pd-threshold", "-1"], "--pd-threshold >= 0"),
        (["--model", "/nonexistent"], "/nonexistent has no tokenizer.json"),
        (["--replica", "http://[::1"], "replica URL 'http://[::1' is not valid: Invalid IPv6 URL"),
        (
            ["--max-request-bytes", "0"],
            "--max-request-bytes, --max-header-bytes and --max-file-bytes must be positive",
        ),
        (["--health-interval", "-1"], "--health-interval must be positive, got -1.0"),
        (["--header-timeout", "0"], "--header-timeout must be positive, got 0.0"),
        (["--replica-ca-certs", "/nonexistent.pem"], "--replica-ca-certs: no such file: /nonexistent.pem"),
    ],
)
def test_router_flag_errors(args: list[str], message: str) -> None:
    done = ferry("router", *args)
    assert done.returncode == 2
    assert done.stderr.startswith(f"ferry router: error: {message}")
    assert "Traceback" not in done.stderr


# Runs `ferry.cli.main` on each case in one process (the imports, torch's among them, are paid once),
# each case's stderr apart: what `python -m ferry serve ...` would print and its exit code.
_EACH_CASE = """
import contextlib, io, json, sys
from ferry.cli import main
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(["serve", *args, "--port", "0"])
        except SystemExit as e:
            code = e.code
    print(json.dumps([code, err.getvalue()]), flush=True)
"""


def test_serve_flag_and_model_errors(tiny_llama: Path) -> None:
    cases = [
        (["--model", str(tiny_llama), "--block-size", "0"], "block_size must be an integer >= 1, got 0"),
        (
            ["--model", str(tiny_llama), "--burst-wait-ms", "-1"],
            "burst_wait_ms must be a number of milliseconds in [0, 10000], got -1.0",
        ),
        (["--model", "/nonexistent"], "model path '/nonexistent' is not a directory"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["--responses-lease-ttl", "0.5"], "--responses-lease-ttl must be at least 1 second, got 0.5"),
        # `ferry serve MODEL` as `vllm serve MODEL`: the positional model is the model...
        (["/nonexistent/positional"], "model path '/nonexistent/positional' is not a directory"),
        # ... and it may not disagree with --model.
        ([str(tiny_llama), "--model", "/other"], "the model is given twice"),
        # vLLM's flags: one device per replica; TLS needs both files; CORS lists are JSON.
        (["-tp", "2"], "--tensor-parallel-size 2: a ferry replica runs on one device"),
        (["--ssl-keyfile", "/k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
        # Checked before the model loads, not found by uvicorn after it.
        (["--ssl-keyfile", "/k.pem", "--ssl-certfile", "/c.pem"], "--ssl-keyfile: no such file: /k.pem"),
        (["--allowed-origins", "*"], "argument --allowed-origins: expected a JSON list of strings"),
        # The engine refuses it once it has read the model's config.
        (
            ["--model", str(tiny_llama), "--max-model-len", "4096"],
            "max_model_len=4096 is more than the 1024 positions of the model (max_position_embeddings=1024)",
        ),
    ]
    done = subprocess.run(
        [sys.executable, "-c", _EACH_CASE, json.dumps([args for args, _ in cases])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == len(cases), done.stderr[-2000:]
    for (args, message), (code, stderr) in zip(cases, results, strict=True):
        assert code == 2, (args, stderr[-2000:])
        assert f"ferry serve: error: {message}" in stderr, (args, stderr[-2000:])
        assert "Traceback" not in stderr
    # The same through `python -m ferry` itself (exit code and stderr of the process).
    done = ferry("serve", "--model", "/nonexistent")
    assert (
        done.returncode == 2
        and "ferry serve: error: model path '/nonexistent' is not a directory" in done.stderr
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "99999"], "--port must be in 0..65535, got 99999"),
        (["--max-queued-requests", "-1"], "--max-queued-requests must be >= 0, got -1"),
        (["--request-timeout", "0"], "--request-timeout must be positive, got 0.0"),
        (["--max-request-bytes", "0"], "--max-request-bytes must be positive, got 0"),
        (["--drain-timeout", "-5"], "--drain-timeout must be >= 0, got -5.0"),
    ],
)
def test_serve_values_that_would_refuse_every_request(flags: list[str], message: str) -> None:
    # Each would start a server that answers everything 429, 408 or 413 (or listen elsewhere).
    from ferry.cli import build_parser
    from server.main import check_serve_args

    assert check_serve_args(build_parser().parse_args(["serve", *flags])) == message


def test_router_port_out_of_range() -> None:
    from router.config import RouterConfig

    with pytest.raises(ValueError, match="--port must be in 0..65535, got 99999"):
        RouterConfig(replicas=("http://127.0.0.1:9",), port=99999)


def test_serve_says_a_port_in_use_before_loading_the_model(tiny_llama: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "ferry", "serve", "--model", str(tiny_llama), "--port", str(port)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"ferry serve: error: cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "serving" not in done.stderr  # the engine was never built
