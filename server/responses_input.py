"""A Responses API request's input, instructions and tools as chat messages and chat tools.

Shared by the replica (``server/serving_responses.py``, which serves the translated request) and
the router (whose prompt keyer renders the same messages to route by cached prefix), so both see
one prompt. Standard library only: the router imports it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from server.chat_protocol import non_object_schema


class InputError(ValueError):
    """A part of the request this translation cannot take; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _text_of(content: Any, where: str, images: bool) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InputError(f"{where}.content must be a string or a list of text parts", param=where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:
            if not isinstance(part.get("image_url"), str):
                raise InputError(
                    f"{where}.content[{j}]: an input_image needs image_url (a data: or http(s) URL)",
                    param=f"{where}.content",
                )
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
            continue
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            # An earlier answer's refusal (an output message's other part), sent back as history:
            # what the assistant said.
            parts.append({"type": "text", "text": part["refusal"]})
            continue
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise InputError(
                f"{where}.content[{j}]: only text parts are supported (input_text, output_text, refusal)",
                param=f"{where}.content",
            )
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _call_output(output: Any, where: str) -> str:
    """A function_call_output's ``output``: a string, or OpenAI's list of content parts, whose text
    parts make the tool message's text (a chat tool message takes text only)."""
    if isinstance(output, str):
        return output
    if not isinstance(output, list):
        raise InputError(f"{where}.output must be a string or a list of input_text parts", param="input")
    texts = []
    for j, part in enumerate(output):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "input_text" or not isinstance(part.get("text"), str):
            raise InputError(
                f"{where}.output[{j}]: only input_text parts are supported in a function_call_output, "
                f"not {kind!r}",
                param="input",
            )
        texts.append(part["text"])
    return "".join(texts)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its ``reasoning_text`` content, else its summary (as vLLM reads it).
    Encrypted reasoning (OpenAI's, never this server's) has no text here: it is dropped."""
    for field, kind, joiner in (("content", "reasoning_text", ""), ("summary", "summary_text", "\n\n")):
        parts = item.get(field)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(
            isinstance(p, dict) and p.get("type") == kind and isinstance(p.get("text"), str) for p in parts
        ):
            raise InputError(f"{where}.{field} must be a list of {kind} parts", param="input")
        if parts:
            return joiner.join(p["text"] for p in parts)
    return ""


def _with_reasoning(turn: dict[str, Any], reasoning: str) -> None:
    """Earlier thinking onto the assistant turn it was generated with, where the chat template
    renders it (a Qwen3-style one writes it back into the turns after the last user message)."""
    if reasoning:
        turn["reasoning_content"] = turn.get("reasoning_content", "") + reasoning


def chat_messages(instructions: Any, input_: Any, images: bool = False) -> list[dict[str, Any]]:
    """``images``: the model takes images, so ``input_image`` parts become chat ``image_url`` parts
    (otherwise they are refused like any part that is not text).

    A ``reasoning`` item (an earlier answer's, as a client replays ``response.output`` in a tool
    loop, or a stored response's) is the thinking of the assistant turn that follows it: its text
    becomes that turn's ``reasoning_content``, as vLLM passes it. One that no assistant text or call
    follows (a user message or the end comes next) has no turn to go with and is dropped."""
    messages: list[dict[str, Any]] = []
    reasoning = ""  # from reasoning items not yet given to an assistant turn
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(input_, str):
        messages.append({"role": "user", "content": input_})
        return messages
    if not isinstance(input_, list):
        raise InputError("input must be a string or a list of items", param="input")
    for i, item in enumerate(input_):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InputError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InputError(f"{where}.role must be user, system, developer or assistant", param="input")
            messages.append({"role": role, "content": _text_of(item.get("content"), where, images)})
            if role == "assistant":
                _with_reasoning(messages[-1], reasoning)
            reasoning = ""
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise InputError(f"{where}: a function_call needs call_id, name and arguments", param="input")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                # One model turn: the text it wrote before its calls (a message item, then the
                # function_call items, as a response's output lists them) and parallel calls share
                # the assistant turn it was generated as.
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            _with_reasoning(messages[-1], reasoning)
            reasoning = ""
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or "output" not in item:
                raise InputError(f"{where}: a function_call_output needs call_id and output", param="input")
            output = _call_output(item["output"], where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
            reasoning = ""
        elif kind == "reasoning":
            reasoning += _reasoning_text(item, where)
        else:
            raise InputError(f"{where}: input items of type {kind!r} are not supported", param="input")
    return messages


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def continues_final_message(input_: Any) -> bool:
    """vLLM's partial answer: an ``input`` whose last item is an assistant message still
    ``in_progress`` or ``incomplete`` (a response cut at ``max_output_tokens``, sent back) is
    continued, as chat's ``continue_final_message``, rather than answered by a new turn."""
    if not isinstance(input_, list) or not input_ or not isinstance(input_[-1], dict):
        return False
    last = input_[-1]
    return (
        last.get("type", "message") == "message"
        and last.get("role") == "assistant"
        and last.get("status") in ("in_progress", "incomplete")
    )


def input_items(input_: Any) -> list[dict[str, Any]]:
    """A request's ``input`` as the items a stored response keeps (and ``input_items`` lists): a
    string becomes a user message; messages get an ``id`` and their text as content parts, as
    OpenAI lists them. Lenient: ``chat_messages`` is what refuses bad input."""
    if isinstance(input_, str):
        input_ = [{"role": "user", "content": input_}]
    if not isinstance(input_, list):
        return []
    items = []
    for item in input_:
        if not isinstance(item, dict):
            continue
        item = dict(item)
        kind = item.setdefault("type", "message")
        if not isinstance(kind, str):
            continue  # not an item (chat_messages says so)
        item.setdefault("id", f"{_ID_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex}")
        if kind in ("message", "function_call", "function_call_output"):
            # OpenAI's listed items carry a status (its SDK's types require it on calls and outputs)
            item.setdefault("status", "completed")
        if kind == "message":
            if isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            if isinstance(item.get("content"), list):
                # An assistant's output_text part as OpenAI lists it: with its (here empty) annotations.
                item["content"] = [
                    {**part, "annotations": []}
                    if isinstance(part, dict)
                    and part.get("type") == "output_text"
                    and "annotations" not in part
                    else part
                    for part in item["content"]
                ]
        items.append(item)
    return items


def chat_tools(tools_: Any, choice: Any) -> tuple[list[dict[str, Any]] | None, Any]:
    tools = None
    if tools_ is not None:
        if not isinstance(tools_, list):
            raise InputError("tools must be a list", param="tools")
        tools = []
        for i, tool in enumerate(tools_):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise InputError(
                    f"tools[{i}]: only function tools are supported, not {kind!r}", param="tools"
                )
            # Checked here, as the client wrote them: the chat request would name its own fields
            # (tools.0.function.name) in the error.
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise InputError(f"tools[{i}]: a function tool needs a name", param="tools")
            if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
                raise InputError(f"tools[{i}].parameters must be a JSON schema object", param="tools")
            if tool.get("parameters") is not None and (why := non_object_schema(tool["parameters"])):
                raise InputError(f"tools[{i}].parameters: {why}", param="tools")
            function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
            tools.append({"type": "function", "function": function})
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return _allowed_tools(tools, choice)
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InputError(
                'tool_choice must be "auto", "none", "required", a function by name or allowed_tools',
                param="tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def _allowed_tools(
    tools: list[dict[str, Any]] | None, choice: dict[str, Any]
) -> tuple[list[dict[str, Any]], str]:
    """``{"type": "allowed_tools", "mode": "auto" | "required", "tools": [{"type": "function",
    "name"}, ...]}``: the answer may call (``required``: must call) only these of ``tools``. OpenAI
    keeps the others in the prompt (for its prompt cache) and keeps the model from calling them; a
    chat template and a tool-call parser know no such split, so here the others are left out of
    the chat request, which then offers exactly the calls the answer may make."""
    mode, allowed = choice.get("mode"), choice.get("tools")
    if mode not in ("auto", "required"):
        raise InputError('tool_choice.mode must be "auto" or "required"', param="tool_choice")
    if not isinstance(allowed, list) or not allowed:
        raise InputError("tool_choice.tools must be a non-empty list of tools", param="tool_choice")
    offered = {t["function"]["name"]: t for t in tools or ()}
    names: list[str] = []
    for j, tool in enumerate(allowed):
        name = tool.get("name") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(name, str):
            raise InputError(
                f"tool_choice.tools[{j}] must be a function tool by name ({{'type': 'function', 'name': ...}})",
                param="tool_choice",
            )
        if name not in offered:
            raise InputError(
                f"tool_choice.tools[{j}] names function {name!r}, which is not in tools", param="tool_choice"
            )
        if name not in names:
            names.append(name)
    return [t for name, t in offered.items() if name in names], mode


def without_oldest_turns(items: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """The conversation ``items`` with ever more of its oldest turns dropped, for ``truncation:
    auto`` (OpenAI drops items from the beginning of a conversation that exceeds the context): each
    cut is right before a user message, so no function call loses its output nor an output its call;
    system and developer messages before the cut are kept (they say how to answer, not what was said)."""
    for i in range(1, len(items)):
        item = items[i]
        if item.get("type", "message") == "message" and item.get("role") == "user":
            kept = [
                m
                for m in items[:i]
                if m.get("type", "message") == "message" and m.get("role") in ("system", "developer")
            ]
            yield kept + items[i:]
