"""`ferry serve --speculative-config '{"model": DRAFT, ...}'`: a draft model behind the OpenAI API
answers with the tokens decoding without drafts gives; a copy of the target as draft has every
draft accepted, as /metrics counts them; a draft of another vocabulary is a clean startup error."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from engine.demo import build_model
from tests.server.conftest import metric_value
from tests.server.test_api_servers import _serve
from tests.server.test_spec_decode_serve import start_spec_server

PROMPT = list(range(20, 120))


@pytest.fixture(scope="module")
def draft_server(tiny_llama: Path, serve_logs: Path, server_process, tmp_path_factory) -> Iterator:
    draft = tmp_path_factory.mktemp("draft") / "copy"
    shutil.copytree(tiny_llama, draft)
    spec = {"model": str(draft), "num_speculative_tokens": 3}
    srv = start_spec_server(server_process, tiny_llama, serve_logs, spec)
    yield srv
    srv.stop()


def test_answers_equal_decoding_without_drafts(draft_server, tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), num_kv_blocks=64, deterministic=True, num_threads=1)
    want = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0].outputs[
        0
    ]
    client = openai.OpenAI(base_url=draft_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    body = {"ignore_eos": True, "return_token_ids": True}
    kwargs = {"model": draft_server.model_name, "prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    whole = client.completions.create(**kwargs, extra_body=body)
    assert whole.choices[0].token_ids == want.token_ids and whole.choices[0].text == want.text
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body=body))
    assert [t for c in chunks for t in (c.choices[0].token_ids or [])] == want.token_ids
    assert "".join(c.choices[0].text for c in chunks) == want.text
    # Per request: 7 steps of 3 drafts, every one accepted (engine/draft_model.py tests say why).
    text = httpx.get(draft_server.url + "/metrics").text
    name = draft_server.model_name
    assert metric_value(text, "vllm:spec_decode_num_drafts_total", model_name=name) == 14
    assert metric_value(text, "vllm:spec_decode_num_draft_tokens_total", model_name=name) == 42
    assert metric_value(text, "vllm:spec_decode_num_accepted_tokens_total", model_name=name) == 42
    for pos in ("0", "1", "2"):
        assert (
            metric_value(
                text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name=name, position=pos
            )
            == 14
        )
    # Four tokens arrive per step: the stream has far fewer chunks than tokens.
    assert len([c for c in chunks if c.choices and c.choices[0].token_ids]) <= 9


def test_a_draft_of_another_vocabulary_is_a_clean_startup_error(tiny_llama: Path, tmp_path: Path) -> None:
    draft = build_model(tmp_path / "draft", "llama", hidden_size=32, tokenizer_vocab_size=900)
    spec = json.dumps({"model": str(draft), "num_speculative_tokens": 2})
    done = _serve(["--model", str(tiny_llama), "--speculative-config", spec])
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().endswith("a draft model must share the target's vocabulary"), done.stderr
    assert "Traceback" not in done.stderr
