"""`ferry serve --enable-prompt-embeds`: /v1/completions takes ``prompt_embeds`` (base64 of
torch.save'd tensors) through the OpenAI SDK as vLLM's example sends them; embeddings that are the
embedding table's rows answer as their token ids do, embeddings' choices come before the text
prompts', n > 1 and streaming work, usage counts the rows, and every bad payload is a 400 in
OpenAI's error shape (also on a server without the flag). The --api-server-count path (tensors
pickled to the engine process) is tests/server/test_engine_ipc.py's."""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file

from tests.server.conftest import ServerProcess

A = [5, 99, 230, 17, 64, 301, 12, 7, 450, 3, 88]
B = list(range(40, 60))
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def table(tiny_llama: Path) -> torch.Tensor:
    (weights,) = [load_file(p) for p in tiny_llama.glob("*.safetensors")]
    return weights["model.embed_tokens.weight"]


def b64(value: object) -> str:
    buf = io.BytesIO()
    torch.save(value, buf)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def embeds_server(tiny_llama: Path, serve_logs: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(tiny_llama, ["--num-kv-blocks", "64", "--enable-prompt-embeds"], serve_logs).start()
    yield srv
    srv.stop()


def tokens_by_index(completion) -> list[list[int]]:
    return [c.token_ids for c in sorted(completion.choices, key=lambda c: c.index)]


def test_sdk_prompt_embeds(embeds_server: ServerProcess, table: torch.Tensor) -> None:
    client = openai.OpenAI(base_url=embeds_server.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=embeds_server.model_name, max_tokens=6, temperature=0.0)
    by_ids = {
        name: client.completions.create(prompt=ids, extra_body=EXTRA, **kw)
        for name, ids in (("a", A), ("b", B))
    }
    want = {name: c.choices[0].token_ids for name, c in by_ids.items()}
    # vLLM's example: the SDK needs a prompt, "" stands for none
    got = client.completions.create(prompt="", extra_body={**EXTRA, "prompt_embeds": b64(table[A])}, **kw)
    assert tokens_by_index(got) == [want["a"]]
    assert got.choices[0].text == by_ids["a"].choices[0].text
    assert got.usage.prompt_tokens == len(A) and got.usage.completion_tokens == 6
    # truncate_prompt_tokens keeps the last rows
    longer = b64(table[B[:5] + A])
    cut = client.completions.create(
        prompt="", extra_body={**EXTRA, "prompt_embeds": longer, "truncate_prompt_tokens": len(A)}, **kw
    )
    assert tokens_by_index(cut) == [want["a"]] and cut.usage.prompt_tokens == len(A)
    # prompt and prompt_embeds are two prompts, the embeddings' first; n = 2 each
    both = client.completions.create(
        prompt=B, n=2, extra_body={**EXTRA, "prompt_embeds": [b64(table[A][None])]}, **kw
    )
    assert tokens_by_index(both) == [want["a"], want["a"], want["b"], want["b"]]
    # vLLM's prompt_token_ids: a token prompt's own ids; none for embeddings (placeholders are no ids)
    assert [c.model_extra.get("prompt_token_ids") for c in both.choices] == [None, None, B, B]
    assert both.usage.prompt_tokens == len(A) + len(B)
    # streaming, two embeddings prompts and logprobs of the outputs
    stream = client.completions.create(
        prompt="",
        stream=True,
        logprobs=1,
        extra_body={**EXTRA, "prompt_embeds": [b64(table[B]), b64(table[A].to(torch.bfloat16))]},
        **kw,
    )
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.token_ids or []
    assert streamed[0] == want["b"]
    assert len(streamed[1]) == 6  # bf16-rounded rows: other numbers, still a whole answer


def test_bad_prompt_embeds_are_400s(embeds_server: ServerProcess, server: ServerProcess, table) -> None:
    class Evil:
        def __reduce__(self):
            return (print, ("unpickled!",))

    raw_pickle = base64.b64encode(pickle.dumps(Evil())).decode()
    nan = table[A].clone()
    nan[1, 1] = float("nan")
    cases = {
        "bad base64": ({"prompt_embeds": "@@not base64@@"}, "base64"),
        "not a torch file": (
            {"prompt_embeds": base64.b64encode(b"hello").decode()},
            "not a torch.save'd tensor",
        ),
        "a plain pickle": ({"prompt_embeds": raw_pickle}, "not a torch.save'd tensor"),
        "a torch file of a callable": ({"prompt_embeds": b64(Evil())}, "not a torch.save'd tensor"),
        "not a tensor": ({"prompt_embeds": b64({"x": table[A]})}, "must hold a tensor, not a dict"),
        "a list": ({"prompt_embeds": b64([1.0, 2.0])}, "must hold a tensor, not a list"),
        "wrong hidden size": ({"prompt_embeds": b64(torch.zeros(3, 65))}, "hidden size 65"),
        "wrong rank": ({"prompt_embeds": b64(torch.zeros(64))}, "shape [seq_len, hidden_size]"),
        "batch of 2": ({"prompt_embeds": b64(torch.zeros(2, 3, 64))}, "shape [seq_len, hidden_size]"),
        "empty": ({"prompt_embeds": b64(torch.zeros(0, 64))}, "empty"),
        "empty list": ({"prompt_embeds": []}, "must not be empty"),
        "integers": ({"prompt_embeds": b64(torch.zeros(3, 64, dtype=torch.long))}, "floating"),
        "NaN": ({"prompt_embeds": b64(nan)}, "non-finite"),
        "too long": ({"prompt_embeds": b64(torch.zeros(2000, 64))}, "maximum context length is 1024"),
        "echo": ({"prompt_embeds": b64(table[A]), "echo": True}, "echo"),
        "prompt_logprobs": ({"prompt_embeds": b64(table[A]), "prompt_logprobs": 1}, "prompt_logprobs"),
        "neither": ({}, "Field required"),
    }
    for name, (body, message) in cases.items():
        r = httpx.post(
            embeds_server.url + "/v1/completions",
            json={"model": embeds_server.model_name, "max_tokens": 4, **body},
            timeout=30,
        )
        assert r.status_code == 400, (name, r.text)
        error = r.json()["error"]
        assert message in error["message"] and error["type"] == "BadRequestError", (name, error)
    off = httpx.post(
        server.url + "/v1/completions",
        json={"model": server.model_name, "prompt": "", "prompt_embeds": b64(table[A])},
        timeout=30,
    )
    assert off.status_code == 400 and "--enable-prompt-embeds" in off.json()["error"]["message"]
    assert off.json()["error"]["param"] == "prompt_embeds"
    assert "unpickled!" not in embeds_server.log()
    ok = httpx.post(
        embeds_server.url + "/v1/completions",
        json={"model": embeds_server.model_name, "prompt_embeds": b64(table[A]), "max_tokens": 2},
        timeout=30,
    )
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == len(A)
