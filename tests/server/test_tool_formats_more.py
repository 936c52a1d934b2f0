"""The tool-call parsers for ERNIE-4.5, Granite 4, LongCat, MiniMax-M1, Step-3, DeepSeek-V3.2, Olmo 3,
granite-20b-fc, GigaChat 3, FunctionGemma, MiMo and Step-3.5, without a server: exact (content,
calls) of whole answers, text that is not a well-formed call kept as content, the same result
streamed however the text is cut (a character at a time included), and the per-choice tool state a
stream sends."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.tool_parsers import TOOL_PARSERS, ParsedCall, get_tool_parser
from server.tools import ChoiceTools, plan_tools, validated_tools
from tests.server.test_tool_parsers import TOOLS, _req, _stream

W = ParsedCall("get_weather", '{"city": "Paris"}')
NOW = ParsedCall("now", "{}")
HERMES_W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
HERMES_NOW = '{"name": "now", "arguments": {}}'
STEP3_CALL = "<｜tool_call_begin｜>function<｜tool_sep｜>"
STEP3_W = (
    f'{STEP3_CALL}<steptml:invoke name="get_weather"><steptml:parameter name="city">'
    "Paris</steptml:parameter></steptml:invoke><｜tool_call_end｜>"
)
STEP3_NOW = f'{STEP3_CALL}<steptml:invoke name="now"></steptml:invoke><｜tool_call_end｜>'
DSML_W = (
    '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>"
)

CASES = {
    "ernie45": [
        (f"Let me check.\n<tool_call>\n{HERMES_W}\n</tool_call>\n", "Let me check.\n", [W]),
        (f"<tool_call>{HERMES_W}</tool_call>\n<tool_call>{HERMES_NOW}</tool_call>", "", [W, NOW]),
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ],
    "granite4": [
        (f"Sure. <tool_call>{HERMES_W}</tool_call> Done.", "Sure.  Done.", [W]),
        ('<tool_call>{"name": "now", "arguments": "{}"}</tool_call>', "", [NOW]),  # arguments as text
        ("no call <tool_", "no call <tool_", []),
    ],
    "longcat": [
        (f"Checking.<longcat_tool_call>{HERMES_W}</longcat_tool_call>", "Checking.", [W]),
        (f"<tool_call>{HERMES_NOW}</tool_call>", f"<tool_call>{HERMES_NOW}</tool_call>", []),  # not its tags
    ],
    "minimax": [
        (f"Checking.\n<tool_calls>\n{HERMES_W}\n{HERMES_NOW}\n</tool_calls>", "Checking.\n", [W, NOW]),
        ("<tool_calls>\n[1]\n</tool_calls>", "<tool_calls>\n[1]\n</tool_calls>", []),
    ],
    "step3": [
        (f"Checking.<｜tool_calls_begin｜>{STEP3_W}\n{STEP3_NOW}<｜tool_calls_end｜>", "Checking.", [W, NOW]),
        (
            f"<｜tool_calls_begin｜>{STEP3_NOW}<｜tool_call_begin｜>function<｜tool_sep｜><steptml:inv",
            "",
            [NOW],
        ),
        (  # a call that is not a function's: all of it stays text
            '<｜tool_calls_begin｜><｜tool_call_begin｜>plugin<｜tool_sep｜><steptml:invoke name="now">'
            "</steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>",
            '<｜tool_calls_begin｜><｜tool_call_begin｜>plugin<｜tool_sep｜><steptml:invoke name="now">'
            "</steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>",
            [],
        ),
        (
            "<｜tool_calls_begin｜><｜tool_call_begin｜>function",
            "<｜tool_calls_begin｜><｜tool_call_begin｜>function",
            [],
        ),
        (  # a value holding "<" (code, markup) is read, not dropped
            f'<｜tool_calls_begin｜>{STEP3_CALL}<steptml:invoke name="run"><steptml:parameter name="code">'
            'if a < b: print("<b>")</steptml:parameter></steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>',
            "",
            [ParsedCall("run", json.dumps({"code": 'if a < b: print("<b>")'}))],
        ),
    ],
    "deepseek_v32": [
        (
            f'Checking.\n\n<｜DSML｜function_calls>\n{DSML_W}\n<｜DSML｜invoke name="now">\n</｜DSML｜invoke>\n'
            "</｜DSML｜function_calls>",
            "Checking.\n\n",
            [W, NOW],
        ),
        (  # string="false": JSON values; text where they are not JSON
            '<｜DSML｜function_calls><｜DSML｜invoke name="book"><｜DSML｜parameter name="days" string="false">3'
            '</｜DSML｜parameter><｜DSML｜parameter name="opts" string="false">{"late": true}</｜DSML｜parameter>'
            '<｜DSML｜parameter name="zip" string="true">02134</｜DSML｜parameter><｜DSML｜parameter name="x" '
            'string="false">soon</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜function_calls>',
            "",
            [ParsedCall("book", '{"days": 3, "opts": {"late": true}, "zip": "02134", "x": "soon"}')],
        ),
        (f'<｜DSML｜function_calls>{DSML_W}<｜DSML｜invoke name="n', "", [W]),  # cut off in the second
        (
            "<｜DSML｜function_calls>hello</｜DSML｜function_calls>",
            "<｜DSML｜function_calls>hello</｜DSML｜function_calls>",
            [],
        ),
    ],
    "olmo3": [
        ("<function_calls>\nget_weather(city='Paris')\nnow()\n</function_calls>", "", [W, NOW]),
        (
            "<function_calls>book(ok=true, note=null, tags=[false, 'x'], opts={'a': -1})</function_calls>",
            "",
            [ParsedCall("book", '{"ok": true, "note": null, "tags": [false, "x"], "opts": {"a": -1}}')],
        ),
        (
            "<function_calls>\nget_weather('Paris')\n</function_calls>",
            "<function_calls>\nget_weather('Paris')\n</function_calls>",
            [],
        ),
        (
            "<function_calls>\nrun(x=os.getcwd())",
            "<function_calls>\nrun(x=os.getcwd())",
            [],
        ),  # never evaluated
        (  # a string over several lines kept as written; a call written over several lines
            "<function_calls>\nwrite(text='''one\ntwo''')\nget_weather(\n    city='Paris',\n)\n</function_calls>",
            "",
            [ParsedCall("write", json.dumps({"text": "one\ntwo"})), W],
        ),
        ("get_weather(city='Paris')", "get_weather(city='Paris')", []),  # no tag: text
        ("It is sunny.", "It is sunny.", []),
    ],
    "granite-20b-fc": [
        (f"<function_call> {HERMES_W}\n<function_call> {HERMES_NOW}", "", [W, NOW]),
        (f"Sure. <function_call>{HERMES_NOW}", "Sure. ", [NOW]),
        ('<function_call> {"name": "now"', '<function_call> {"name": "now"', []),  # cut off
        ("<function_call> [1]", "<function_call> [1]", []),
        (  # the marker inside an argument is the argument's text
            '<function_call> {"name": "say", "arguments": {"text": "<function_call> is the tag"}}'
            f"\n<function_call>{HERMES_NOW}",
            "",
            [ParsedCall("say", '{"text": "<function_call> is the tag"}'), NOW],
        ),
    ],
    "gigachat3": [
        (f"Checking.<|message_sep|>\n\nfunction call<|role_sep|>\n{HERMES_W}", "Checking.", [W]),
        (f"<|message_sep|>function call<|role_sep|>\n{HERMES_NOW}</s>", "", [NOW]),
        (
            '<|message_sep|>function call<|role_sep|>\n{"name": "now"}',  # no arguments: not a call
            '<|message_sep|>function call<|role_sep|>\n{"name": "now"}',
            [],
        ),
        ("Hello.<|message_sep|>\n\nsomething else", "Hello.<|message_sep|>\n\nsomething else", []),
        (  # a string written with raw newlines and tabs (vLLM reads GigaChat's JSON leniently too)
            '<|message_sep|>function call<|role_sep|>\n{"name": "write", "arguments": {"text": "a\n\tb"}}',
            "",
            [ParsedCall("write", json.dumps({"text": "a\n\tb"}))],
        ),
    ],
    "functiongemma": [
        (
            "Checking.<start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>"
            "<start_function_call>call:now{}<end_function_call>",
            "Checking.",
            [W, NOW],
        ),
        (
            '<start_function_call>call:book{days:<escape>3<escape>,opts:<escape>{"a": [1]}<escape>,'
            "who:<escape>Ann<escape>}<end_function_call>",
            "",
            [ParsedCall("book", '{"days": 3, "opts": {"a": [1]}, "who": "Ann"}')],
        ),
        (  # only strings are between <escape> tokens: numbers, booleans, lists and objects are raw
            "<start_function_call>call:book{days:3,late:false,note:null,rate:-1.5,tags:[<escape>a, b<escape>,2],"
            "opts:{<escape>seat<escape>:<escape>12A<escape>,near:{exit:true}},who:<escape>Ann<escape>}"
            "<end_function_call>",
            "",
            [
                ParsedCall(
                    "book",
                    json.dumps(
                        {
                            "days": 3,
                            "late": False,
                            "note": None,
                            "rate": -1.5,
                            "tags": ["a, b", 2],
                            "opts": {"seat": "12A", "near": {"exit": True}},
                            "who": "Ann",
                        }
                    ),
                )
            ],
        ),
        (
            "<start_function_call>call:get-weather{city:<escape>Paris<escape>}<end_function_call>",
            "",
            [ParsedCall("get-weather", '{"city": "Paris"}')],
        ),
        ("<start_function_call>call:now{", "", [NOW]),  # cut off
        ("<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:", "", [W]),  # cut off
        (  # not the format: text
            "<start_function_call>call:now{} and more<end_function_call>",
            "<start_function_call>call:now{} and more<end_function_call>",
            [],
        ),
        (
            "<start_function_call>get_weather<end_function_call>",
            "<start_function_call>get_weather<end_function_call>",
            [],
        ),
    ],
    # vLLM's names for Qwen3-Coder's format, as MiMo and Step-3.5 write it
    "mimo": [("Sure.<tool_call>\n<function=now>\n</function>\n</tool_call>", "Sure.", [NOW])],
    "step3p5": [
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
            "</tool_call>",
            "",
            [W],
        ),
        ("<tool_call>not a function</tool_call>", "<tool_call>not a function</tool_call>", []),
    ],
}
ALL = [(name, *case) for name, cases in CASES.items() for case in cases]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL)
def test_parse(parser, text, content, calls) -> None:
    assert get_tool_parser(parser).parse(text) == (content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL)
def test_streamed_a_character_at_a_time(parser, text, content, calls) -> None:
    assert _stream(parser, text, list(range(len(text)))) == (content, calls)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(ALL), data=st.data())
def test_streaming_equals_parse_for_any_cut(case, data) -> None:
    parser, text, content, calls = case
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert _stream(parser, text, cuts) == (content, calls)


def test_markers_are_held_until_decided() -> None:
    streamer = get_tool_parser("functiongemma").streamer()
    assert streamer.feed("Checking <start_function") == ("Checking ", [])
    assert streamer.feed("_call>call:now{}<end_function_") == ("", [])
    assert streamer.feed("call>") == ("", [NOW])
    streamer = get_tool_parser("gigachat3").streamer()
    assert streamer.feed("Hi.<|message") == ("Hi.", [])
    assert streamer.feed(f"_sep|>function call<|role_sep|>\n{HERMES_NOW}") == ("", [])
    assert streamer.finish() == ("", [NOW])


def test_special_tokens_kept_where_the_markers_are_tokens() -> None:
    kept = {name for name, parser in TOOL_PARSERS.items() if parser.needs_special_tokens}
    assert {"granite4", "step3", "gigachat3", "functiongemma"} <= kept
    assert not {"ernie45", "longcat", "minimax", "deepseek_v32", "olmo3", "granite-20b-fc"} & kept


def test_step3_types_values_by_the_tools_schema() -> None:
    """As vLLM's step3 parser casts: integer, number (a float), boolean, null; text otherwise."""
    props = {
        "zip": {"type": "string"},
        "count": {"type": "integer"},
        "ratio": {"type": "number"},
        "express": {"type": "boolean"},
        "gone": {"type": "null"},
    }
    tools = validated_tools(
        [
            {
                "type": "function",
                "function": {"name": "ship", "parameters": {"type": "object", "properties": props}},
            }
        ]
    )
    values = {"zip": "02134", "count": "2", "ratio": "2", "express": "True", "gone": "null", "note": "42"}
    params = "".join(f'<steptml:parameter name="{k}"> {v} </steptml:parameter>' for k, v in values.items())
    text = (
        "<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜>"
        f'<steptml:invoke name="ship">{params}</steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>'
    )
    _, calls = get_tool_parser("step3").for_tools(tools).parse(text)
    assert json.loads(calls[0].arguments) == {
        "zip": "02134",
        "count": 2,
        "ratio": 2.0,
        "express": True,
        "gone": None,
        "note": "42",
    }
    bad = text.replace("> 2 <", "> two <").replace("> True <", "> yes <")
    got = json.loads(get_tool_parser("step3").for_tools(tools).parse(bad)[1][0].arguments)
    assert (got["count"], got["ratio"], got["express"]) == ("two", "two", "yes")
    assert json.loads(get_tool_parser("step3").parse(text)[1][0].arguments)["count"] == "2"  # no tools


