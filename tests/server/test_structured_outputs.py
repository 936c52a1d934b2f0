"""Structured outputs over HTTP with the official openai SDK: OpenAI's ``response_format`` (and the
SDK's ``parse`` helper), vLLM's ``structured_outputs`` and ``guided_*``, streamed and not; greedy
constrained text equals the offline engine's; a constraint that does not compile is a 400 before
any stream starts, and the server keeps serving."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams
from engine.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "Pick a color."}]


class Pick(BaseModel):
    ok: bool
    color: Literal["red", "green", "blue"]
    count: Literal[1, 2, 3]


@pytest.fixture(scope="module")
def no_whitespace(tokenizer: Tokenizer) -> dict[str, float]:
    """logit_bias pushing down every whitespace-only token: a random model would otherwise fill the
    JSON grammar's optional whitespace until max_tokens (as vLLM allows it by default)."""
    ws = [
        t
        for t in range(tokenizer.vocab_size)
        if t not in tokenizer.all_special_ids and (b := tokenizer.token_bytes(t)) and not b.strip()
    ]
    assert ws
    return {str(t): -100.0 for t in ws}


def test_sdk_parse_returns_the_pydantic_object(client, server, no_whitespace) -> None:
    completion = client.chat.completions.parse(
        model=server.model_name,
        messages=MESSAGES,
        response_format=Pick,
        max_completion_tokens=60,
        temperature=1.0,
        seed=11,
        logit_bias=no_whitespace,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pick)
    assert json.loads(choice.message.content) == choice.message.parsed.model_dump()


def test_greedy_json_schema_over_http_equals_the_engine(client, server, tiny_llama, no_whitespace) -> None:
    schema = Pick.model_json_schema()
    r = client.chat.completions.create(
        model=server.model_name,
        messages=MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}},
        max_tokens=60,
        temperature=0.0,
        logit_bias=no_whitespace,
        extra_body={"return_token_ids": True},
    )
    got = r.choices[0].model_extra["token_ids"]
    prompt_ids = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    llm = LLM(str(tiny_llama), num_kv_blocks=64, num_threads=1)
    try:
        params = SamplingParams(
            max_tokens=60,
            temperature=0.0,
            logit_bias={int(k): v for k, v in no_whitespace.items()},
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        want = llm.generate([prompt_ids], params)[0].outputs[0]
    finally:
        llm.close()
    assert got == want.token_ids
    assert r.choices[0].message.content == want.text
    Pick.model_validate_json(want.text)


def test_json_object_in_completions(client, server) -> None:
    close = str(Tokenizer.from_dir(server.model_dir).encode("}", add_special_tokens=False)[0])
    r = client.completions.create(
        model=server.model_name,
        prompt="x = ",
        max_tokens=8,
        temperature=0.0,
        logit_bias={close: 100.0},
        extra_body={"response_format": {"type": "json_object"}},  # vLLM takes it on completions too
    )
    assert json.loads(r.choices[0].text) == {} and r.choices[0].finish_reason == "stop"


def test_streamed_regex_with_n_choices(client, server) -> None:
    stream = client.completions.create(
        model=server.model_name,
        prompt="id:",
        n=3,
        max_tokens=16,
        temperature=1.0,
        seed=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"guided_regex": r"[A-F]{2}-[0-9]{3}"},
    )
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1, 2]
    assert all(re.fullmatch(r"[A-F]{2}-[0-9]{3}", t) for t in texts.values()), texts
    assert finish == {0: "stop", 1: "stop", 2: "stop"}
    assert usage is not None and usage.completion_tokens >= 3 * 3


