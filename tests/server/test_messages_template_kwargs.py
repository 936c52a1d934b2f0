"""Anthropic Messages requests carry ``chat_template_kwargs`` to the chat template, as vLLM's do:
the way a client of ``/v1/messages`` turns a Qwen3-style template's thinking off (or DeepSeek-V3.1's
on). ``/v1/messages/count_tokens`` counts the prompt rendered with them, which is the prompt the
answer is generated from.

The app runs in process over a real engine whose chat template writes Qwen3's empty think block
when ``enable_thinking`` is false.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.demo import CHATML_TEMPLATE
from server.anthropic_protocol import CountTokensRequest, MessagesRequest
from server.app import build_app
from server.config import ServerConfig
from server.serving_messages import to_chat_request

TEMPLATE = CHATML_TEMPLATE.replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}",
)
MESSAGES = [{"role": "user", "content": "hi"}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
async def engine(tiny_llama, tmp_path_factory) -> AsyncIterator[AsyncEngine]:
    assert TEMPLATE != CHATML_TEMPLATE
    template = tmp_path_factory.mktemp("template") / "thinking.jinja"
    template.write_text(TEMPLATE)
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, chat_template=str(template)))
    yield eng
    await eng.shutdown()


def test_the_chat_request_gets_them() -> None:
    for model in (MessagesRequest, CountTokensRequest):
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 1, **OFF}
        assert to_chat_request(model.model_validate(body)).chat_template_kwargs == {"enable_thinking": False}


async def test_counted_and_generated_with_the_requests_template_kwargs(engine, serve_app) -> None:
    async with (
        serve_app(build_app(engine, ServerConfig(served_model_name="m"))) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        tokenized = {}
        for name, extra in (("on", {}), ("off", OFF)):
            r = await client.post("/tokenize", json={"messages": MESSAGES, **extra})
            tokenized[name] = r.json()["count"]
        assert tokenized["off"] > tokenized["on"]
        for name, extra in (("on", {}), ("off", OFF)):
            body = {"model": "m", "messages": MESSAGES, **extra}
            counted = (await client.post("/v1/messages/count_tokens", json=body)).json()
            assert counted == {"input_tokens": tokenized[name]}
            answer = (await client.post("/v1/messages", json={**body, "max_tokens": 1})).json()
            assert (
                answer["usage"]["input_tokens"] + answer["usage"]["cache_read_input_tokens"]
                == tokenized[name]
            )


def test_output_config_effort_is_the_chat_requests_reasoning_effort() -> None:
    """Anthropic's ``output_config.effort`` is the template's ``reasoning_effort`` (vLLM's
    mapping), for the answer and for the count of its prompt."""
    for model in (MessagesRequest, CountTokensRequest):
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 1, "output_config": {"effort": "low"}}
        assert to_chat_request(model.model_validate(body)).reasoning_effort == "low"


@pytest.mark.parametrize(
    ("thinking", "kwargs", "enable_thinking"),
    [
        ({"type": "disabled"}, None, False),
        ({"type": "enabled", "budget_tokens": 1024}, None, True),
        ({"type": "adaptive"}, None, True),
        ({"type": "disabled"}, {"enable_thinking": True, "x": 1}, True),  # the client's own kwargs win
        ({"type": ["disabled"]}, None, None),  # not a type Anthropic has: the template's default
        (None, None, None),
    ],
)
def test_thinking_switches_the_templates_thinking(thinking, kwargs, enable_thinking) -> None:
    """Anthropic's ``thinking.type`` is the template's ``enable_thinking`` (off for ``disabled``),
    for the answer and for the count of its prompt, unless ``chat_template_kwargs`` set it."""
    for model in (MessagesRequest, CountTokensRequest):
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 1, "thinking": thinking}
        if kwargs is not None:
            body["chat_template_kwargs"] = kwargs
        got = to_chat_request(model.model_validate(body)).chat_template_kwargs or {}
        assert got.get("enable_thinking") == enable_thinking
        assert {k: v for k, v in got.items() if k != "enable_thinking"} == {
            k: v for k, v in (kwargs or {}).items() if k != "enable_thinking"
        }


async def test_thinking_disabled_renders_the_templates_no_thinking_prompt(engine, serve_app) -> None:
    async with (
        serve_app(build_app(engine, ServerConfig(served_model_name="m"))) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        off = (await client.post("/tokenize", json={"messages": MESSAGES, **OFF})).json()["count"]
        on = (await client.post("/tokenize", json={"messages": MESSAGES})).json()["count"]
        for thinking, want in (({"type": "disabled"}, off), ({"type": "adaptive"}, on)):
            body = {"model": "m", "messages": MESSAGES, "thinking": thinking}
            counted = (await client.post("/v1/messages/count_tokens", json=body)).json()
            assert counted == {"input_tokens": want}
            answer = (await client.post("/v1/messages", json={**body, "max_tokens": 1})).json()
            assert answer["usage"]["input_tokens"] + answer["usage"]["cache_read_input_tokens"] == want