@pytest.mark.parametrize("name", sorted(CASES))
def test_tool_choice_modes_with_each_parser(name) -> None:
    """``auto`` reads the model's format through the parser (calls numbered across deltas, each sent
    whole with an id); ``required`` and a named function are constrained, the parser not needed."""
    parser = get_tool_parser(name)
    auto = plan_tools(_req(tools=TOOLS), parser)
    assert auto.mode == "auto" and auto.constraint is None
    text, content, calls = next((t, c, k) for t, c, k in CASES[name] if len(k) >= 1)
    tools = ChoiceTools(auto)
    sent, deltas = "", []
    for i in range(0, len(text), 5):
        piece, made = tools.feed(text[i : i + 5])
        sent, deltas = sent + piece, deltas + made
    piece, made = tools.finish()
    sent, deltas = sent + piece, deltas + made
    assert sent == content
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (i, c.name, c.arguments) for i, c in enumerate(calls)
    ]
    assert all(d.id and d.type == "function" for d in deltas) and len({d.id for d in deltas}) == len(deltas)
    required = plan_tools(_req(tools=TOOLS, tool_choice="required"), parser)
    assert required.mode == "required" and required.constraint is not None
    named = plan_tools(
        _req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}), parser
    )
    assert named.mode == "named" and named.name == "now"


@pytest.mark.parametrize("name", sorted(set(CASES) - {"mimo"}))  # mimo: qwen3_coder's own tests
def test_arguments_nested_past_the_stack_never_fail_the_answer(name) -> None:
    """A model looping on ``[`` (JSON or Python nested deeper than the stack) gives text or a call,
    never an exception, whole or streamed."""
    text, _, _ = next(case for case in CASES[name] if case[2])
    deep = text.replace("Paris", "[" * 100_000 + "]" * 100_000)
    if deep == text:
        deep = text.replace("{}", "{" + '"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert deep != text
    whole = get_tool_parser(name).parse(deep)
    assert _stream(name, deep, [len(deep) // 2]) == whole
