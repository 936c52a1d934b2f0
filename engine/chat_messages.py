"""Chat messages as chat templates see them, built the same way by every renderer of a chat (the
server, ``LLM.chat`` and the router's prompt keyer), so they agree on every token. Torch-free.

Never renders anything: ``engine.chat_template`` does that.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# Content part types that carry an image (OpenAI chat's, the Responses API's, and the plain form
# templates see: transformers' ``{"type": "image"}``).
IMAGE_PART_TYPES = ("image_url", "input_image", "image", "image_pil")


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """One chat message as templates see it: ``role``; ``content`` ("" when absent or null, text
    parts, and an assistant's ``refusal`` parts as vLLM reads them, as ``{"type": "text", "text":
    …}`` parts); ``name``, ``tool_call_id``, ``tool_calls`` and an assistant's earlier reasoning
    (``reasoning_content`` / ``reasoning``, which Qwen3-style templates write back into the turns
    after the last user message) when set; nothing else. The server and the router's
    ``TokenKeyer`` both render through this, so they agree on every token and block hash of a chat
    prompt."""
    out: dict[str, Any] = {"role": message.get("role")}
    content = message.get("content")
    if isinstance(content, list):
        out["content"] = [
            {"type": "image"}
            if part.get("type") in IMAGE_PART_TYPES
            else {"type": "text", "text": part.get("refusal" if part.get("type") == "refusal" else "text")}
            for part in content
        ]
    else:
        out["content"] = content if content is not None else ""
    for key in ("name", "tool_call_id", "reasoning_content", "reasoning"):
        if message.get(key) is not None:
            out[key] = message[key]
    calls = message.get("tool_calls")
    if calls is not None:
        out["tool_calls"] = [_template_tool_call(c) for c in calls] if isinstance(calls, list) else calls
    return out


class JsonArguments(dict):
    """A tool call's decoded ``arguments`` that still reads as its JSON text where a template
    treats it as text. Templates disagree: Qwen2.5, Llama 3.1 and Hermes write ``arguments |
    tojson`` or iterate it (so they need the object, as vLLM passes it), while DeepSeek-V3/R1
    concatenate it (``'```json\n' + arguments``: the client's JSON text, as transformers renders
    the OpenAI form). Both get what they expect; ``| tojson`` and ``is mapping`` see a dict."""

    def __init__(self, value: Mapping[str, Any], text: str) -> None:
        super().__init__(value)
        self.text = text

    def __str__(self) -> str:
        return self.text

    def __add__(self, other: object) -> str:
        if isinstance(other, str):
            return self.text + other
        return NotImplemented

    def __radd__(self, other: object) -> str:
        if isinstance(other, str):
            return other + self.text
        return NotImplemented


def _template_tool_call(call: Any) -> Any:
    """An assistant's earlier tool call as templates expect it. OpenAI clients send ``arguments``
    as JSON text; templates (Qwen2.5, Llama 3.1, Hermes) write it with ``| tojson`` or iterate it,
    so, as vLLM does, they get the decoded object, empty or null arguments as ``{}`` (text that is
    not JSON is left as it is). An object keeps its JSON text for templates that concatenate it
    (``JsonArguments``)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    raw = function.get("arguments")
    if raw is None or raw == "":
        arguments: Any = JsonArguments({}, "{}")
    elif isinstance(raw, str):
        try:
            arguments = json.loads(raw)
        except ValueError:
            return call
        if isinstance(arguments, dict):
            arguments = JsonArguments(arguments, raw)
    elif isinstance(raw, dict):
        arguments = JsonArguments(raw, json.dumps(raw, ensure_ascii=False))
    else:
        return call
    return {**call, "function": {**function, "arguments": arguments}}
