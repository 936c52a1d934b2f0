"""`ferry router` passes /v1/completions with ``prompt_embeds`` through (the SDK's ``prompt=""`` form,
a body with only ``prompt_embeds``, streaming), and cache_aware sends identical embeddings to the
replica holding their blocks."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import openai
import torch
from router_harness import Cluster
from safetensors.torch import load_file

B = list(range(40, 60))  # 20 rows: one full block of 16


def b64(value: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(value, buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_router_passes_prompt_embeds_through(cluster: Cluster, tiny_llama: Path) -> None:
    (weights,) = [load_file(p) for p in tiny_llama.glob("*.safetensors")]
    embeds = b64(weights["model.embed_tokens.weight"][B])
    replicas = cluster.replicas(2, "--enable-prompt-embeds", "--num-kv-blocks", "64")
    router = cluster.router(
        *[a for r in replicas for a in ("--replica", r.url)],
        "--policy",
        "cache_aware",
        "--model",
        str(tiny_llama),
    )
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=tiny_llama.name, max_tokens=6, temperature=0.0)
    extra = {"ignore_eos": True, "return_token_ids": True}
    want = client.completions.create(prompt=B, extra_body=extra, **kw).choices[0].token_ids
    cached = []
    for _ in range(3):
        got = client.completions.create(prompt="", extra_body={**extra, "prompt_embeds": embeds}, **kw)
        assert got.choices[0].token_ids == want
        assert got.usage.prompt_tokens == len(B)
        cached.append(got.usage.prompt_tokens_details.cached_tokens if got.usage.prompt_tokens_details else 0)
    assert cached == [0, 16, 16]  # the repeats found the first one's block: the same replica
    only = httpx.post(
        router.url + "/v1/completions",
        json={"model": tiny_llama.name, "prompt_embeds": embeds, "max_tokens": 6, "temperature": 0, **extra},
        timeout=60,
    )
    assert only.status_code == 200 and only.json()["choices"][0]["token_ids"] == want
    stream = client.completions.create(
        prompt="", stream=True, extra_body={**extra, "prompt_embeds": embeds}, **kw
    )
    assert [t for chunk in stream for c in chunk.choices for t in (c.token_ids or [])] == want
    bad = httpx.post(
        router.url + "/v1/completions",
        json={"model": tiny_llama.name, "prompt_embeds": "@@", "max_tokens": 2},
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_embeds"
