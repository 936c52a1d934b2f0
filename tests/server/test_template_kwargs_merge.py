"""A request's ``chat_template_kwargs`` merged with its own fields as vLLM merges them, on every
route that renders a chat (chat completions, ``/tokenize``, ``/pooling``, Anthropic's Messages), and
``reasoning_effort`` (a chat request's, a Responses request's ``reasoning.effort``) reaching the
template. Lowest first: ``--default-chat-template-kwargs``, the ``tools`` field, the request's
kwargs (null or "auto" there: unset), then its fields ``add_generation_prompt`` and
``continue_final_message`` (always), ``documents`` and ``reasoning_effort`` (when given). What the
server itself does with a flag (the answer's role, echo) follows the merged value.

The app runs in process, under a real uvicorn, over a real engine whose chat template prints the
variables it got in a header line; the exact prompt token ids are checked against the tokenizer's
encoding of the text the template must write.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from router.prompt_keys import TokenKeyer
from server.app import build_app
from server.chat_defaults import ChatDefaults
from server.config import ServerConfig

TEMPLATE = (
    "[agp={{ add_generation_prompt }} effort={{ reasoning_effort | default('-') }}"
    "{% if reasoning_effort is defined %} ({{ reasoning_effort | list | join(' ') }}){% endif %}"
    " think={{ enable_thinking | default('-') }} mood={{ mood | default('-') }}"
    " tools={{ tools | map(attribute='function') | map(attribute='name') | join(',') if tools else '-' }}"
    " docs={{ documents | map(attribute='title') | join(',') if documents else '-' }}]\n"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}bot:{% endif %}"
)
DEFAULTS = ChatDefaults({"mood": "calm"})
HI = [{"role": "user", "content": "hi"}]
PREFILL = [*HI, {"role": "assistant", "content": "Sure"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}

# The tests run in the loop their fixtures' server runs in.
pytestmark = pytest.mark.asyncio(loop_scope="session")


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def shown(
    turns: str = "user: hi\n",
    *,
    agp: bool = True,
    effort: str = "-",
    think: str = "-",
    mood: str = "calm",
    tools: str = "-",
    docs: str = "-",
) -> str:
    """The text TEMPLATE writes for these variables."""
    spelled = f" ({' '.join(effort)})" if effort != "-" else ""
    head = f"[agp={agp} effort={effort}{spelled} think={think} mood={mood} tools={tools} docs={docs}]\n"
    return head + turns + ("bot:" if agp else "")


@pytest.fixture(scope="module")
async def engine(tiny_llama, tmp_path_factory) -> AsyncIterator[AsyncEngine]:
    path = tmp_path_factory.mktemp("template") / "show.jinja"
    path.write_text(TEMPLATE)
    eng = AsyncEngine(
        EngineConfig(model=str(tiny_llama), num_kv_blocks=64, chat_template=str(path), deterministic=True)
    )
    yield eng
    await eng.shutdown()


@pytest.fixture
async def client(engine, serve_app) -> AsyncIterator[httpx.AsyncClient]:
    config = ServerConfig(served_model_name="m", chat=DEFAULTS, response_role="bot")
    async with serve_app(build_app(engine, config)) as url, httpx.AsyncClient(base_url=url, timeout=60) as c:
        yield c


async def _ok(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def test_tokenize_merges_kwargs_under_the_request_fields(client, tokenizer) -> None:
    cases = [
        ({}, shown()),
        # The fields win over the kwargs' spelling of them; the kwargs' other keys are merged.
        (
            {
                "chat_template_kwargs": {
                    "add_generation_prompt": False,
                    "continue_final_message": True,
                    "mood": "x",
                }
            },
            shown(mood="x"),
        ),
        (
            {**CONTINUE, "messages": PREFILL, "chat_template_kwargs": {"add_generation_prompt": True}},
            shown("user: hi\nassistant: Sure", agp=False),
        ),
        # documents: the kwargs' when the field is not given, else the field's.
        ({"chat_template_kwargs": {"documents": [{"title": "k"}]}}, shown(docs="k")),
        (
            {"documents": [{"title": "f"}], "chat_template_kwargs": {"documents": [{"title": "k"}]}},
            shown(docs="f"),
        ),
        # tools: the kwargs' over the field (the tools sit under the kwargs in vLLM's layers).
        ({"tools": [_tool("b")]}, shown(tools="b")),
        ({"tools": [_tool("b")], "chat_template_kwargs": {"tools": [_tool("a")]}}, shown(tools="a")),
        # A null or "auto" is no value: the server's default stays.
        ({"chat_template_kwargs": {"mood": None}}, shown()),
        ({"chat_template_kwargs": {"mood": "auto"}}, shown()),
        ({"chat_template_kwargs": {"reasoning_effort": "low"}}, shown(effort="low")),
    ]
    for extra, text in cases:
        got = await _ok(client, "/tokenize", {"messages": HI, **extra})
        assert got["tokens"] == tokenizer.encode(text, add_special_tokens=False), (extra, text)
        assert (await _ok(client, "/detokenize", {"tokens": got["tokens"]}))["prompt"] == text
    # The conversation itself is the request's messages, never a template variable.
    r = await client.post("/tokenize", json={"messages": HI, "chat_template_kwargs": {"messages": PREFILL}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def _prompt_ids(answer: dict) -> list[int]:
    """The prompt's token ids past the first (which has no logprob), from prompt_logprobs 0."""
    return [int(next(iter(entry))) for entry in answer["prompt_logprobs"][1:]]


