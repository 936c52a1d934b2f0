"""``POST /v1/responses`` against what OpenAI's SDK types and vLLM's ``ResponsesRequest`` say, with the
official SDK as the client: vLLM's ``chat_template_kwargs`` reach the template (and the router's
prompt keys) as on the chat endpoint; its ``include_stop_str_in_output`` and ``skip_special_tokens``
reach the chat request; the response echoes ``service_tier``, ``prompt_cache_key``,
``prompt_cache_retention``, ``safety_identifier``, carries ``completed_at`` once completed,
``top_logprobs`` 0 by default and a ``text`` that always names its format; listed input items
validate as the SDK's ``ResponseItem`` (calls, call outputs and assistant text included); a failed
response's ``error.code`` is one of OpenAI's; ``metadata`` past OpenAI's bounds is a 400."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseItem

from server.chat_protocol import ChatCompletionChunk, ChatStreamChoice, DeltaMessage
from server.errors import timeout_error
from server.responses_object import _Response
from server.responses_protocol import ResponsesRequest
from server.responses_stream import events

# The tiny model's ChatML, plus two template variables a request may set: a note shown as a system
# turn, and the reasoning effort (as gpt-oss's template writes it).
TEMPLATE = (
    "{% if note is defined %}{{ '<|im_start|>system\\n' + note + '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}"
    "{% if reasoning_effort is defined and reasoning_effort %}{{ 'effort: ' + reasoning_effort + '\\n' }}"
    "{% endif %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
NOTE = "Always answer in the voice of a lighthouse keeper from the northern coast."
ITEMS = pydantic.TypeAdapter(ResponseItem)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fidelity") / "notes.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def replica(server_process, tiny_llama: Path, serve_logs: Path, template_file: Path):
    srv = server_process(tiny_llama, ["--chat-template", str(template_file)], serve_logs).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def sdk(replica):  # noqa: ANN201
    return openai.OpenAI(base_url=replica.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _chat_prompt_tokens(sdk, replica, **extra) -> int:  # noqa: ANN001
    chat = sdk.chat.completions.create(
        model=replica.model_name,
        messages=[{"role": "user", "content": "Hello"}],
        max_completion_tokens=1,
        extra_body=extra,
    )
    return chat.usage.prompt_tokens


def test_chat_template_kwargs_reach_the_template(sdk, replica, tiny_llama: Path, template_file: Path) -> None:
    from router.prompt_keys import TokenKeyer

    plain = sdk.responses.create(model=replica.model_name, input="Hello", max_output_tokens=1)
    kwargs = {"chat_template_kwargs": {"note": NOTE}}
    noted = sdk.responses.create(
        model=replica.model_name, input="Hello", max_output_tokens=1, extra_body=kwargs
    )
    # The note is rendered: the prompt is the chat endpoint's with the same variables, longer than
    # the one without them.
    assert plain.usage.input_tokens == _chat_prompt_tokens(sdk, replica)
    assert noted.usage.input_tokens == _chat_prompt_tokens(sdk, replica, **kwargs)
    assert noted.usage.input_tokens > plain.usage.input_tokens + 10
    # The router keys the same prompt (its cache-aware policy finds the replica's blocks).
    keyer = TokenKeyer.from_dir(str(tiny_llama), 16, chat_template=template_file.read_text())
    body = {"model": replica.model_name, "input": "Hello", **kwargs}
    assert keyer.keys("/v1/responses", body)[1] == noted.usage.input_tokens


def test_reasoning_effort_wins_over_the_template_kwargs(sdk, replica) -> None:
    """As on chat (vLLM's merge): the request's own field over ``chat_template_kwargs``' variable."""
    r = sdk.responses.create(
        model=replica.model_name,
        input="Hello",
        max_output_tokens=1,
        reasoning={"effort": "low"},
        extra_body={"chat_template_kwargs": {"reasoning_effort": "medium"}},
    )
    assert r.usage.input_tokens == _chat_prompt_tokens(sdk, replica, reasoning_effort="low")
    assert r.usage.input_tokens != _chat_prompt_tokens(sdk, replica, reasoning_effort="medium")


def test_include_stop_str_in_output_reaches_the_answer(sdk, replica) -> None:
    kw = dict(model=replica.model_name, input="Tell me a story.", max_output_tokens=16, temperature=0)
    full = sdk.responses.create(**kw).output_text
    # A stop string from the middle of the greedy answer (printable, first seen where it is taken).
    k = next(
        i
        for i in range(3, len(full) - 2)
        if full[i : i + 2].isprintable() and full.find(full[i : i + 2]) == i
    )
    stop = full[k : k + 2]
    cut = sdk.responses.create(**kw, extra_body={"stop": [stop]})
    kept = sdk.responses.create(**kw, extra_body={"stop": [stop], "include_stop_str_in_output": True})
    assert cut.output_text == full[:k]
    assert kept.output_text == full[: k + 2]
    assert cut.status == kept.status == "completed"


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"include_stop_str_in_output": 3}, "include_stop_str_in_output"),
        ({"service_tier": "fastest"}, "service_tier"),
        ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
        # OpenAI's bounds on metadata: 16 pairs, 64-character keys, 512-character values
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
    ],
)
def test_a_bad_value_is_a_400_naming_it(replica, extra, param) -> None:
    """Refused as vLLM's and OpenAI's are, rather than ignored or stored."""
    body = {"model": replica.model_name, "input": "Hi", "max_output_tokens": 1, **extra}
    r = httpx.post(replica.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == param  # metadata.<key> names the pair


def _finished(sdk, replica, stream: bool, **kw) -> Response:  # noqa: ANN001
    # The regex makes the random model's answer end (status completed, not cut at max_output_tokens).
    kw = dict(
        model=replica.model_name,
        input="How are you?",
        max_output_tokens=64,
        extra_body={"structured_outputs": {"regex": "Fine, thanks"}},
        **kw,
    )
    if not stream:
        return sdk.responses.create(**kw)
    with sdk.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created = next(e for e in events if e.type == "response.created")
    assert created.response.completed_at is None and created.response.status == "in_progress"
    return final


@pytest.mark.parametrize("stream", [False, True])
def test_the_response_echoes_what_openai_echoes(sdk, replica, stream) -> None:
    r = _finished(
        sdk,
        replica,
        stream,
        service_tier="flex",
        prompt_cache_key="conversation-7",
        prompt_cache_retention="24h",
        safety_identifier="user-hash-1",
        text={"verbosity": "low"},
    )
    assert r.output_text == "Fine, thanks"
    assert r.status == "completed"
    assert r.service_tier == "default"  # the tier that served it: there is one here
    assert r.prompt_cache_key == "conversation-7"
    assert r.prompt_cache_retention == "24h"
    assert r.safety_identifier == "user-hash-1"
    assert r.top_logprobs == 0
    assert r.text.model_dump(exclude_none=True) == {"format": {"type": "text"}, "verbosity": "low"}
    assert r.completed_at is not None and r.completed_at >= r.created_at
    stored = httpx.get(replica.url + f"/v1/responses/{r.id}", timeout=30).json()
    Response.model_validate(stored)
    assert type(stored["completed_at"]) is int and stored["completed_at"] == r.completed_at


def test_only_a_completed_response_has_completed_at(sdk, replica) -> None:
    r = sdk.responses.create(model=replica.model_name, input="Hi", max_output_tokens=2)
    assert r.status == "incomplete"
    assert r.completed_at is None
    assert r.service_tier == "default" and r.top_logprobs == 0


def test_input_items_validate_as_the_sdks_items(sdk, replica) -> None:
    history = [
        {"role": "user", "content": "What time is it?"},
        {"type": "message", "role": "assistant", "content": "Let me look."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "One moment."}]},
        {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
    ]
    r = sdk.responses.create(model=replica.model_name, input=history, max_output_tokens=1)
    raw = httpx.get(replica.url + f"/v1/responses/{r.id}/input_items", params={"order": "asc"}, timeout=30)
    items = raw.json()["data"]
    for item in items:
        ITEMS.validate_python(item)  # strict: the SDK's required fields are there
    assert [(i["type"], i["status"]) for i in items] == [
        ("message", "completed"),
        ("message", "completed"),
        ("message", "completed"),
        ("function_call", "completed"),
        ("function_call_output", "completed"),
    ]
    assert items[1]["content"] == [{"type": "output_text", "text": "Let me look.", "annotations": []}]
    assert items[2]["content"] == [{"type": "output_text", "text": "One moment.", "annotations": []}]


