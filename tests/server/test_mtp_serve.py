"""`ferry serve --speculative-config '{"method": "deepseek_mtp", ...}'`: the MTP layer drafts behind the
OpenAI API; answers equal decoding without drafts, and with a layer that predicts the target
exactly (tests/engine/test_mtp.py) /metrics counts every draft accepted; a model without an MTP
layer is a clean startup error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.engine.test_mtp import build_echo_mtp
from tests.server.conftest import metric_value
from tests.server.test_api_servers import _serve
from tests.server.test_spec_decode_serve import start_spec_server

PROMPT = list(range(20, 60))
SPEC = {"method": "deepseek_mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def echo_model(tiny_deepseek: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_echo_mtp(tmp_path_factory.mktemp("mtp") / "echo", tiny_deepseek)


@pytest.fixture(scope="module")
def mtp_server(echo_model: Path, serve_logs: Path, server_process) -> Iterator:
    srv = start_spec_server(server_process, echo_model, serve_logs, SPEC)
    yield srv
    srv.stop()


def test_answers_equal_decoding_without_drafts(mtp_server, echo_model: Path) -> None:
    llm = LLM(str(echo_model), num_kv_blocks=64, deterministic=True, num_threads=1)
    want = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    want = want.outputs[0]
    client = openai.OpenAI(base_url=mtp_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    body = {"ignore_eos": True, "return_token_ids": True}
    kwargs = {"model": mtp_server.model_name, "prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    whole = client.completions.create(**kwargs, extra_body=body)
    assert whole.choices[0].token_ids == want.token_ids and whole.choices[0].text == want.text
    # 7 steps of 3 drafts, every one accepted.
    text = httpx.get(mtp_server.url + "/metrics").text
    name = mtp_server.model_name
    assert metric_value(text, "vllm:spec_decode_num_drafts_total", model_name=name) == 7
    assert metric_value(text, "vllm:spec_decode_num_draft_tokens_total", model_name=name) == 21
    assert metric_value(text, "vllm:spec_decode_num_accepted_tokens_total", model_name=name) == 21


def test_a_model_without_an_mtp_layer_is_a_clean_startup_error(tiny_deepseek: Path) -> None:
    done = _serve(["--model", str(tiny_deepseek), "--speculative-config", json.dumps(SPEC)])
    assert done.returncode == 2, done.stderr
    assert "has no multi-token-prediction layer" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
