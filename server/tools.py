"""Tool calling on /v1/chat/completions: what ``tools`` + ``tool_choice`` make of a request and of
its answer.

* ``"none"``: tools are shown to the chat template, the answer is text.
* a named function (``{"type": "function", "function": {"name": …}}``): the output is constrained
  to that function's ``parameters`` schema (structured outputs, compact JSON) and returned as its
  one call (none when the answer ends before any argument text, say while thinking);
  ``finish_reason`` stays the generation's, as OpenAI's forced calls do. Any model, no parser.
* ``"required"``: the output is constrained to a JSON array of one or more ``{"name", "parameters"}``
  objects, one of the tools each (at most one when ``parallel_tool_calls`` is false); returned as
  calls with ``finish_reason="tool_calls"``. Any model, no parser.
* ``"auto"`` (the default when tools are given): the model writes calls in its trained format and
  the server's ``--tool-call-parser`` reads them (``server/tool_parsers.py``); like vLLM, this needs
  the server started with ``--enable-auto-tool-choice --tool-call-parser NAME``, else a 400.

Streamed, a named call's arguments go out as they are generated; ``required`` and ``auto`` calls go
out whole as each is complete (with their id, name and arguments in one delta).

A cap on the number of calls (``max_calls``: the Responses API's ``max_tool_calls``, not a chat
field) is a ``maxItems`` of the ``required`` array, so the grammar ends the answer after the last
call allowed; an ``auto`` answer is stopped by its stream (``ChoiceTools.capped``,
``chat_stream.stream_chunks``) once the last call allowed is complete, or for a cap of 0 once the model
has written a call, so no token is generated for calls that would be dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from engine.sampling_params import StructuredOutputsParams
from server.chat_protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    ToolSpec,
)
from server.errors import bad_request, validation_error
from server.tool_parser_base import ParsedCall, ToolParser, ToolStreamer, call_from, loads, new_call_id

_TOOLS = TypeAdapter(list[ToolSpec])
_ANY_OBJECT: dict[str, Any] = {"type": "object"}

# What a request without a tool-call parser may send instead of "auto" (the Messages API says it
# in its own words: ``server/serving_messages.py``).
AUTO_ALTERNATIVES = 'send tool_choice "required", "none" or a named function instead'


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "named" | "required" | "auto"
    name: str | None = None  # the named function
    # auto: reads the calls; in every mode, makes the ids of calls the model wrote without one.
    parser: ToolParser | None = None
    constraint: StructuredOutputsParams | None = None  # named, required
    parallel: bool = True  # auto: False (parallel_tool_calls false) keeps the first call only, as vLLM
    max_calls: int | None = None  # at most this many calls; the answer stops at the cap (auto)

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer."""
        if self.mode == "named":
            # No argument text (the answer ended while thinking): no call, as a stream sends none.
            return (None, [self._call(ParsedCall(self.name or "", text))]) if text else (None, [])
        if self.mode == "required":
            calls = read_required(text)
            return (text, []) if calls is None else (None, [self._call(c) for c in calls])
        assert self.parser is not None
        content, parsed = self.parser.parse(text)
        if not parsed:
            return text, []
        if not self.parallel:
            parsed = parsed[:1]
        if self.max_calls is not None:
            parsed = parsed[: self.max_calls]
        return (content or None), [self._call(c) for c in parsed]

    def call_id(self, parsed: ParsedCall | None = None) -> str:
        """The model's own id for the call, else one in the style the parser's model expects."""
        if parsed is not None and parsed.id:
            return parsed.id
        return self.parser.new_call_id() if self.parser is not None else new_call_id()

    def _call(self, parsed: ParsedCall) -> ToolCall:
        return ToolCall(
            id=self.call_id(parsed), function=FunctionCall(name=parsed.name, arguments=parsed.arguments)
        )


def read_required(text: str) -> list[ParsedCall] | None:
    """The calls of a ``required`` answer (a JSON array of {"name", "parameters"}), or None."""
    try:
        items = loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [call_from(item, ("parameters", "arguments")) for item in items]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def required_schema(tools: list[ToolSpec], max_items: int | None) -> dict[str, Any]:
    one_of_the_tools = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _rebased(
                    t.function.parameters or _ANY_OBJECT, f"#/items/anyOf/{i}/properties/parameters"
                ),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, t in enumerate(tools)
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of_the_tools}}
    if max_items is not None:
        schema["maxItems"] = max_items
    return schema


# Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# Keywords whose values map names to schemas (a property may be named "default").
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebased(schema: dict[str, Any], base: str) -> dict[str, Any]:
    """A copy of a tool's parameters schema placed at ``base`` inside a larger one: its local
    references (``#``, ``#/$defs/X``, as pydantic writes nested models) made to point into its new
    place, where they would otherwise name the larger schema's root."""
    copy = json.loads(json.dumps(schema))
    stack: list[Any] = [copy]
    while stack:  # iterative: a deeply nested schema must not exhaust the stack
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                node["$ref"] = base + ref[1:]
            for key, value in node.items():
                if key in _SCHEMA_MAPS and isinstance(value, dict):
                    stack.extend(value.values())
                elif key not in _DATA_KEYWORDS:
                    stack.append(value)
    return copy


def validated_tools(raw: list[dict[str, Any]]) -> list[ToolSpec]:
    """The request's ``tools`` checked as OpenAI function tools (chat requests and ``/tokenize``,
    which renders them as chat does), or the 400 naming the first bad field."""
    try:
        return _TOOLS.validate_python(raw)
    except ValidationError as e:
        errors = [{**err, "loc": ("tools", *err.get("loc", ()))} for err in e.errors()]
        raise validation_error(errors) from None