async def test_chat_acts_on_the_merged_flags(client, tokenizer) -> None:
    chat = {"model": "m", "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    # The kwargs' add_generation_prompt false loses to the field: a new turn, in the server's role
    # (--response-role), not a continued user message.
    answer = await _ok(
        client,
        "/v1/chat/completions",
        {**chat, "messages": HI, "chat_template_kwargs": {"add_generation_prompt": False}},
    )
    want = tokenizer.encode(shown(), add_special_tokens=False)
    assert _prompt_ids(answer) == want[1:] and answer["usage"]["prompt_tokens"] == len(want)
    assert answer["choices"][0]["message"]["role"] == "bot"
    # A continued message stays continued whatever the kwargs say: its role, its text echoed.
    body = {**chat, **CONTINUE, "messages": PREFILL, "echo": True}
    answer = await _ok(
        client, "/v1/chat/completions", {**body, "chat_template_kwargs": {"add_generation_prompt": True}}
    )
    want = tokenizer.encode(shown("user: hi\nassistant: Sure", agp=False), add_special_tokens=False)
    assert _prompt_ids(answer) == want[1:]
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].startswith("Sure")


async def test_reasoning_effort_reaches_the_template(client, tokenizer, tiny_llama) -> None:
    chat = {"model": "m", "messages": HI, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    cases = [
        ({}, shown()),
        ({"reasoning_effort": "low"}, shown(effort="low", think="True")),
        ({"reasoning_effort": "none"}, shown(effort="none", think="False")),
        # The field over the kwargs' effort; the kwargs' own enable_thinking stays.
        (
            {
                "reasoning_effort": "xhigh",
                "chat_template_kwargs": {"reasoning_effort": "low", "enable_thinking": False},
            },
            shown(effort="xhigh", think="False"),
        ),
    ]
    keyer = TokenKeyer.from_dir(str(tiny_llama), 16, TEMPLATE, chat=DEFAULTS)
    for extra, text in cases:
        answer = await _ok(client, "/v1/chat/completions", {**chat, **extra})
        want = tokenizer.encode(text, add_special_tokens=False)
        assert _prompt_ids(answer) == want[1:] and answer["usage"]["prompt_tokens"] == len(want), extra
        assert keyer.token_ids("/v1/chat/completions", {**chat, **extra}) == want  # the router's too
    r = await client.post("/v1/chat/completions", json={**chat, "reasoning_effort": "extreme"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


async def test_responses_reasoning_effort_is_the_templates(client, tokenizer, tiny_llama) -> None:
    body = {"model": "m", "input": "hi", "max_output_tokens": 1, "temperature": 0.0}
    keyer = TokenKeyer.from_dir(str(tiny_llama), 16, TEMPLATE, chat=DEFAULTS)
    counts = []
    for effort, think in ((None, "-"), ("low", "True"), ("minimal", "True"), ("none", "False")):
        extra = {} if effort is None else {"reasoning": {"effort": effort, "summary": "auto"}}
        got = await _ok(client, "/v1/responses", {**body, **extra})
        want = tokenizer.encode(shown(effort=effort or "-", think=think), add_special_tokens=False)
        assert got["usage"]["input_tokens"] == len(want), effort
        assert got["reasoning"] == (None if effort is None else {"effort": effort, "summary": "auto"})
        assert keyer.keys("/v1/responses", {**body, **extra})[1] == len(want)  # the router's count
        counts.append(len(want))
    assert len(set(counts)) == len(counts)  # each effort writes a prompt of its own length
    r = await client.post("/v1/responses", json={**body, "reasoning": {"effort": "extreme"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort"


async def test_pooling_and_messages_merge_alike(client, tokenizer) -> None:
    # /pooling renders without a generation prompt unless its field asks: the kwargs' true loses.
    kwargs = {"chat_template_kwargs": {"add_generation_prompt": True, "mood": "x"}}
    pooled = await _ok(client, "/pooling", {"model": "m", "messages": HI, **kwargs})
    ids = tokenizer.encode(shown(agp=False, mood="x"), add_special_tokens=False)
    want = await _ok(client, "/v1/embeddings", {"model": "m", "input": ids})
    assert pooled["data"][0]["data"] == want["data"][0]["embedding"]
    assert pooled["usage"]["prompt_tokens"] == len(ids)
    # Anthropic's prefill is a continued message, whatever its chat_template_kwargs say.
    body = {"model": "m", "messages": PREFILL, **kwargs}
    counted = await _ok(client, "/v1/messages/count_tokens", body)
    text = shown("user: hi\nassistant: Sure", agp=False, mood="x")
    assert counted == {"input_tokens": len(tokenizer.encode(text, add_special_tokens=False))}
    answer = await _ok(client, "/v1/messages", {**body, "max_tokens": 1})
    assert (
        answer["usage"]["input_tokens"] + answer["usage"]["cache_read_input_tokens"]
        == counted["input_tokens"]
    )
