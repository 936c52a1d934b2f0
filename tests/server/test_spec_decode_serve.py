"""`ferry serve --speculative-config`: streams and answers carry the tokens a replica without drafts
gives, several per step when drafts are accepted, and /metrics counts drafts under vLLM's names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.server.conftest import ServerProcess, metric_value
from tests.server.test_api_servers import _serve

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
LOOP = [7, 8, 9, 10, 11] * 12


def start_spec_server(
    server_process: type[ServerProcess], model: Path, logs: Path, spec: dict
) -> ServerProcess:
    """A deterministic replica of ``model`` serving with ``--speculative-config spec``."""
    flags = ["--speculative-config", json.dumps(spec), "--deterministic", "--num-kv-blocks", "256"]
    return server_process(model, flags, logs).start()


@pytest.fixture(scope="module")
def spec_server(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    srv = start_spec_server(server_process, tiny_llama, serve_logs, SPEC)
    yield srv
    srv.stop()


def test_answers_equal_decoding_without_drafts(spec_server, tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), num_kv_blocks=64, deterministic=True, num_threads=1)
    want = llm.generate([LOOP], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    body = {"ignore_eos": True, "return_token_ids": True}
    whole = client.completions.create(
        model=spec_server.model_name, prompt=LOOP, max_tokens=40, temperature=0, extra_body=body
    )
    assert whole.choices[0].token_ids == want.token_ids and whole.choices[0].text == want.text
    chunks = list(
        client.completions.create(
            model=spec_server.model_name,
            prompt=LOOP,
            max_tokens=40,
            temperature=0,
            stream=True,
            extra_body=body,
        )
    )
    ids = [t for c in chunks for t in (c.choices[0].token_ids or [])]
    assert ids == want.token_ids
    assert "".join(c.choices[0].text for c in chunks) == want.text
    text = httpx.get(spec_server.url + "/metrics").text
    name = spec_server.model_name
    accepted = metric_value(text, "vllm:spec_decode_num_accepted_tokens_total", model_name=name)
    drafts = metric_value(text, "vllm:spec_decode_num_draft_tokens_total", model_name=name)
    first = metric_value(
        text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name=name, position="0"
    )
    assert accepted and drafts and first
    assert 0 < accepted <= drafts and first <= accepted
    # Several tokens arrived in one chunk: fewer chunks than tokens.
    assert len([c for c in chunks if c.choices and c.choices[0].token_ids]) < 40


def test_a_bad_speculative_config_is_a_clean_startup_error(tiny_llama: Path) -> None:
    done = _serve(
        [
            "--model",
            str(tiny_llama),
            "--speculative-config",
            '{"method": "eagle", "num_speculative_tokens": 2}',
        ]
    )
    assert done.returncode == 2 and "'eagle' is not supported" in done.stderr