def plan_tools(
    req: ChatCompletionRequest, parser: ToolParser | None, max_calls: int | None = None
) -> ToolPlan | None:
    """What the request's tools ask of the answer (None: a plain text answer); 400 for bad tools,
    an unknown named function, or ``auto`` on a server without a tool-call parser. ``max_calls``:
    at most this many calls (the Responses API's ``max_tool_calls``)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    tools = validated_tools(req.tools)
    names = [t.function.name for t in tools]
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    if choice == "none":
        return None
    if choice == "required":
        caps = [n for n in (max_calls, 1 if req.parallel_tool_calls is False else None) if n is not None]
        schema = required_schema(tools, max_items=min(caps) if caps else None)
        return ToolPlan("required", parser=parser, constraint=_compact(schema))
    if choice == "auto":
        if parser is None:
            raise bad_request(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                f"--tool-call-parser; {AUTO_ALTERNATIVES}",
                param="tool_choice",
            )
        return ToolPlan(
            "auto",
            parser=parser.for_tools(tools),
            parallel=req.parallel_tool_calls is not False,
            max_calls=max_calls,
        )
    if isinstance(choice, str):
        raise bad_request(
            f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' or a named function",
            param="tool_choice",
        )
    try:
        named = NamedToolChoice.model_validate(choice)
    except ValidationError as e:
        errors = [{**err, "loc": ("tool_choice", *err.get("loc", ()))} for err in e.errors()]
        raise validation_error(errors) from None
    if named.function.name not in names:
        raise bad_request(
            f"tool_choice names function {named.function.name!r}, which is not in tools ({', '.join(names)})",
            param="tool_choice",
        )
    params = tools[names.index(named.function.name)].function.parameters or _ANY_OBJECT
    return ToolPlan("named", name=named.function.name, parser=parser, constraint=_compact(params))


def _compact(schema: dict[str, Any]) -> StructuredOutputsParams:
    # Arguments are read by programs, never by people: no optional whitespace, which also keeps a
    # model from looping on it inside the grammar (a failure seen with any-whitespace JSON).
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


class ChoiceTools:
    """One streamed choice's tool calls: text deltas in, (content, tool-call deltas) out."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.count = 0  # calls sent so far (the index of the next one)
        self.dropped = False  # the model wrote a call past ``plan.max_calls``
        self._streamer: ToolStreamer | None = None
        if plan.mode == "auto":
            assert plan.parser is not None
            self._streamer = plan.parser.streamer()
        elif plan.mode == "required":
            self._streamer = _WholeJSON()

    @property
    def made_calls(self) -> bool:
        return self.count > 0

    @property
    def capped(self) -> bool:
        """The answer has every call it may have (``plan.max_calls``), the last one complete, or
        wrote one past a cap of 0: what the model writes next would be dropped, so it can stop."""
        cap = self.plan.max_calls
        if cap is None or self.plan.mode != "auto":
            return False  # a named answer is one call; a required one ends by its grammar
        return self.dropped or (cap > 0 and self.count >= cap)

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        pieces = self.pieces(text)
        return "".join(content for content, _ in pieces), [c for _, calls in pieces for c in calls]

    def pieces(self, text: str) -> list[tuple[str, list[DeltaToolCall]]]:
        """``feed`` in the order written (``ToolStreamer.pieces``): content, then the calls after it."""
        if self.plan.mode == "named":
            if not text:
                return [("", [])]
            delta = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))
            if self.count == 0:
                delta.id, delta.type, delta.function.name = self.plan.call_id(), "function", self.plan.name
                self.count = 1
            return [("", [delta])]
        assert self._streamer is not None
        return [(content, self._deltas(calls)) for content, calls in self._streamer.pieces(text)]

    @property
    def held(self) -> int:
        """Characters fed that are held back (``ToolStreamer.held``); a named call holds none."""
        return self._streamer.held if self._streamer is not None else 0

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        if self._streamer is None:
            return "", []
        content, calls = self._streamer.finish()
        return content, self._deltas(calls)

    def skip(self, text: str) -> None:
        """Take in text the client already has (a resumed stream): the state moves, nothing is sent."""
        self.feed(text)

    def _deltas(self, calls: list[ParsedCall]) -> list[DeltaToolCall]:
        out = []
        for c in calls:
            if self.count and not self.plan.parallel:
                break  # parallel_tool_calls false: the first call only
            if self.plan.max_calls is not None and self.count >= self.plan.max_calls:
                self.dropped = True
                break
            fn = DeltaFunctionCall(name=c.name, arguments=c.arguments)
            out.append(DeltaToolCall(index=self.count, id=self.plan.call_id(c), type="function", function=fn))
            self.count += 1
        return out


class _WholeJSON(ToolStreamer):
    """``required``: the answer is one JSON array, read when it is complete."""

    def __init__(self) -> None:
        self.parts: list[str] = []  # joined once, at the end
        self.size = 0  # their length

    @property
    def held(self) -> int:
        return self.size

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.parts.append(text)
        self.size += len(text)
        return "", []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        text, self.parts, self.size = "".join(self.parts), [], 0
        calls = read_required(text)
        return (text, []) if calls is None else ("", calls)


def tool_finish_reason(plan: ToolPlan | None, made_calls: bool, reason: str | None) -> str | None:
    """``tool_calls`` for a ``required``/``auto`` answer that made calls and stopped by itself."""
    if plan is not None and plan.mode != "named" and made_calls and reason == "stop":
        return "tool_calls"
    return reason
