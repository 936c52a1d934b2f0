"""`ferry serve` of a model whose every layer slides: the context it admits is the model's, not the
KV cache's, because a request only holds the blocks its window reaches."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from engine import LLM, SamplingParams
from tests.server.conftest import ServerProcess

WINDOW = 10
CACHE = ["--block-size", "4", "--num-kv-blocks", "8", "--max-num-batched-tokens", "8"]  # 32 tokens of KV


@pytest.fixture(scope="module")
def mistral(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("sw_serve") / "mistral"
    shutil.copytree(tiny_llama, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=WINDOW)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def small_cache_server(mistral: Path, serve_logs: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(mistral, CACHE, serve_logs).start()
    yield proc
    proc.stop()


def test_a_sequence_longer_than_the_cache_is_served(mistral: Path, small_cache_server: ServerProcess) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(3, 100) for _ in range(70)]
    client = openai.OpenAI(base_url=small_cache_server.url + "/v1", api_key="x")
    # 70 + 10 tokens: 20 blocks of 4 under full attention, in a cache of 8.
    got = client.completions.create(
        model=small_cache_server.model_name,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    want = LLM(str(mistral), block_size=16, num_kv_blocks=64).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    )
    assert got.choices[0].token_ids == want[0].outputs[0].token_ids  # type: ignore[attr-defined]
    assert got.usage is not None and got.usage.total_tokens == 80
    # The limit the server checks is the model's context (1024), not the cache's 32 tokens.
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens"):
        client.completions.create(model=small_cache_server.model_name, prompt=prompt, max_tokens=1000)
