"""SageMaker's serving contract on `ferry serve`, as vLLM serves it: ``/ping`` is the health check and
``POST /invocations`` serves any request, by the endpoint its body belongs to; both behind
``--api-key`` like the routes they stand for (``/classify`` too)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ferry.cli import sagemaker_args
from tests.server.conftest import REPO, free_port

KEY = {"Authorization": "Bearer s4ge"}


@pytest.fixture(scope="module")
def srv(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    server = server_process(tiny_llama, ["--api-key", "s4ge", "--num-kv-blocks", "256"], serve_logs).start()
    yield server
    server.stop()


def _post(srv, path: str, body: dict, headers: dict | None = KEY) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=headers or {}, timeout=60)


def test_ping_is_the_health_check(srv) -> None:
    for method in ("GET", "POST"):
        r = httpx.request(method, srv.url + "/ping")  # open, as /health is
        assert r.status_code == 200 and r.json()["status"] == "ok"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0},
        ),
        # A decoder serves chat, which vLLM tries first, ignoring the unknown `input`.
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "input": "a cat",
                "max_tokens": 5,
                "temperature": 0,
            },
        ),
        ("/v1/completions", {"prompt": [5, 9, 14], "max_tokens": 5, "temperature": 0}),
        ("/v1/embeddings", {"input": ["a cat", "a dog"]}),
        ("/rerank", {"query": "cat", "documents": ["a cat", "a car"]}),
        ("/score", {"text_1": "cat", "text_2": ["a cat", "a car"]}),
    ],
)
def test_invocations_answer_as_the_endpoint_of_the_body(srv, path: str, body: dict) -> None:
    direct = _post(srv, path, body)
    via = _post(srv, "/invocations", body)
    assert direct.status_code == via.status_code == 200, via.text
    a, b = direct.json(), via.json()
    for volatile in ("id", "created"):
        a.pop(volatile, None)
        b.pop(volatile, None)
    assert a == b


def test_a_streamed_invocation_streams(srv) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", srv.url + "/invocations", json=body, headers=KEY, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    assert text.startswith("data: ") and text.endswith("data: [DONE]\n\n")


def test_bad_invocations_are_the_endpoints_own_400s(srv) -> None:
    r = _post(srv, "/invocations", {"messages": [{"role": "user", "content": "hi"}], "temperature": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = _post(srv, "/invocations", {"nothing": 1})
    assert r.status_code == 400 and "Cannot tell which endpoint" in r.json()["error"]["message"]
    r = httpx.post(
        srv.url + "/invocations", content=b"[1]", headers={**KEY, "content-type": "application/json"}
    )
    assert r.status_code == 400


def test_api_key_guards_invocations_and_classify(srv) -> None:
    body = {"prompt": "x", "max_tokens": 2}
    assert _post(srv, "/invocations", body, headers=None).status_code == 401
    assert _post(srv, "/classify", {"input": "x"}, headers=None).status_code == 401
    assert _post(srv, "/invocations", body).status_code == 200


def test_sm_ferry_variables_become_serve_flags() -> None:
    env = {
        "SM_FERRY_MAX_MODEL_LEN": "4096",
        "SM_FERRY_ENABLE_LORA": "true",
        "SM_FERRY_API_KEY": "k",
        "HOME": "/",
    }
    assert sagemaker_args(env) == [
        "--host",
        "0.0.0.0",
        "--port",
        "8080",
        "--api-key",
        "k",
        "--enable-lora",
        "--max-model-len",
        "4096",
    ]
    assert sagemaker_args({"HOME": "/", "SM_FERRY_": "x"}) == []  # none set: nothing added


def test_a_container_configured_by_sm_ferry_variables_serves_sagemaker(
    tiny_llama: Path, tmp_path: Path
) -> None:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "SM_FERRY_MODEL": str(tiny_llama),
        "SM_FERRY_HOST": "127.0.0.1",
        "SM_FERRY_PORT": str(port),
        "SM_FERRY_NUM_KV_BLOCKS": "64",
        "SM_FERRY_NUM_THREADS": "1",
    }
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ferry", "serve"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            try:
                if httpx.get(url + "/ping", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = httpx.post(url + "/invocations", json={"prompt": [5, 9], "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == tiny_llama.name
    finally:
        proc.terminate()
        proc.wait(30)
