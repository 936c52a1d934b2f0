"""Tool-call parsers and the per-choice tool state, without a server: exact (content, calls) for each
format, text that is not a call kept as content, and streaming that gives the same result however
the text is cut into deltas (what lets a resumed stream rebuild its state)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.chat_template import template_message
from server.chat_protocol import ChatCompletionRequest
from server.errors import APIError
from server.tool_parsers import TOOL_PARSERS, ParsedCall, get_tool_parser
from server.tools import ChoiceTools, ToolPlan, plan_tools, read_required, tool_finish_reason

W = ParsedCall("get_weather", '{"city": "Paris"}')
NOW = ParsedCall("now", "{}")

CASES = {
    "hermes": [
        (
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n',
            "Let me check.\n",
            [W],
        ),
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>',
            "",
            [W, NOW],
        ),
        ('<tool_call>{"name": "now", "arguments": "{}"}</tool_call>', "", [NOW]),  # arguments as JSON text
        ('<tool_call>{"name": "now"}', "", [NOW]),  # cut off before the closing tag
        ("no call here, not even <tool_", "no call here, not even <tool_", []),
        ("<tool_call>{not json}</tool_call> then text", "<tool_call>{not json}</tool_call> then text", []),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"arguments": {}}</tool_call>',
            [],
        ),  # no name
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [W]),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}',
            "",
            [W, NOW],
        ),
        ("The weather is fine.", "The weather is fine.", []),
        ('{"name": "get_weather", "parameters": ', '{"name": "get_weather", "parameters": ', []),
        ('{"temperature": 20}', '{"temperature": 20}', []),
    ],
    "mistral": [
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]',
            "",
            [W, NOW],
        ),
        ('Sure. [TOOL_CALLS][{"name": "now", "arguments": {}}]', "Sure. ", [NOW]),
        ("[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
        ("plain [TOOL text", "plain [TOOL text", []),
    ],
    "deepseek_v3": [
        (
            "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n'
            "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "Checking.",
            [W, NOW],
        ),
        (  # cut off after the first complete call
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜>",
            "",
            [NOW],
        ),
        (  # arguments that are not a JSON object: all of it stays text
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n[1]\n```"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n[1]\n```"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            [],
        ),
        ("no call <｜tool▁calls", "no call <｜tool▁calls", []),
    ],
    "deepseek_v31": [
        (
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
            "<｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜> Done.",
            " Done.",
            [W, NOW],
        ),
        (  # V3's fenced form is not V3.1's
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            [],
        ),
    ],
    "kimi_k2": [
        (
            "Sure.<|tool_calls_section_begin|> <|tool_call_begin|> functions.get_weather:0 "
            '<|tool_call_argument_begin|> {"city": "Paris"} <|tool_call_end|> <|tool_call_begin|>'
            "functions.now:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
            "Sure.",
            [  # the model's ids kept: Kimi's template writes them back into the history
                ParsedCall(W.name, W.arguments, "functions.get_weather:0"),
                ParsedCall(NOW.name, NOW.arguments, "functions.now:1"),
            ],
        ),
        (  # no index after the name: not Kimi's id
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.now<|tool_call_argument_begin|>{}"
            "<|tool_call_end|><|tool_calls_section_end|>",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.now<|tool_call_argument_begin|>{}"
            "<|tool_call_end|><|tool_calls_section_end|>",
            [],
        ),
    ],
    "pythonic": [
        ('[get_weather(city="Paris"), now()]', "", [W, NOW]),
        ("<|python_start|>[get_weather(city='Paris')]<|python_end|>", "", [W]),
        (
            '[book(when={"day": 3, "slots": (1, 2)}, ok=True, note=None)]',
            "",
            [ParsedCall("book", '{"when": {"day": 3, "slots": [1, 2]}, "ok": true, "note": null}')],
        ),
        ("[tools.search(q='x')]", "", [ParsedCall("tools.search", '{"q": "x"}')]),
        ("[get_weather('Paris')]", "[get_weather('Paris')]", []),  # positional: not a call
        ("[get_weather(city=os.getcwd())]", "[get_weather(city=os.getcwd())]", []),  # never evaluated
        ("[1, 2, 3]", "[1, 2, 3]", []),
        ('[get_weather(city="Par', '[get_weather(city="Par', []),  # cut off
        ("It is sunny.", "It is sunny.", []),
    ],
    "granite": [
        (
            '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]',
            "",
            [W, NOW],
        ),
        ('<tool_call> [{"name": "now", "arguments": {}}]', "", [NOW]),
        ('[{"name": "now"}]', "", [NOW]),
        ('<|tool_call|>{"name": "now"}', '<|tool_call|>{"name": "now"}', []),  # not an array
        ("Hello.", "Hello.", []),
    ],
    "phi4_mini_json": [
        ('functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [W]),
        ("functools is a module", "functools is a module", []),
        ("Sure.", "Sure.", []),
    ],
    "glm45": [
        (
            "Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
            "Checking.",
            [W],
        ),
        (
            "<tool_call>book\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n"
            "<tool_call>now\n</tool_call>",
            "",
            [ParsedCall("book", '{"days": 3}'), NOW],
        ),
        ('<tool_call>{"name": "now"}</tool_call>', '<tool_call>{"name": "now"}</tool_call>', []),
    ],
    "qwen3_coder": [
        (
            "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "</function>\n</tool_call>",
            "Let me look.\n",
            [W],
        ),
        (
            "<tool_call><function=book><parameter=days>\n3\n</parameter><parameter=opts>\n"
            '{"late": true}\n</parameter></function></tool_call>\n<tool_call><function=now></function></tool_call>',
            "",
            # no tools to type them by: text, as vLLM's qwen3_coder leaves undeclared parameters
            [ParsedCall("book", '{"days": "3", "opts": "{\\"late\\": true}"}'), NOW],
        ),
        ("<tool_call><function=now>", "", [NOW]),  # cut off
        ("<tool_call>not a function</tool_call>", "<tool_call>not a function</tool_call>", []),
        ("plain text", "plain text", []),
    ],
    # vLLM's second names for formats above
    "llama4_json": [('{"name": "now", "parameters": {}}', "", [NOW])],
    "qwen3_xml": [("<tool_call>\n<function=now>\n</function>\n</tool_call>", "", [NOW])],
    "glm47": [  # GLM-4.7 writes no newline after the name
        ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>", "", [W]),
    ],
    "seed_oss": [
        (
            "Let me look.\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "</function>\n</seed:tool_call>",
            "Let me look.\n",
            [W],
        ),
        (
            "<seed:tool_call><function=now></function></seed:tool_call>\n"
            "<seed:tool_call><function=get_weather><parameter=city>Paris</parameter></function></seed:tool_call>",
            "",
            [NOW, W],
        ),
        ("<seed:tool_call>nothing</seed:tool_call>", "<seed:tool_call>nothing</seed:tool_call>", []),
        (
            "<tool_call><function=now></function></tool_call>",
            "<tool_call><function=now></function></tool_call>",
            [],
        ),
    ],
    "minimax_m2": [
        (
            'Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
            "</invoke>\n</minimax:tool_call>",
            "Checking.\n",
            [W],
        ),
        (  # two calls in one section; quotes optional; no parameters
            '<minimax:tool_call><invoke name="now"></invoke>\n<invoke name=get_weather><parameter name=city>'
            "\nParis\n</parameter></invoke></minimax:tool_call> done",
            " done",
            [NOW, W],
        ),
        (  # cut off inside the second call: the complete one is kept
            '<minimax:tool_call><invoke name="now"></invoke><invoke name="get_we',
            "",
            [NOW],
        ),
        (
            "<minimax:tool_call>text</minimax:tool_call>",
            "<minimax:tool_call>text</minimax:tool_call>",
            [],
        ),
    ],
    "jamba": [
        (
            'Sure. <tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", '
            '"arguments": {}}]</tool_calls>',
            "Sure. ",
            [W, NOW],
        ),
        ('<tool_calls>{"name": "now"}</tool_calls>', '<tool_calls>{"name": "now"}</tool_calls>', []),
    ],
    "hunyuan_a13b": [
        ('<tool_calls>[{"name": "now", "arguments": {}}]</tool_calls>', "", [NOW]),
        ("no call", "no call", []),
    ],
    "internlm": [
        (
            'Checking.<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
            "<|action_end|>",
            "Checking.",
            [W],
        ),
        ('<|action_start|><|plugin|>{"name": "now", "arguments": {}}<|action_end|>', "", [NOW]),
        ("<|action_start|><|plugin|>[1]<|action_end|>", "<|action_start|><|plugin|>[1]<|action_end|>", []),
    ],
    "xlam": [
        (
            '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]',
            "",
            [W, NOW],
        ),
        ('```json\n[{"name": "now", "arguments": {}}]\n```', "", [NOW]),
        ('[TOOL_CALLS][{"name": "now", "arguments": {}}]', "", [NOW]),
        ('<tool_call>[{"name": "now", "arguments": {}}]</tool_call>', "", [NOW]),
        ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
        ("[1, 2]", "[1, 2]", []),
        ("Hello.", "Hello.", []),
    ],
}
ALL = [(name, *case) for name, cases in CASES.items() for case in cases]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL)
def test_parse(parser, text, content, calls) -> None:
    assert get_tool_parser(parser).parse(text) == (content, calls)


def _stream(parser: str, text: str, cuts: list[int]) -> tuple[str, list[ParsedCall]]:
    streamer = get_tool_parser(parser).streamer()
    content, calls, last = "", [], 0
    for cut in [*sorted(set(cuts)), len(text)]:
        piece, made = streamer.feed(text[last:cut])
        content, calls, last = content + piece, calls + made, cut
    piece, made = streamer.finish()
    return content + piece, calls + made


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(ALL), data=st.data())
def test_streaming_equals_parse_for_any_cut(case, data) -> None:
    parser, text, content, calls = case
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert _stream(parser, text, cuts) == (content, calls)


def test_content_before_a_call_streams_before_the_call_is_complete() -> None:
    streamer = get_tool_parser("hermes").streamer()
    assert streamer.feed("Checking <tool") == ("Checking ", [])  # "<tool" may open a call: held
    assert streamer.feed('_call>{"name": "now", "arguments": {}}') == ("", [])
    assert streamer.feed("</tool_call>") == ("", [NOW])
    assert streamer.feed("\n") == ("", [])  # whitespace after a call is sent only if text follows
    assert streamer.feed("done") == ("\ndone", [])
    assert streamer.finish() == ("", [])


def test_unknown_parser() -> None:
    with pytest.raises(
        ValueError,
        match="unknown tool-call parser 'nope'; known: deepseek_v3, deepseek_v31, deepseek_v32, ernie45, "
        "functiongemma, gigachat3, glm45, glm47, granite, granite-20b-fc, granite4, hermes, hunyuan_a13b, "
        "internlm, jamba, kimi_k2, llama3_json, llama4_json, llama4_pythonic, longcat, mimo, minimax, "
        "minimax_m2, mistral, olmo3, openai, phi4_mini_json, pythonic, qwen3_coder, qwen3_xml, seed_oss, "
        "step3, step3p5, xlam",
    ):
        get_tool_parser("nope")
    # The CLI's choices (server/server_flags.py stays light, so it names them itself) are the registry's.
    from server.reasoning_parsers import REASONING_PARSERS
    from server.server_flags import REASONING_PARSER_NAMES, TOOL_PARSER_NAMES

    assert sorted(TOOL_PARSER_NAMES) == sorted(TOOL_PARSERS)
    assert sorted(REASONING_PARSER_NAMES) == sorted(REASONING_PARSERS)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "now"}},
]


def _req(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_plans() -> None:
    assert plan_tools(_req(), None) is None
    assert plan_tools(_req(tools=TOOLS, tool_choice="none"), None) is None
    named = plan_tools(
        _req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}), None
    )
    assert named.mode == "named" and named.name == "get_weather"
    assert json.loads(named.constraint.json) == TOOLS[0]["function"]["parameters"]
    assert named.constraint.disable_any_whitespace
    required = plan_tools(_req(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), None)
    schema = json.loads(required.constraint.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]] == [["get_weather"], ["now"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    assert "maxItems" not in json.loads(
        plan_tools(_req(tools=TOOLS, tool_choice="required"), None).constraint.json
    )
    parser = get_tool_parser("hermes")
    auto = plan_tools(_req(tools=TOOLS), parser)  # tools without tool_choice: "auto", as OpenAI
    assert auto.mode == "auto" and auto.parser is parser and auto.constraint is None


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"tools": TOOLS},
            "tool_choice",
            '"auto" tool choice needs the server started with --enable-auto-tool-choice',
        ),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'sometimes' is not one of"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "names function 'x', which is not in tools",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function", "Field required"),
        (
            {"tools": [{"type": "function", "function": {}}], "tool_choice": "required"},
            "tools.0.function.name",
            "Field required",
        ),
        (
            {"tools": [{"type": "retrieval"}], "tool_choice": "required"},
            "tools.0.type",
            "Input should be 'function'",
        ),
    ],
)
def test_plan_errors(fields, param, message) -> None:
    with pytest.raises(APIError) as err:
        plan_tools(_req(**fields), None)
    assert err.value.status == 400 and err.value.param == param and message in err.value.message


def test_read_required() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
    assert read_required(text) == [W, NOW]
    assert read_required("[]") is None and read_required('[{"name": "now"') is None
    content, calls = ToolPlan("required").read(text)
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [
        (W.name, W.arguments),
        (NOW.name, NOW.arguments),
    ]
    assert ToolPlan("required").read("[") == ("[", [])


def test_named_choice_streams_arguments_and_resumes() -> None:
    plan = ToolPlan("named", name="get_weather")
    ct = ChoiceTools(plan)
    content, deltas = ct.feed('{"city"')
    assert content == "" and len(deltas) == 1
    first = deltas[0]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (
        0,
        "function",
        "get_weather",
        '{"city"',
    )
    assert first.id.startswith("call_")
    _, deltas = ct.feed(': "Paris"}')
    assert (
        deltas[0].id is None
        and deltas[0].function.name is None
        and deltas[0].function.arguments == ': "Paris"}'
    )
    resumed = ChoiceTools(plan)
    resumed.skip('{"city"')  # a replica resuming this stream has sent the header already
    _, deltas = resumed.feed(': "Paris"}')
    assert deltas[0].id is None and deltas[0].function.name is None
    assert tool_finish_reason(plan, True, "stop") == "stop"  # a forced call ends like OpenAI's: "stop"
    assert tool_finish_reason(ToolPlan("required"), True, "stop") == "tool_calls"
    assert tool_finish_reason(ToolPlan("required"), True, "length") == "length"
    assert tool_finish_reason(ToolPlan("auto"), False, "stop") == "stop"


def test_auto_choice_numbers_calls_across_deltas() -> None:
    ct = ChoiceTools(ToolPlan("auto", parser=get_tool_parser("hermes")))
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    _, a = ct.feed(text[:50])
    _, b = ct.feed(text[50:])
    assert [(d.index, d.function.name) for d in a + b] == [(0, "now"), (1, "get_weather")]
    assert len({d.id for d in a + b}) == 2 and ct.made_calls


def test_history_tool_call_arguments_reach_templates_decoded() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": '{"tz": "UTC"}'}}
    bad = {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "not json"}}
    msg = template_message({"role": "assistant", "content": None, "tool_calls": [call, bad]})
    assert msg["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}
    assert msg["tool_calls"][1] == bad
    assert call["function"]["arguments"] == '{"tz": "UTC"}'  # the request itself is left alone


def test_qwen3_coder_types_values_by_the_tools_schema() -> None:
    """Qwen3-Coder writes every value as text: the request's tool schema says what it is."""
    from server.tools import validated_tools

    tools = validated_tools(
        [
            {
                "type": "function",
                "function": {
                    "name": "ship",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "zip": {"type": "string"},
                            "count": {"type": "integer"},
                            "express": {"type": "boolean"},
                        },
                    },
                },
            }
        ]
    )
    text = (
        "<tool_call>\n<function=ship>\n<parameter=zip>\n02134\n</parameter>\n<parameter=count>\n2\n"
        "</parameter>\n<parameter=express>\ntrue\n</parameter>\n<parameter=note>\n42\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    typed = get_tool_parser("qwen3_coder").for_tools(tools)
    _, calls = typed.parse(text)
    # "note" is not declared: text, as vLLM's qwen3_coder keeps it
    assert json.loads(calls[0].arguments) == {"zip": "02134", "count": 2, "express": True, "note": "42"}
    as_string = text.replace("02134", "12")
    assert json.loads(typed.parse(as_string)[1][0].arguments)["zip"] == "12"  # a string stays one
    assert json.loads(get_tool_parser("qwen3_coder").parse(as_string)[1][0].arguments)["count"] == "2"


def test_glm45_types_values_by_the_tools_schema() -> None:
    from server.tools import validated_tools

    tools = validated_tools(
        [
            {
                "type": "function",
                "function": {
                    "name": "ship",
                    "parameters": {"type": "object", "properties": {"zip": {"type": "string"}}},
                },
            }
        ]
    )
    text = "<tool_call>ship\n<arg_key>zip</arg_key>\n<arg_value>12</arg_value>\n</tool_call>"
    assert get_tool_parser("glm45").for_tools(tools).parse(text)[1] == [ParsedCall("ship", '{"zip": "12"}')]
    assert get_tool_parser("glm45").parse(text)[1] == [ParsedCall("ship", '{"zip": 12}')]


def test_minimax_m2_types_values_by_the_tools_schema() -> None:
    """MiniMax-M2 writes every value as text: the first of the schema's types it reads as (integer,
    number, boolean, object, array, string), null for null/none/nil, undeclared ones as text."""
    from server.tools import validated_tools

    props = {
        "zip": {"type": "string"},
        "count": {"type": "integer"},
        "ratio": {"type": "number"},
        "express": {"type": "boolean"},
        "opts": {"type": "object"},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "mode": {"enum": [1, 2]},
        "maybe": {"type": ["integer", "null"]},
    }
    tools = validated_tools(
        [
            {
                "type": "function",
                "function": {"name": "ship", "parameters": {"type": "object", "properties": props}},
            }
        ]
    )
    values = {
        "zip": "02134",
        "count": "2",
        "ratio": "1.5",
        "express": "yes",
        "opts": '{"late": true}',
        "either": "two",
        "mode": "2",
        "maybe": "None",
        "note": "42",
    }
    params = "".join(f'<parameter name="{k}">{v}</parameter>' for k, v in values.items())
    text = f'<minimax:tool_call><invoke name="ship">{params}</invoke></minimax:tool_call>'
    _, calls = get_tool_parser("minimax_m2").for_tools(tools).parse(text)
    assert json.loads(calls[0].arguments) == {
        "zip": "02134",
        "count": 2,
        "ratio": 1.5,
        "express": True,
        "opts": {"late": True},
        "either": "two",
        "mode": 2,
        "maybe": None,
        "note": "42",
    }
    # A value that does not read as its type falls to the next, then JSON, then text.
    bad = text.replace(">2<", ">two<").replace(">1.5<", ">inf<")
    got = json.loads(get_tool_parser("minimax_m2").for_tools(tools).parse(bad)[1][0].arguments)
    assert (got["count"], got["ratio"]) == ("two", "inf")
    # Without the request's tools every value is text.
    untyped = json.loads(get_tool_parser("minimax_m2").parse(text)[1][0].arguments)
    assert untyped["count"] == "2" and untyped["maybe"] is None
