"""A Responses or Messages answer whose engine outputs come folded (several tokens' deltas in one,
as ``merge_pending`` folds them for a client slower than the engine) has the output items / content
blocks, in the order written, that the token-by-token stream and the whole answer have (the whole,
streamed and stored Responses output; a message's logprobs); an end inside a delta (a stop string,
``max_tool_calls``) falls at the same token. ``test_folded_deltas.py`` covers chat and completions.

The app runs in process over a real engine (``fold_deltas`` changes only how its outputs are
batched); the chat request each API makes is steered to a known answer by a regex constraint (the
Responses and Messages APIs take none).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

import server.serving_messages as serving_messages
import server.serving_responses as serving_responses
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from server.app import build_app
from server.protocol import StructuredOutputsField
from tests.server.folded_answers import (
    CHAT_CASES,
    FOLDS,
    TOOLS,
    F,
    Thought,
    chat_config,
    chat_streamed,
    chat_whole,
    message_blocks,
    message_of_events,
    regex,
    response_items,
    sse,
)


@pytest.fixture(scope="module")
async def engine(tiny_llama) -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=256))
    yield eng
    await eng.shutdown()


@pytest.fixture
def steer(monkeypatch):
    """``steer(module, answer)``: the chat request ``module``'s API turns a request into constrained
    to ``answer`` (the Responses and Messages APIs take no regex)."""

    def steer(module: Any, answer: str) -> None:
        translate = module.to_chat_request

        def to_chat_request(*args: Any, **kwargs: Any):
            chat = translate(*args, **kwargs)
            chat.structured_outputs = StructuredOutputsField(regex=regex(answer))
            return chat

        monkeypatch.setattr(module, "to_chat_request", to_chat_request)

    return steer


# -- /v1/responses ----------------------------------------------------------------------------------


@pytest.mark.parametrize("logprobs", [True, False])
@pytest.mark.parametrize("case", list(CHAT_CASES))
async def test_responses(engine, serve_app, fold_deltas, steer, case, logprobs) -> None:
    """Whole, streamed and stored output items agree, and are the same however the answer's deltas
    were folded: its message items' logprobs too (a token's logprob is its text's item's)."""
    flags, answer, order = CHAT_CASES[case]
    steer(serving_responses, answer)
    body: dict[str, Any] = {
        "model": "m",
        "input": "hi",
        "max_output_tokens": 300,
        "temperature": 0.0,
        "include": ["message.output_text.logprobs"] if logprobs else [],
        "top_logprobs": 0,
    }
    if flags.get("tools"):
        body["tools"] = [{"type": "function", **t["function"]} for t in TOOLS]
    seen = []
    async with (
        serve_app(build_app(engine, chat_config(**flags))) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        for fold in FOLDS:
            fold_deltas(engine, fold)
            whole = (await client.post("/v1/responses", json=body)).json()
            events = await sse(client, "/v1/responses", body)
            stored = (await client.get(f"/v1/responses/{whole['id']}")).json()
            final = events[-1]["response"]
            assert events[-1]["type"] == "response.completed" and whole["status"] == "completed"
            assert (
                response_items(final["output"])
                == response_items(whole["output"])
                == response_items(stored["output"])
            )
            assert final["usage"] == whole["usage"]
            if logprobs:
                _assert_text_logprobs(events)
            seen.append(response_items(whole["output"]))
    want = [
        p if isinstance(p, tuple) else ("reasoning" if isinstance(p, Thought) else "message", p)
        for p in order
    ]
    assert [item[:2] for item in seen[0]] == want
    assert seen == [seen[0]] * len(FOLDS)
    texts = [item for item in seen[0] if item[0] == "message"]
    for _, text, tokens in texts if logprobs else ():
        # A message's logprobs are its text's tokens: no call markup, no thought.
        assert "".join(tokens) == text and tokens


def _assert_text_logprobs(events: list[dict[str, Any]]) -> None:
    """Each streamed text delta carries the tokens of its text, and the part's logprobs at its end
    are those of its deltas."""
    sent: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        if e["type"] == "response.output_text.delta":
            assert "".join(t["token"] for t in e["logprobs"]) == e["delta"], e
            sent.setdefault(e["item_id"], []).extend(e["logprobs"])
        elif e["type"] == "response.output_text.done":
            assert e["logprobs"] == sent.pop(e["item_id"])
            assert "".join(t["token"] for t in e["logprobs"]) == e["text"]
    assert not sent


# -- /v1/messages (Anthropic) -----------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CHAT_CASES))
async def test_messages(engine, serve_app, fold_deltas, steer, case) -> None:
    """Whole and streamed, however folded: thinking, text and tool_use blocks in the order written."""
    flags, answer, order = CHAT_CASES[case]
    steer(serving_messages, answer)
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 300,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if flags.get("tools"):
        body["tools"] = [
            {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
        ]
    want = [
        p if isinstance(p, tuple) else ("thinking" if isinstance(p, Thought) else "text", p) for p in order
    ]
    async with (
        serve_app(build_app(engine, chat_config(**flags))) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        for fold in FOLDS:
            fold_deltas(engine, fold)
            whole = (await client.post("/v1/messages", json=body)).json()
            streamed = message_of_events(await sse(client, "/v1/messages", body))
            assert message_blocks(whole) == message_blocks(streamed) == want, fold
            for key in ("stop_reason", "stop_sequence", "usage", "role", "model", "type"):
                assert whole[key] == streamed[key], key
            assert whole["stop_reason"] == ("tool_use" if flags.get("tools") else "end_turn")


# -- ends that fall inside a delta: a stop string, max_tool_calls -----------------------------------

TOOLS_ANSWER = CHAT_CASES["tools"][1]


@pytest.mark.parametrize("include", [False, True])
async def test_a_stop_string_inside_a_delta_ends_chat_and_messages_alike(
    engine, serve_app, fold_deltas, steer, include
) -> None:
    steer(serving_messages, TOOLS_ANSWER)
    chat: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 300,
        "temperature": 0.0,
        "tools": TOOLS,
        "stop": [" aft"],
        "include_stop_str_in_output": include,
        "structured_outputs": {"regex": regex(TOOLS_ANSWER)},
    }
    anthropic = {
        "model": "m",
        "max_tokens": 300,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": "hi"}],
        "stop_sequences": [" aft"],
        "tools": [
            {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
        ],
    }
    seen = []
    async with (
        serve_app(build_app(engine, chat_config(tools="hermes"))) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        for fold in FOLDS:
            fold_deltas(engine, fold)
            whole = chat_whole((await client.post("/v1/chat/completions", json=chat)).json())
            streamed = chat_streamed(await sse(client, "/v1/chat/completions", chat), 1)
            (got,), (want,) = streamed["choices"], whole["choices"]
            assert (got["finish_reason"], got["stop_reason"]) == (want["finish_reason"], want["stop_reason"])
            seen.append((got["written"], want["content"], want["calls"], want["finish_reason"]))
            message = (await client.post("/v1/messages", json=anthropic)).json()
            events = message_of_events(await sse(client, "/v1/messages", anthropic))
            assert message_blocks(message) == message_blocks(events) == [("text", "Hello "), F]
            # The turn ends in a call (the chat's "tool_calls"), whole or streamed; the stop
            # sequence generated after it is named.
            assert (message["stop_reason"], message["stop_sequence"]) == ("tool_use", " aft")
            assert (events["stop_reason"], events["stop_sequence"]) == ("tool_use", " aft")
    tail = [" aft"] if include else []
    assert seen == [(["Hello ", F, *tail], "Hello " + "".join(tail), [F], "tool_calls")] * len(FOLDS)


@pytest.mark.parametrize("logprobs", [False, True])
async def test_max_tool_calls_cuts_a_folded_answer_at_the_same_token(
    engine, serve_app, fold_deltas, steer, logprobs
) -> None:
    steer(serving_responses, TOOLS_ANSWER)
    body: dict[str, Any] = {
        "model": "m",
        "input": "hi",
        "max_output_tokens": 300,
        "temperature": 0.0,
        "tools": [{"type": "function", **t["function"]} for t in TOOLS],
        "max_tool_calls": 1,
        "include": ["message.output_text.logprobs"] if logprobs else [],
    }
    seen = []
    async with (
        serve_app(build_app(engine, chat_config(tools="hermes"))) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        for fold in FOLDS:
            fold_deltas(engine, fold)
            whole = (await client.post("/v1/responses", json=body)).json()
            final = (await sse(client, "/v1/responses", body))[-1]["response"]
            assert response_items(final["output"]) == response_items(whole["output"])
            assert final["usage"] == whole["usage"]
            seen.append((response_items(whole["output"]), whole["usage"]["output_tokens"]))
    assert [items for items, _ in seen][0][1] == F
    assert seen == [seen[0]] * len(FOLDS)
