"""Tool-call parsers: a model's own way of writing tool calls, read back as OpenAI ``tool_calls``.

With ``tool_choice="auto"`` the model decides whether to call a tool and writes the call in the
format it was trained on; ``--tool-call-parser`` names that format, as in vLLM:

* ``hermes`` (Hermes 2/3, Qwen2.5, QwQ, Qwen3): ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``,
  any number, after optional text;
* ``llama3_json`` (Llama 3.1-3.3; ``llama4_json`` the same): the whole answer is ``{"name": …,
  "parameters": {…}}`` (or several separated by ``;``), optionally after ``<|python_tag|>``;
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": …, "arguments": {…}}``;
* ``deepseek_v3`` (DeepSeek-V3, R1): a ``<｜tool▁calls▁begin｜>`` section of
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` + a fenced JSON block + ``<｜tool▁call▁end｜>``;
* ``deepseek_v31`` (DeepSeek-V3.1): the same section, each call ``NAME<｜tool▁sep｜>{…}``;
* ``kimi_k2``: a ``<|tool_calls_section_begin|>`` section of ``<|tool_call_begin|>functions.NAME:i``
  + ``<|tool_call_argument_begin|>{…}<|tool_call_end|>``;
* ``pythonic`` (Llama 3.2, Llama 4, ToolACE; ``llama4_pythonic`` the same): the whole answer is a
  Python list of calls with literal keyword arguments, ``[get_weather(city="Paris"), now()]``,
  optionally inside ``<|python_start|>`` … ``<|python_end|>``;
* ``granite`` (Granite 3.x): the whole answer is ``<|tool_call|>`` (or ``<tool_call>``) then a JSON
  array of ``{"name": …, "arguments": {…}}``;
* ``phi4_mini_json`` (Phi-4-mini): the whole answer is ``functools[`` + calls as JSON objects + ``]``;
* ``qwen3_coder`` (Qwen3-Coder; ``qwen3_xml``, ``mimo`` and ``step3p5`` the same):
  ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>…</function></tool_call>``, any number,
  after optional text;
  values are text, typed by the request's tool schema (``for_tools``: integers, numbers, booleans,
  objects and arrays decoded, strings kept as written);
* ``glm45`` (GLM-4.5/4.6; ``glm47`` the same, GLM-4.7): ``<tool_call>NAME`` then
  ``<arg_key>K</arg_key><arg_value>V</arg_value>`` pairs and ``</tool_call>``, values typed as
  ``qwen3_coder``'s;
* ``openai`` (gpt-oss, with ``--reasoning-parser openai_gptoss``): a harmony message to
  ``functions.NAME`` whose body is the arguments' JSON;
* ``seed_oss`` (Seed-OSS): ``qwen3_coder``'s calls inside ``<seed:tool_call>`` … ``</seed:tool_call>``;
* ``minimax_m2`` (MiniMax-M2): ``<minimax:tool_call>`` then ``<invoke name="NAME">`` with
  ``<parameter name="KEY">VALUE</parameter>`` each, ``</invoke>`` (one or more), then
  ``</minimax:tool_call>``; values typed by the request's tool schemas;
* ``jamba`` (Jamba 1.5+): ``<tool_calls>`` then a JSON array of ``{"name": …, "arguments": {…}}`` then
  ``</tool_calls>`` (special tokens), after optional text; ``hunyuan_a13b`` (Hunyuan-A13B) the same;
* ``internlm`` (InternLM2/2.5): ``<|action_start|><|plugin|>`` then ``{"name": …, "parameters": {…}}``
  then ``<|action_end|>``, after optional text;
* ``xlam`` (xLAM): the whole answer is a JSON array of calls, bare, fenced (```` ```json ````), after
  ``[TOOL_CALLS]`` or inside ``<tool_call>`` … ``</tool_call>``.
* ``ernie45`` (ERNIE-4.5) and ``granite4`` (Granite 4, special tokens kept): ``hermes``'s calls;
  ``longcat`` (LongCat-Flash) the same inside ``<longcat_tool_call>`` … ``</longcat_tool_call>``;
  ``minimax`` (MiniMax-M1): ``<tool_calls>`` then one ``{"name": …, "arguments": {…}}`` a line then
  ``</tool_calls>``;
* ``step3`` (Step-3): a ``<｜tool_calls_begin｜>`` section of ``<｜tool_call_begin｜>function<｜tool_sep｜>``
  + ``<steptml:invoke name="NAME">`` with ``<steptml:parameter name="KEY">VALUE</steptml:parameter>``
  each + ``</steptml:invoke><｜tool_call_end｜>``, values typed by the tool's schema;
* ``deepseek_v32`` (DeepSeek-V3.2): ``<｜DSML｜function_calls>`` of ``<｜DSML｜invoke name="NAME">`` with
  ``<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>`` each (``string="false"``:
  JSON);
* ``olmo3`` (Olmo 3): the whole answer is ``<function_calls>``, one Python call a line (``null``,
  ``true``, ``false`` allowed), ``</function_calls>``;
* ``granite-20b-fc`` (granite-20b-functioncalling): ``<function_call>`` then a ``{"name": …,
  "arguments": {…}}``, one or more, to the end of the answer, after optional text;
* ``gigachat3`` (GigaChat 3): text, then ``<|message_sep|>`` and ``function call<|role_sep|>`` and one
  call object to the end of the answer;
* ``functiongemma`` (FunctionGemma): ``<start_function_call>call:NAME{KEY:VALUE,…}<end_function_call>``,
  any number, after optional text; strings between ``<escape>`` tokens, numbers, booleans, lists and
  objects raw (``days:3,tags:[<escape>a<escape>]``).

The interfaces and the marker streamer are in ``server/tool_parser_base.py``; the whole-answer
formats in ``server/tool_formats.py``, the text-argument ones (``qwen3_coder``, ``glm45``, ``seed_oss``,
``minimax_m2``) in ``server/tool_formats_typed.py``, the Step-3, DeepSeek-V3.2, Olmo 3, granite-20b-fc,
GigaChat 3 and FunctionGemma formats in ``server/tool_formats_more.py``; the JSON and special-token
formats and the registry here.
"""