async def test_a_failed_responses_error_has_an_openai_code() -> None:
    """A stream cut by ``--request-timeout`` (``server/responses_stream.py``, fed the chunks of such
    a stream): ``response.failed``'s response validates as the SDK's ``Response``, whose ``error.code``
    takes only OpenAI's codes; the ``error`` event keeps this server's own."""
    built = _Response(ResponsesRequest.model_validate({"input": "hi", "stream": True}), "m", "req-2")

    async def chunks() -> AsyncIterator[ChatCompletionChunk]:
        delta = DeltaMessage(content="Once")
        yield ChatCompletionChunk(
            id="c", created=0, model="m", choices=[ChatStreamChoice(index=0, delta=delta)]
        )
        raise timeout_error(3)

    async def save() -> None:
        pass

    frames = [frame async for frame in events(built, chunks(), save, want_logprobs=False)]
    seen = [json.loads(frame.decode().split("data: ", 1)[1]) for frame in frames]
    assert [e["type"] for e in seen][-2:] == ["error", "response.failed"]
    assert seen[-2]["code"] == "request_timeout"
    failed = Response.model_validate(seen[-1]["response"])
    assert failed.status == "failed"
    assert (failed.error.code, failed.error.type) == ("server_error", "request_timeout")
    assert failed.error.message == timeout_error(3).message


@pytest.mark.parametrize("status", ["incomplete", "in_progress"])
def test_a_partial_assistant_message_is_continued(
    sdk, replica, tiny_llama: Path, template_file: Path, status
) -> None:
    """vLLM's: an assistant message last in the input, ``incomplete`` or ``in_progress``, is
    continued (chat's ``continue_final_message``), not answered with a new turn; the router keys it
    alike. A ``completed`` one is answered as before."""
    from router.prompt_keys import TokenKeyer

    def history(state: str) -> list[dict]:
        return [
            {"role": "user", "content": "Tell me a story."},
            {"type": "message", "role": "assistant", "status": state, "content": "Once upon a time"},
        ]

    kw = dict(model=replica.model_name, max_output_tokens=4, temperature=0)
    messages = [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": "Once upon a time"},
    ]
    continued = sdk.chat.completions.create(
        messages=messages,
        max_completion_tokens=4,
        temperature=0,
        model=replica.model_name,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    partial = sdk.responses.create(input=history(status), **kw)
    assert partial.usage.input_tokens == continued.usage.prompt_tokens
    assert partial.output_text == continued.choices[0].message.content
    whole = sdk.responses.create(input=history("completed"), **kw)
    # A new turn: the finished message's end and the next assistant header are in its prompt.
    assert whole.usage.input_tokens > partial.usage.input_tokens
    keyer = TokenKeyer.from_dir(str(tiny_llama), 16, chat_template=template_file.read_text())
    body = {"model": replica.model_name, "input": history(status)}
    assert keyer.keys("/v1/responses", body)[1] == partial.usage.input_tokens
