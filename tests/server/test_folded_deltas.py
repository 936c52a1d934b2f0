"""A stream whose engine outputs come folded (several tokens' deltas in one, as ``merge_pending``
folds them for a client slower than the engine) shows what the token-by-token stream and the whole
answer show: the same text to the character, tool calls in the same place among the text, the same
reasoning, finish and stop reason, usage, and logprobs (one per token, the same tokens). Here
/v1/completions and /v1/chat/completions, and the pieces that keep a delta's order
(``test_folded_deltas_apis.py``: the Responses and Messages APIs).

The app runs in process over a real engine (``fold_deltas`` changes only how its outputs are
batched); the random model is steered to a known answer by a regex constraint.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams
from server.app import build_app
from server.chat_shape import ChoiceShaper, Shaped
from server.config import ServerConfig
from server.reasoning_parsers import reasoning_splitter
from server.sequence_request import SequenceRequest
from server.token_deltas import TokenSplitter
from tests.server.folded_answers import (
    CHAT_CASES,
    FOLDS,
    HARMONY,
    TEXT,
    TOOLS,
    Thought,
    chat_config,
    chat_streamed,
    chat_whole,
    regex,
    sse,
)


@pytest.fixture(scope="module")
async def engine(tiny_llama) -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=256))
    yield eng
    await eng.shutdown()


# -- /v1/completions --------------------------------------------------------------------------------


def _completion_streamed(chunks: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The stream's choices joined as a whole answer's read."""
    choices: list[dict[str, Any]] = [
        {"text": "", "finish_reason": None, "stop_reason": None, "tokens": [], "offsets": []}
        for _ in range(n)
    ]
    usage = None
    for c in chunks:
        usage = c.get("usage") or usage
        for ch in c["choices"]:
            mine = choices[ch["index"]]
            mine["text"] += ch["text"]
            if ch["finish_reason"] is not None:
                mine["finish_reason"], mine["stop_reason"] = ch["finish_reason"], ch.get("stop_reason")
            if ch.get("logprobs"):
                mine["tokens"] += ch["logprobs"]["tokens"]
                mine["offsets"] += ch["logprobs"]["text_offset"]
    return {"choices": choices, "usage": usage}


def _completion_whole(body: dict[str, Any]) -> dict[str, Any]:
    choices = [
        {
            "text": ch["text"],
            "finish_reason": ch["finish_reason"],
            "stop_reason": ch.get("stop_reason"),
            "tokens": (ch["logprobs"] or {}).get("tokens", []),
            "offsets": (ch["logprobs"] or {}).get("text_offset", []),
        }
        for ch in sorted(body["choices"], key=lambda ch: ch["index"])
    ]
    return {"choices": choices, "usage": body["usage"]}


