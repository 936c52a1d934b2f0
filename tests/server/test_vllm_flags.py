"""`vllm serve` command lines run as `ferry serve` ones: CORS as vLLM answers browsers (any origin by
default, a list when given, preflight before the API key), HTTPS from --ssl-keyfile/--ssl-certfile,
and vLLM's flags for what ferry does anyway accepted with a log line saying so."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import self_signed_certificate

PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}


def test_any_origin_by_default(server) -> None:
    url = server.url + "/v1/chat/completions"
    pre = httpx.options(url, headers={"Origin": "http://ui.example", **PREFLIGHT})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    body = {"model": server.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = httpx.post(url, json=body, headers={"Origin": "http://ui.example"}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-origin" not in httpx.get(server.url + "/health").headers  # no Origin


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_server(tiny_llama: Path, serve_logs: Path, server_process, certificate) -> Iterator:
    key, cert = certificate
    flags = [
        "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--api-key", "k",
        "--allowed-origins", '["http://ui.example"]', "--allow-credentials",
        # vLLM flags for what ferry does anyway: accepted, each logged.
        "--enforce-eager", "--swap-space", "4", "--tensor-parallel-size", "1",
        "--enable-log-requests", "--max-log-len", "5",  # vLLM's request log, prompts cut to 5
        "--api-server-count", "2",  # every API server process serves TLS on the one port
    ]  # fmt: skip
    srv = server_process(tiny_llama, flags, serve_logs).start(tls_cert=cert)
    yield srv, cert
    srv.stop()


def _trust(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


def test_https_with_the_api_key_and_listed_origins(tls_server) -> None:
    srv, cert = tls_server
    base = "https://" + srv.url.removeprefix("http://")
    with pytest.raises(httpx.HTTPError):  # plain HTTP gets no answer from a TLS socket
        httpx.get(srv.url + "/health", timeout=5)
    client = openai.OpenAI(
        base_url=base + "/v1",
        api_key="k",
        max_retries=0,
        timeout=60,
        http_client=httpx.Client(verify=_trust(cert)),
    )
    answer = client.completions.create(model=srv.model_name, prompt="hello world", max_tokens=2)
    assert answer.usage.completion_tokens == 2
    chat = client.chat.completions.create(
        model=srv.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert chat.usage.completion_tokens == 1
    with httpx.Client(verify=_trust(cert), timeout=30) as c:
        url = base + "/v1/completions"
        pre = c.options(url, headers={"Origin": "http://ui.example", **PREFLIGHT})  # before any key
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "http://ui.example"
        assert pre.headers["access-control-allow-credentials"] == "true"
        other = c.options(url, headers={"Origin": "http://elsewhere.example", **PREFLIGHT})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        assert c.post(url, json={"prompt": "hi", "max_tokens": 1}).status_code == 401
        generate = {"token_ids": [5, 6, 7, 8, 9, 10, 11], "sampling_params": {"max_tokens": 3}}
        answer = c.post(base + "/inference/v1/generate", json=generate, headers={"Authorization": "Bearer k"})
        assert answer.status_code == 200, answer.text
    log = srv.log()
    assert "--enforce-eager is accepted for vLLM compatibility and changes nothing" in log
    assert "--swap-space is accepted for vLLM compatibility" in log
    # The request log line: its id, the model, the prompt cut to --max-log-len, the parameters.
    line = next(x for x in log.splitlines() if "Received request" in x)
    assert f"model: {srv.model_name}, prompt: 'hello', params: SamplingParams(" in line
    assert "max_tokens=2" in line
    lines = [x for x in log.splitlines() if "Received request" in x]
    assert len(lines) == 3 and "max_tokens=1" in lines[1]  # the chat's, its rendered prompt cut too
    # /inference/v1/generate's, its token ids cut to 5 as vLLM's.
    assert "prompt: [5, 6, 7, 8, 9], params: SamplingParams(" in lines[2] and "max_tokens=3" in lines[2]


def test_the_router_reaches_https_replicas(tls_server, serve_logs: Path, free_tcp_port) -> None:
    """`ferry router --replica https://… --replica-ca-certs CA`: probes, model lists and relayed
    requests go over TLS, the certificate checked; without the CA the replica is never trusted."""
    srv, cert = tls_server
    replica = "https://" + srv.url.removeprefix("http://")
    routers = []
    try:
        for extra in (["--replica-ca-certs", str(cert)], []):
            port = free_tcp_port()
            cmd = [sys.executable, "-m", "ferry", "router", "--port", str(port), "--replica", replica]
            cmd += ["--policy", "round_robin", "--replica-api-key", "k", "--health-interval", "0.2", *extra]
            log = open(serve_logs / f"router-{port}.log", "w")  # noqa: SIM115 - closed below
            routers.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log, port))
        (_, _, trusted), (_, _, untrusted) = routers
        url = f"http://127.0.0.1:{trusted}"
        deadline = time.monotonic() + 60
        while not _get(url + "/health") == 200:
            assert time.monotonic() < deadline, "the router never found its https replica healthy"
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] == srv.model_name
        body = {"model": srv.model_name, "prompt": "hi", "max_tokens": 2}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
        # The router without the CA: the replica's certificate is not trusted, so it never serves.
        while (status := _get(f"http://127.0.0.1:{untrusted}/health")) is None:
            assert time.monotonic() < deadline + 30, "the second router never started"
            time.sleep(0.2)
        assert status == 503
    finally:
        for proc, log, _ in routers:
            proc.terminate()
            proc.wait(15)
            log.close()


def _get(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None
