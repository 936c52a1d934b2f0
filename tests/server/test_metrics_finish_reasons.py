"""``vllm:request_success_total`` has a series per finish reason from the start, as vLLM's."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai

from tests.server.conftest import ServerProcess, metric_value


def test_every_finish_reason_is_exposed_at_zero_until_it_happens(tiny_llama: Path, serve_logs: Path) -> None:
    srv = ServerProcess(tiny_llama, ["--num-kv-blocks", "64"], serve_logs).start()
    try:
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        for reason in ("stop", "length", "abort"):
            value = metric_value(
                text, "vllm:request_success_total", finished_reason=reason, model_name=srv.model_name
            )
            assert value == 0.0, (reason, value)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        client.completions.create(model=srv.model_name, prompt="hello", max_tokens=3, temperature=0)
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        assert metric_value(text, "vllm:request_success_total", finished_reason="length") == 1.0
        assert metric_value(text, "vllm:request_success_total", finished_reason="stop") == 0.0
        assert metric_value(text, "vllm:request_success_total", finished_reason="abort") == 0.0
    finally:
        srv.stop()