async def test_async_client_choice_and_grammar(server) -> None:
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    async with aclient:
        r = await aclient.chat.completions.create(
            model=server.model_name,
            messages=MESSAGES,
            max_tokens=10,
            extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
        )
        assert r.choices[0].message.content in ("red", "green", "blue")
        r = await aclient.completions.create(
            model=server.model_name,
            prompt="n=",
            max_tokens=10,
            extra_body={"guided_grammar": 'root ::= "<" [0-9] [0-9] ">"'},
        )
        assert re.fullmatch(r"<\d\d>", r.choices[0].text)


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_that_does_not_compile_is_a_400_before_the_stream(client, server, stream) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=server.model_name,
            messages=MESSAGES,
            max_tokens=5,
            stream=stream,
            extra_body={"guided_regex": "[a-z"},
        )
    assert err.value.status_code == 400
    body = err.value.body
    assert body["param"] == "guided_regex" and "invalid structured outputs regex" in body["message"]
    r = client.completions.create(
        model=server.model_name, prompt="x", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 2
    metrics = httpx.get(server.url + "/metrics").text
    assert re.search(r"^vllm:num_requests_running\{[^}]*\} 0\.0$", metrics, re.M)


TAG_SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}},
    "required": ["color"],
    "additionalProperties": False,
}


def _tag_text(text: str) -> dict:
    """The JSON between ``<pick>`` and ``</pick>`` of a whole answer that must be exactly one tag."""
    assert text.startswith("<pick>") and text.endswith("</pick>"), text
    return json.loads(text[len("<pick>") : -len("</pick>")])


def test_structural_tag_in_xgrammars_format(client, server, tiny_llama, no_whitespace) -> None:
    fmt = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<pick>",
            "content": {"type": "json_schema", "json_schema": TAG_SCHEMA},
            "end": "</pick>",
        },
    }
    body = {"max_tokens": 40, "temperature": 0, "logit_bias": no_whitespace}
    chat = client.chat.completions.create(
        model=server.model_name, messages=MESSAGES, extra_body={"response_format": fmt, **body}
    )
    value = _tag_text(chat.choices[0].message.content)
    assert value["color"] in ("red", "green", "blue") and chat.choices[0].finish_reason == "stop"
    # vLLM's structured_outputs.structural_tag (JSON text) gives the same greedy answer as the engine.
    tag = json.dumps(fmt)
    text = client.completions.create(
        model=server.model_name,
        prompt="Pick:",
        extra_body={"structured_outputs": {"structural_tag": tag}, **body},
    )
    with LLM(str(tiny_llama), num_kv_blocks=64, num_threads=1) as llm:
        want = llm.generate(
            ["Pick:"],
            SamplingParams(
                temperature=0,
                max_tokens=40,
                logit_bias={int(k): v for k, v in no_whitespace.items()},
                structured_outputs=StructuredOutputsParams(structural_tag=tag),
            ),
        )[0].outputs[0]
    assert text.choices[0].text == want.text
    _tag_text(want.text)


def test_structural_tag_with_triggers(client, server, tiny_llama) -> None:
    """vLLM's older form: free text until a trigger, then the tag's schema holds up to its end."""
    import xgrammar as xgr

    fmt = {
        "type": "structural_tag",
        "structures": [{"begin": "<pick>", "schema": TAG_SCHEMA, "end": "</pick>"}],
        "triggers": ["<pick"],
    }
    answer = client.completions.create(
        model=server.model_name,
        prompt="Pick:",
        max_tokens=8,
        temperature=0,
        extra_body={"response_format": fmt},
    )
    assert answer.choices[0].finish_reason == "length"
    spec = StructuredOutputsParams(structural_tag={k: fmt[k] for k in ("structures", "triggers")})
    with LLM(str(tiny_llama), num_kv_blocks=16, num_threads=1) as llm:
        compiled = llm.engine.grammars.compile(spec)

    def accepts(text: str) -> bool:
        return xgr.GrammarMatcher(compiled).accept_string(text)

    assert accepts('Let me pick. <pick>{"color": "red"}</pick> Done.')
    assert accepts("no tag at all")
    assert not accepts('<pick>{"color": "pink"}')
    assert not accepts("<pick>red</pick>")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "structural_tag",
                    "structures": [{"begin": "<a>"}],
                    "triggers": ["<a"],
                }
            },
            "response_format",
        ),
        ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs"),
        (
            {
                "structured_outputs": {
                    "structural_tag": {"type": "structural_tag", "format": {"type": "nope"}}
                }
            },
            "structured_outputs",
        ),
    ],
)
def test_bad_structural_tags_are_400s(server, extra, param) -> None:
    body = {"model": server.model_name, "prompt": "x", "max_tokens": 2, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
