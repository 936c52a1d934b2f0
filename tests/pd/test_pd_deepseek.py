"""Prefill/decode disaggregation of a DeepSeek model: the latent KV blocks (one 24-wide part per
layer, not K and V) go from a prefill worker through Redis to a decode worker, and the client
gets the offline engine's tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer
from tests.pd.conftest import _replica, _router
from tests.pd.pd_cluster import PD_THRESHOLD
from tests.router.router_harness import Proc, metric

PROMPTS = [" ".join(f"word{(i * 7 + j * 13) % 97}" for j in range(40 + 9 * i)) for i in range(3)]


@pytest.fixture(scope="module")
def cluster(
    tiny_deepseek: Path, redis_server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, ...]]:
    redis_server.flush()
    tmp = tmp_path_factory.mktemp("pd_deepseek")
    tier = ("--kv-tier", redis_server.url, "--num-kv-blocks", "128")
    procs: list[Proc] = []
    try:
        prefill = _replica(tiny_deepseek, tmp, "prefill", "--role", "prefill", *tier)
        procs.append(prefill)
        decode = _replica(tiny_deepseek, tmp, "decode", "--role", "decode", *tier)
        procs.append(decode)
        for p in procs:
            p.wait_http(180.0)
        router = _router(
            tmp,
            "router",
            *("--model", str(tiny_deepseek), "--pd-threshold", str(PD_THRESHOLD)),
            *("--prefill", prefill.url, "--decode", decode.url),
        )
        procs.append(router)
        router.wait_http(30.0)
        yield prefill, decode, router
    finally:
        for p in reversed(procs):
            p.stop()


def test_latent_blocks_hand_off_exactly(tiny_deepseek: Path, cluster: tuple[Proc, ...]) -> None:
    _, decode, router = cluster
    tokenizer = Tokenizer.from_dir(tiny_deepseek)
    llm = LLM(str(tiny_deepseek), num_kv_blocks=128)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    loaded = 0
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert len(ids) > PD_THRESHOLD
        body = {
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        want = llm.generate([ids], greedy)[0].outputs[0].token_ids
        assert r.json()["choices"][0]["token_ids"] == want
        loaded += len(ids) // 16
    # The decode worker computed none of the full prompt blocks: all came from the tier.
    assert metric(decode.url, "ferry:kv_tier_hits_total") == loaded > 0
    assert metric(router.url, "ferry:router_pd_requests_total", {"path": "disaggregated"}) == len(PROMPTS)