@pytest.mark.parametrize("fold", FOLDS)
@pytest.mark.parametrize(
    ("extra", "text"),
    [
        ({"stop": ["ld, a"]}, "Hello wor"),  # a stop string across tokens
        ({"stop": ["ld, a"], "include_stop_str_in_output": True}, "Hello world, a"),
        ({"echo": True, "logprobs": 1}, "hi" + TEXT),
        ({"echo": True}, "hi" + TEXT),
        ({"max_tokens": 5}, None),
    ],
)
async def test_completions(engine, serve_app, fold_deltas, fold, extra, text) -> None:
    fold_deltas(engine, fold)
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 200,
        "temperature": 0.0,
        "n": 2,
        "logprobs": 0,
        "structured_outputs": {"regex": regex(TEXT)},
        **extra,
    }
    async with (
        serve_app(build_app(engine, ServerConfig(served_model_name="m"))) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        whole = (await client.post("/v1/completions", json=body)).json()
        streamed = await sse(client, "/v1/completions", body, stream_options={"include_usage": True})
    want = _completion_whole(whole)
    got = _completion_streamed(streamed, 2)
    assert got == want
    if text is not None:
        assert [c["text"] for c in want["choices"]] == [text, text]
    echoed = whole["usage"]["prompt_tokens"] if extra.get("echo") else 0
    per_choice = whole["usage"]["completion_tokens"] // 2 + echoed
    assert [len(c["tokens"]) for c in want["choices"]] == [per_choice, per_choice]


# -- /v1/chat/completions ---------------------------------------------------------------------------


@pytest.mark.parametrize(("fold", "logprobs"), [(3, False), (None, False), (None, True)])
@pytest.mark.parametrize("case", list(CHAT_CASES))
async def test_chat(engine, serve_app, fold_deltas, fold, logprobs, case) -> None:
    flags, answer, order = CHAT_CASES[case]
    fold_deltas(engine, fold)
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 300,
        "temperature": 0.0,
        "n": 2,
        "logprobs": logprobs,
        "structured_outputs": {"regex": regex(answer)},
    }
    if flags.get("tools"):
        body["tools"] = TOOLS
    async with (
        serve_app(build_app(engine, chat_config(**flags))) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        whole = chat_whole((await client.post("/v1/chat/completions", json=body)).json())
        streamed = chat_streamed(
            await sse(client, "/v1/chat/completions", body, stream_options={"include_usage": True}), 2
        )
    assert streamed["usage"] == whole["usage"]
    per_choice = whole["usage"]["completion_tokens"] // 2
    finish = "tool_calls" if any(isinstance(p, tuple) for p in order) else "stop"
    for got, want in zip(streamed["choices"], whole["choices"], strict=True):
        assert got["written"] == order
        assert want["reasoning"] == ("".join(p for p in order if isinstance(p, Thought)) or None)
        assert want["content"] == ("".join(p for p in order if type(p) is str) or None)
        assert want["calls"] == [p for p in order if isinstance(p, tuple)]
        assert got["finish_reason"] == want["finish_reason"] == finish
        assert got["stop_reason"] == want["stop_reason"]
        assert got["tokens"] == want["tokens"] and len(want["tokens"]) == (per_choice if logprobs else 0)


# -- keeping a delta's order ----------------------------------------------------------------------


def test_harmony_keeps_a_thought_that_follows_content_after_it() -> None:
    """A delta holding a preamble to the user, then more thinking, is shaped in that order, in
    whatever pieces the text comes."""
    whole = [("Think A.", "Preamble."), ("Think B.", 'to=functions.f<|message|>{"a": 1}')]
    assert reasoning_splitter("openai_gptoss").pieces(HARMONY) == whole
    for size in (1, 7, len(HARMONY)):
        shaper = ChoiceShaper(None, reasoning_splitter("openai_gptoss"))
        shaped = Shaped()
        for i in range(0, len(HARMONY), size):
            shaped = shaped.then(shaper.feed(HARMONY[i : i + size]))
        assert [(thought, text) for thought, text, _ in shaped.steps()] == whole
        assert (shaped.reasoning, shaped.content) == (
            "Think A.Think B.",
            'Preamble.to=functions.f<|message|>{"a": 1}',
        )


def _output(ids: list[int], text: str, finish_reason: str | None = None) -> RequestOutput:
    logprobs = [{token: Logprob(-float(i))} for i, token in enumerate(ids)]
    out = CompletionOutput(0, text, ids, logprobs=logprobs, finish_reason=finish_reason)
    return RequestOutput("r", None, [1, 2], [out], finished=finish_reason is not None)


def test_token_splitter_splits_a_delta_into_its_tokens_text_and_all(tokenizer) -> None:
    ids = tokenizer.encode("Hello world, all is well", add_special_tokens=False)
    seq = SequenceRequest(0, 0, [1, 2], SamplingParams(logprobs=0))
    splitter = TokenSplitter(tokenizer, seq)
    first = splitter.split(_output(ids[:3], tokenizer.decode(ids[:3])))
    last = splitter.split(_output(ids[3:], tokenizer.decode(ids)[len(tokenizer.decode(ids[:3])) :], "length"))
    parts = [*first, *last]
    assert [p.outputs[0].token_ids for p in parts] == [[token] for token in ids]
    assert "".join(p.outputs[0].text for p in parts) == "Hello world, all is well"
    assert [p.outputs[0].logprobs[0][token].logprob for p, token in zip(last, ids[3:], strict=True)] == [
        -float(i) for i in range(len(ids) - 3)
    ]
    assert [p.finished for p in parts] == [False] * (len(ids) - 1) + [True]
    assert [p.outputs[0].finish_reason for p in parts] == [None] * (len(ids) - 1) + ["length"]


def test_token_splitter_leaves_a_delta_whole_once_its_text_is_not_the_engines(tokenizer) -> None:
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    splitter = TokenSplitter(tokenizer, SequenceRequest(0, 0, [1, 2], SamplingParams(logprobs=0)))
    odd = _output(ids[:2], "not these tokens' text")
    assert splitter.split(odd) == [odd]
    rest = _output(ids[2:], tokenizer.decode(ids)[len(tokenizer.decode(ids[:2])) :])
    assert splitter.split(rest) == [rest]  # out of step since: as they come