from __future__ import annotations

import random
import re
import string
from abc import abstractmethod
from typing import ClassVar

from server.tool_formats import (
    GraniteParser,
    Llama3JsonParser,
    Llama4JsonParser,
    Llama4PythonicParser,
    Phi4MiniJsonParser,
    PythonicParser,
    XlamParser,
    json_call_list,
)
from server.tool_formats_more import (
    DeepSeekV32Parser,
    FunctionGemmaParser,
    GigaChat3Parser,
    Granite20bFCParser,
    MimoParser,
    Olmo3Parser,
    Step3p5Parser,
    Step3Parser,
)
from server.tool_formats_typed import (
    Glm45Parser,
    Glm47Parser,
    MinimaxM2Parser,
    Qwen3CoderParser,
    Qwen3XmlParser,
    SeedOssParser,
)
from server.tool_parser_base import (
    MarkedCallParser,
    MarkerStreamer,
    ParsedCall,
    ToolParser,
    ToolStreamer,
    call_from,
    dumps,
    json_values,
)


class HermesParser(MarkedCallParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def read_body(self, body: str) -> list[ParsedCall] | None:
        values = json_values(body)
        if not values:
            return None
        calls = [call_from(v) for v in values]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


class Ernie45Parser(HermesParser):
    name = "ernie45"  # ERNIE-4.5: Hermes's calls


class Granite4Parser(HermesParser):
    name = "granite4"  # Granite 4: Hermes's calls, its tags special tokens in some checkpoints
    needs_special_tokens = True


class LongcatParser(HermesParser):
    name = "longcat"
    START, END = "<longcat_tool_call>", "</longcat_tool_call>"


class MinimaxParser(HermesParser):
    """MiniMax-M1: ``<tool_calls>`` then one ``{"name": …, "arguments": {…}}`` a line, then
    ``</tool_calls>``."""

    name = "minimax"
    START, END = "<tool_calls>", "</tool_calls>"


class JambaParser(MarkedCallParser):
    name = "jamba"
    needs_special_tokens = True
    START, END = "<tool_calls>", "</tool_calls>"

    def read_body(self, body: str) -> list[ParsedCall] | None:
        return json_call_list(body)


class HunyuanA13BParser(JambaParser):
    name = "hunyuan_a13b"
    needs_special_tokens = False  # its markers are text


class InternlmParser(MarkedCallParser):
    name = "internlm"
    needs_special_tokens = True
    START, END = "<|action_start|><|plugin|>", "<|action_end|>"

    def read_body(self, body: str) -> list[ParsedCall] | None:
        values = json_values(body)
        call = call_from(values[0], ("parameters", "arguments")) if values and len(values) == 1 else None
        return None if call is None else [call]


class MistralParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True
    START = "[TOOL_CALLS]"

    def new_call_id(self) -> str:
        # Mistral's chat templates (and mistral_common) refuse a history whose tool-call ids are not
        # 9 letters or digits, so the next turn of a conversation with these calls would fail.
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    @staticmethod
    def _read(body: str) -> list[ParsedCall] | None:
        values = json_values(body)
        if not values:
            return None
        items = [x for v in values for x in (v if isinstance(v, list) else [v])]
        calls = [call_from(v) for v in items]
        return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        streamer = self.streamer()
        content, _ = streamer.feed(text)
        more, calls = streamer.finish()
        return (content + more, calls) if calls else (text, [])

    def streamer(self) -> ToolStreamer:
        return MarkerStreamer(self.START, None, self._read)


class SectionParser(MarkedCallParser):
    """Calls inside one section of special tokens: ``START`` (call)+ ``END``, each
    call ``CALL_START`` … ``CALL_END`` read by ``read_call``. Only whitespace may separate calls; a
    section cut off at the end of the answer keeps the calls that are complete in it."""

    needs_special_tokens = True
    CALL_START: ClassVar[str]
    CALL_END: ClassVar[str]

    @abstractmethod
    def read_call(self, inner: str) -> ParsedCall | None:
        """The call written between CALL_START and CALL_END, or None if it is not one."""

    def read_body(self, body: str) -> list[ParsedCall] | None:
        calls: list[ParsedCall] = []
        rest = body.strip()
        while rest:
            if not rest.startswith(self.CALL_START):
                return None
            inner, found, rest = rest[len(self.CALL_START) :].partition(self.CALL_END)
            call = self.read_call(inner)
            if call is None:
                return None
            calls.append(call)
            if not found:  # cut off after a complete call body
                break
            rest = rest.strip()
        return calls or None


def _json_object(text: str) -> str | None:
    """``text`` as compact-spaced JSON if it is exactly one JSON object, else None."""
    values = json_values(text)
    if values is None or len(values) != 1 or not isinstance(values[0], dict):
        return None
    return dumps(values[0])


class DeepSeekV3Parser(SectionParser):
    name = "deepseek_v3"
    START, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_START, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

    def read_call(self, inner: str) -> ParsedCall | None:
        kind, found, rest = inner.partition(self.SEP)
        name, _, block = rest.partition("\n")
        block = block.strip()
        if not found or kind.strip() != "function" or not name.strip():
            return None
        if not (block.startswith("```json") and block.endswith("```")) or len(block) < 10:
            return None
        args = _json_object(block[len("```json") : -3])
        return None if args is None else ParsedCall(name.strip(), args)


class DeepSeekV31Parser(DeepSeekV3Parser):
    name = "deepseek_v31"

    def read_call(self, inner: str) -> ParsedCall | None:
        name, found, rest = inner.partition(self.SEP)
        args = _json_object(rest) if found and name.strip() else None
        return None if args is None else ParsedCall(name.strip(), args)


class KimiK2Parser(SectionParser):
    name = "kimi_k2"
    START, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL_START, CALL_END, ARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"

    def read_call(self, inner: str) -> ParsedCall | None:
        call_id, found, rest = inner.partition(self.ARGS)
        # The id is "functions.NAME:INDEX" (or "NAME:INDEX"); the call keeps it, as Kimi's chat
        # template writes it back into the history.
        call_id = call_id.strip()
        name = call_id.removeprefix("functions.").rpartition(":")[0]
        args = _json_object(rest) if found and name else None
        return None if args is None else ParsedCall(name, args, call_id)


class OpenAIHarmonyParser(MarkedCallParser):
    """gpt-oss (vLLM's ``openai``): a harmony message to ``functions.NAME`` whose body is the
    arguments' JSON. With ``--reasoning-parser openai_gptoss`` the content holds such a call as
    ``to=functions.NAME<|message|>ARGS<|call|>``; without it, the raw header (``to=functions.NAME
    <|constrain|>json<|message|>ARGS``, the answer ending at its ``<|call|>``) reads the same."""

    name = "openai"
    needs_special_tokens = True
    START, END = "to=functions.", "<|call|>"

    def read_body(self, body: str) -> list[ParsedCall] | None:
        header, found, args = body.partition("<|message|>")
        name = re.split(r"[\s<]", header.strip(), maxsplit=1)[0]
        arguments = _json_object(args) if found and name else None
        return None if arguments is None else [ParsedCall(name, arguments)]


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (
        HermesParser,
        Llama3JsonParser,
        MistralParser,
        DeepSeekV3Parser,
        DeepSeekV31Parser,
        KimiK2Parser,
        PythonicParser,
        Llama4PythonicParser,
        GraniteParser,
        Phi4MiniJsonParser,
        Qwen3CoderParser,
        Glm45Parser,
        OpenAIHarmonyParser,
        SeedOssParser,
        MinimaxM2Parser,
        JambaParser,
        HunyuanA13BParser,
        InternlmParser,
        XlamParser,
        Llama4JsonParser,
        Qwen3XmlParser,
        Glm47Parser,
        Ernie45Parser,
        Granite4Parser,
        LongcatParser,
        MinimaxParser,
        Step3Parser,
        DeepSeekV32Parser,
        Olmo3Parser,
        Granite20bFCParser,
        GigaChat3Parser,
        FunctionGemmaParser,
        MimoParser,
        Step3p5Parser,
    )
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}"
        ) from None
