"""`vllm serve` flags about the model and the API server, on real `ferry serve` processes:
``--tokenizer`` (a model directory without tokenizer files), ``--hf-overrides``, ``--load-format
dummy``, ``--quantization``, ``--root-path``, ``--disable-fastapi-docs``, ``--uds``,
``--return-tokens-as-token-ids`` and ``--enable-force-include-usage``; several API server
processes (``--api-server-count 2``) behind one engine where a flag concerns them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from subprocess import PIPE

import httpx
import pytest

from tests.engine.test_vllm_model_options import split_checkpoint

REPO = Path(__file__).resolve().parents[2]
CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def split_server(tiny_llama: Path, tmp_path_factory, serve_logs: Path, server_process) -> Iterator:
    """Two API server processes on one Unix socket over a model directory without tokenizer files,
    the tokenizer read from a copy that has them; a context shrunk by --hf-overrides."""
    root = tmp_path_factory.mktemp("split")
    model, tokenizer = split_checkpoint(tiny_llama, root)
    sock = root / "ferry.sock"
    flags = [
        "--tokenizer", str(tokenizer), "--hf-overrides", '{"max_position_embeddings": 64}',
        "--return-tokens-as-token-ids", "--enable-force-include-usage", "--disable-fastapi-docs",
        "--uds", str(sock), "--api-server-count", "2", "--served-model-name", "split",
    ]  # fmt: skip
    srv = server_process(model, flags, serve_logs).start(uds=sock)
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://ferry", timeout=60) as c:
        yield c
    srv.stop()


def _greedy_chat(client: httpx.Client, base: str, model: str) -> dict:
    body = {"model": model, "messages": CHAT, "max_tokens": 8, "temperature": 0, "logprobs": True}
    r = client.post(base + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenizer_from_another_directory_serves_as_the_whole_checkpoint(split_server, server) -> None:
    with httpx.Client(timeout=60) as plain:
        # The shared server's prefix cache holds what earlier tests sent: start it empty, as the
        # split server's is, so that both report the same cached tokens.
        assert plain.post(server.url + "/reset_prefix_cache").status_code == 200
        whole = _greedy_chat(plain, server.url, server.model_name)
        whole_ids = plain.post(server.url + "/tokenize", json={"messages": CHAT}).json()["tokens"]
    split = _greedy_chat(split_server, "", "split")
    assert split["choices"][0]["message"]["content"] == whole["choices"][0]["message"]["content"]
    assert split["usage"] == whole["usage"]
    assert split_server.post("/tokenize", json={"messages": CHAT}).json()["tokens"] == whole_ids
    text = split_server.post("/detokenize", json={"tokens": whole_ids}).json()["prompt"]
    # The other directory's special tokens, kept as vLLM's /detokenize keeps them.
    assert text == "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    # --return-tokens-as-token-ids: the whole directory's tokens, written as their ids.
    tokens = [e["token"] for e in split["choices"][0]["logprobs"]["content"]]
    ids = [plain_id(e["token"]) for e in split["choices"][0]["logprobs"]["content"]]
    assert tokens == [f"token_id:{i}" for i in ids] and len(ids) == split["usage"]["completion_tokens"]
    decoded = split_server.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert decoded == whole["choices"][0]["message"]["content"]
    assert not any(e["token"].startswith("token_id:") for e in whole["choices"][0]["logprobs"]["content"])


def plain_id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.removeprefix("token_id:"))


def test_server_defaults_for_requests_that_leave_them_unset(split_server) -> None:
    body = {"model": "split", "prompt": "the quick brown", "max_tokens": 3, "temperature": 0, "logprobs": 1}
    for _ in range(4):  # both API server processes answer (connections spread over the socket)
        ids = split_server.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
        assert all(t.startswith("token_id:") for t in ids) and len(ids) == 3
    own = split_server.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()
    assert not any(t.startswith("token_id:") for t in own["choices"][0]["logprobs"]["tokens"])
    # --enable-force-include-usage: a stream that asked for no usage ends with it anyway.
    with split_server.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert all(e.get("usage") is None for e in events[:-1])  # continuous usage stays the request's
    chat = {"model": "split", "messages": CHAT, "max_tokens": 2, "stream": True}
    with split_server.stream("POST", "/v1/chat/completions", json=chat) as r:
        last = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")][-1]
    assert last["usage"]["completion_tokens"] == 2


def test_hf_overrides_shrink_the_context_and_docs_are_off(split_server) -> None:
    body = {"model": "split", "prompt": "word " * 80, "max_tokens": 1}
    r = split_server.post("/v1/completions", json=body)
    assert r.status_code == 400 and "maximum context length is 64 tokens" in r.json()["error"]["message"]
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert split_server.get(path).status_code == 404
    assert split_server.get("/health").status_code == 200


@pytest.fixture(scope="module")
def dummy_server(tiny_llama: Path, tmp_path_factory, serve_logs: Path, server_process) -> Iterator:
    """A directory with config and tokenizer but no weights (--load-format dummy), behind a proxy
    that adds /api (--root-path), with an API key."""
    bare = tmp_path_factory.mktemp("dummy") / "bare"
    shutil.copytree(tiny_llama, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    flags = ["--load-format", "dummy", "--root-path", "/api", "--api-key", "k"]
    srv = server_process(bare, flags, serve_logs).start()
    yield srv
    srv.stop()


def test_dummy_weights_serve_a_directory_without_weights(dummy_server) -> None:
    key = {"Authorization": "Bearer k"}
    body = {"model": "bare", "prompt": "hello", "max_tokens": 4, "temperature": 0}
    for base in (dummy_server.url, dummy_server.url + "/api"):  # prefix stripped by the proxy, or not
        r = httpx.post(base + "/v1/completions", json=body, headers=key, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # The API key guards the prefixed paths as the bare ones.
        assert httpx.post(base + "/v1/completions", json=body, timeout=30).status_code == 401
        assert httpx.get(base + "/v1/models", timeout=30).status_code == 401
        assert httpx.get(base + "/v1/models", headers=key, timeout=30).json()["data"][0]["id"] == "bare"
    spec = httpx.get(dummy_server.url + "/openapi.json", timeout=30).json()
    assert spec["servers"] == [{"url": "/api"}]
    assert "/api/openapi.json" in httpx.get(dummy_server.url + "/docs", timeout=30).text
    # No warning at start: FastAPI's root_path parameter is deprecated, so the app is not given it.
    assert "deprecated" not in dummy_server.log_path.read_text()


def test_bad_values_stop_the_start_with_one_line(tiny_llama: Path, capsys) -> None:
    from ferry.cli import main

    refused_by_flags = {
        ("--hf-overrides", "max_position_embeddings=64"): "hf_overrides is not valid JSON",
        ("--hf-overrides", "[64]"): "hf_overrides must be a JSON object, got list",
        ("--tokenizer-mode", "slow"): "tokenizer_mode 'slow' is not supported",
        ("--load-format", "pt"): "load_format 'pt' is not supported",
        ("--root-path", "api/"): "--root-path must start with /",
    }
    for flags, message in refused_by_flags.items():  # before any model is read: in this process
        assert main(["serve", "--model", str(tiny_llama), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ferry serve: error: ") and message in err and err.count("\n") == 1, err
    # Refused once the checkpoint's config is read: the real command line.
    refused_by_checkpoint = {
        "awq": "--quantization awq: the checkpoint is not quantized",
        "fp8": "--quantization fp8 on an unquantized checkpoint asks for vLLM's online fp8",
    }
    cmd = [sys.executable, "-m", "ferry", "serve", "--model", str(tiny_llama), "--port", "0", "-q"]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    procs = {
        method: subprocess.Popen([*cmd, method], cwd=REPO, env=env, stdout=PIPE, stderr=PIPE, text=True)
        for method in refused_by_checkpoint
    }
    for method, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and "Traceback" not in err, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("ferry serve: error: ") and refused_by_checkpoint[method] in last, err
