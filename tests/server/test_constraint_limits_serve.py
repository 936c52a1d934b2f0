"""Over HTTP, a constraint past one of structured outputs' cost limits (``engine/grammar_limits.py``)
is a 400 naming the field that carried it, the keyword and the limit, before any stream starts,
through the OpenAI SDK as a client sends it; the server keeps serving."""

from __future__ import annotations

import openai
import pytest

MESSAGES = [{"role": "user", "content": "hi"}]
WIDE = {"type": "object", "properties": {f"f{i}": {"type": "integer"} for i in range(130)}}
OPTIONAL = (
    "has 130 optional properties{where}, above the 128 that structured outputs take in one object "
    "(its compile time grows with the cube of their number); list more of them in 'required'"
)


def _bad_request(call) -> dict:  # noqa: ANN001 - a no-argument SDK call
    with pytest.raises(openai.BadRequestError) as err:
        call()
    assert err.value.status_code == 400
    return err.value.body  # type: ignore[return-value]


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_past_a_limit_is_a_400(client, server, stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": WIDE}}
    body = _bad_request(
        lambda: client.chat.completions.create(
            model=server.model_name, messages=MESSAGES, max_tokens=5, response_format=fmt, stream=stream
        )
    )
    assert (body["param"], body["code"]) == ("response_format", "invalid_value")
    assert body["message"] == "structured outputs json " + OPTIONAL.format(where="")


def test_a_tool_past_a_limit_is_a_400_when_a_call_is_required(client, server) -> None:
    tool = {"type": "function", "function": {"name": "wide", "parameters": WIDE}}
    body = _bad_request(
        lambda: client.chat.completions.create(
            model=server.model_name, messages=MESSAGES, max_tokens=5, tools=[tool], tool_choice="required"
        )
    )
    assert body["param"] == "tools"
    where = " at #/items/anyOf/0/properties/parameters"
    assert body["message"] == "structured outputs json " + OPTIONAL.format(where=where)


def test_a_long_counted_repetition_is_a_400_and_the_server_serves_on(client, server) -> None:
    body = _bad_request(
        lambda: client.completions.create(
            model=server.model_name,
            prompt="hi",
            max_tokens=5,
            extra_body={"structured_outputs": {"regex": ".{0,500}"}},
        )
    )
    assert (body["param"], body["message"]) == (
        "structured_outputs",
        "structured outputs regex has the counted repetition '{0,500}' above the 128 that structured "
        "outputs take (xgrammar matches a longer one slowly); write '*' or '+' and bound the length "
        "with max_tokens",
    )
    done = client.completions.create(
        model=server.model_name,
        prompt="hi",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "(yes|no)( because [a-z ]{1,100})?"}},
    )
    text = done.choices[0].text
    assert text.startswith(("yes", "no")), text
