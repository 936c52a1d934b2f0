"""`ferry serve` gives requests the model's default sampling values (its generation_config.json),
as vLLM does: fields a request leaves unset take them, ``max_new_tokens`` caps every budget, and
``--generation-config vllm`` / ``--override-generation-config`` change them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine import LLM, SamplingParams

QWEN = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 12}
PROMPT = [5, 9, 14, 3, 22, 7, 41, 8]


@pytest.fixture(scope="module")
def qwen_like(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama whose generation_config.json carries Qwen's recommended sampling values."""
    model = tmp_path_factory.mktemp("gen") / "qwen-like"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, **QWEN}))
    return model


@pytest.fixture(scope="module")
def defaults_server(qwen_like: Path, serve_logs: Path, server_process) -> Iterator:
    srv = server_process(qwen_like, ["--deterministic", "--num-kv-blocks", "128"], serve_logs).start()
    yield srv
    srv.stop()


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _offline(model: Path, **params) -> list[int]:
    with LLM(str(model), num_kv_blocks=32, deterministic=True, num_threads=1) as llm:
        out = llm.generate([PROMPT], SamplingParams(seed=3, ignore_eos=True, **params))[0].outputs[0]
    return out.token_ids


def test_unset_fields_take_the_models_values(defaults_server, qwen_like: Path) -> None:
    client = _client(defaults_server)
    body = {"ignore_eos": True, "return_token_ids": True}
    got = client.completions.create(
        model=defaults_server.model_name, prompt=PROMPT, max_tokens=8, seed=3, extra_body=body
    )
    model_values = {k: v for k, v in QWEN.items() if k != "max_new_tokens"}
    assert got.choices[0].token_ids == _offline(qwen_like, max_tokens=8, **model_values)
    neutral = client.completions.create(
        model=defaults_server.model_name,
        prompt=PROMPT,
        max_tokens=8,
        seed=3,
        temperature=1.0,
        top_p=1.0,
        extra_body={**body, "top_k": -1, "repetition_penalty": 1.0},
    )
    assert neutral.choices[0].token_ids == _offline(qwen_like, max_tokens=8)
    assert neutral.choices[0].token_ids != got.choices[0].token_ids


def test_max_new_tokens_caps_every_budget(defaults_server) -> None:
    client = _client(defaults_server)
    name = defaults_server.model_name
    for max_tokens in (None, 40):
        chat = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert chat.usage.completion_tokens == 12 and chat.choices[0].finish_reason == "length"
        text = client.completions.create(
            model=name, prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
        )
        # Without max_tokens a completion's budget is 16 (OpenAI's default), capped to 12 here.
        assert text.usage.completion_tokens == 12
    small = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert small.usage.completion_tokens == 5


def test_responses_report_the_values_used(defaults_server) -> None:
    body = {"model": defaults_server.model_name, "input": "hi", "max_output_tokens": 4, "store": False}
    answer = httpx.post(defaults_server.url + "/v1/responses", json=body, timeout=60).json()
    assert (answer["temperature"], answer["top_p"]) == (0.7, 0.8)
    asked = httpx.post(defaults_server.url + "/v1/responses", json={**body, "temperature": 0.1}, timeout=60)
    assert asked.json()["temperature"] == 0.1


def test_vllm_source_with_overrides(qwen_like: Path, serve_logs: Path, server_process) -> None:
    flags = ["--generation-config", "vllm", "--override-generation-config", '{"max_new_tokens": 3}']
    srv = server_process(qwen_like, [*flags, "--deterministic", "--num-kv-blocks", "64"], serve_logs).start()
    try:
        client = _client(srv)
        got = client.completions.create(
            model=srv.model_name,
            prompt=PROMPT,
            max_tokens=8,
            seed=3,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        # Neutral sampling (the model's values are ignored) and a budget of 3.
        assert got.choices[0].token_ids == _offline(qwen_like, max_tokens=8)[:3]
        assert got.choices[0].finish_reason == "length"
    finally:
        srv.stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--override-generation-config", '{"beams": 2}'], "unknown key(s) beams"),
        (["--generation-config", "/nonexistent/dir"], "no generation_config.json in that directory"),
    ],
)
def test_bad_flags_stop_the_start_with_the_reason(
    tiny_llama: Path, serve_logs: Path, server_process, flags, message
):
    srv = server_process(tiny_llama, flags, serve_logs)
    with pytest.raises(RuntimeError) as e:
        srv.start(timeout=60)
    assert message in str(e.value)
