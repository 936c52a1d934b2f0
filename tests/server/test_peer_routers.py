"""ferry replicas behind the routers users already run: vllm-router and sglang-router (Rust, PyPI).

Each router round-robins over two `ferry serve` replicas; chat requests through it succeed and
both replicas serve some. These routers add their own fields to requests (``ignore_eos``,
``separate_reasoning``, ``max_completion_tokens`` instead of ``max_tokens`` …), which the replica
must accept.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

ROUTERS = {
    "vllm-router": lambda port, prom, urls: [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *urls,
        "--policy",
        "round_robin",
        "--prometheus-port",
        str(prom),
    ],
    "sglang-router": lambda port, prom, urls: [
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *urls,
        "--policy",
        "round_robin",
        "--prometheus-port",
        str(prom),
    ],
}


@pytest.fixture(scope="module")
def replicas(tiny_llama: Path, serve_logs: Path, server_process):
    started = []
    try:
        for _ in range(2):
            started.append(server_process(tiny_llama, ["--max-num-seqs", "8"], serve_logs).start())
        yield started
    finally:
        for srv in started:
            srv.stop()


def _router_binary(name: str) -> str:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(path).exists():
        pytest.skip(f"{name} is not installed (pip install vllm-router sglang-router: test extras)")
    return path


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_chat_through_peer_router(router: str, replicas, scrape, serve_logs: Path, free_tcp_port) -> None:
    binary = _router_binary(router)
    port, prom = free_tcp_port(), free_tcp_port()
    log = open(serve_logs / f"{router}-{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [binary, *ROUTERS[router](port, prom, [r.url for r in replicas])],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, (serve_logs / f"{router}-{port}.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            raise AssertionError(f"{router} never became healthy")
        name = replicas[0].model_name
        before = [
            scrape(r.url, "vllm:e2e_request_latency_seconds_count", model_name=name) or 0 for r in replicas
        ]
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        texts = set()
        for _ in range(4):
            resp = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
            )
            assert resp.choices[0].message.content is not None
            texts.add(resp.choices[0].message.content)
        stream = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert texts == {streamed}  # same greedy answer from either replica
        after = [
            scrape(r.url, "vllm:e2e_request_latency_seconds_count", model_name=name) or 0 for r in replicas
        ]
        served = [a - b for a, b in zip(after, before, strict=True)]
        assert sum(served) == 5 and all(s >= 2 for s in served), served  # round robin over both
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
