"""The request side of Anthropic's Messages API (``POST /v1/messages``), as vLLM and SGLang take it.

Requests are validated here and translated into chat completions requests by
``server/serving_messages.py``; errors are answered in Anthropic's shape (``{"type": "error",
"error": {"type", "message"}}``), with Anthropic's error type for each status.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import (
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from server.anthropic_content import (
    _SYSTEM_BLOCKS,
    DocumentBlock,
    ImageBlock,
    Message,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    _blocks,
    _check_block,
)
from server.errors import APIError
from server.protocol import Resume, _Request

# Anthropic's error type for each status it answers with (its API reference, "Errors"; 504 as
# the SDK's GatewayTimeoutError object names it).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# Anthropic answers a lack of capacity with 529 ``overloaded_error`` (its SDKs: ``OverloadedError``,
# retried, Retry-After honoured) and never with 503; its 429 ``rate_limit_error`` is one account's
# rate limit, which ferry has none of. Ferry's capacity answers, a full queue (429: every client
# alike) and a server draining, not ready or unhealthy (503), are therefore 529 on the Messages API,
# their Retry-After kept, from the replica and the router alike.
_CAPACITY_STATUSES = frozenset({429, 503})
OVERLOADED = 529
# A request that ran past ``--request-timeout`` is ferry's 408 (as OpenAI's API answers it) and
# Anthropic's 504 ``timeout_error`` (its SDKs: ``GatewayTimeoutError``, retried as the 408 is).
# Such an answer is the request's own, not a gateway's: it says so in REQUEST_TIMEOUT_HEADER, so
# that a router relays it as it is (another replica would run the request as long again) and does
# not count it against the replica (``router/relay.py``).
REQUEST_TIMEOUT = 408
TIMED_OUT = 504
REQUEST_TIMEOUT_HEADER = "x-ferry-request-timeout"
# Ferry's error codes for which Anthropic's API answers a status of its own with a machine-readable
# ``error.details.error_code`` (its SDKs raise a class per code: ``RequestBodyEncodingUnsupportedError``).
_DETAILED_CODES = {"unsupported_content_encoding": (400, "request_body_encoding_unsupported")}


def anthropic_status(status: int, code: str | None = None) -> int:
    """The status the Messages API answers for one of ferry's (``OVERLOADED`` for a capacity one,
    ``TIMED_OUT`` for a request that ran past its time), or for its error ``code`` where Anthropic
    answers that case with a status of its own (``_DETAILED_CODES``)."""
    if code in _DETAILED_CODES:
        return _DETAILED_CODES[code][0]
    if status == REQUEST_TIMEOUT:
        return TIMED_OUT
    return OVERLOADED if status in _CAPACITY_STATUSES else status


def error_type(status: int) -> str:
    """Anthropic's error type of an answer with ``status`` (one of ferry's: see ``anthropic_status``)."""
    status = anthropic_status(status)
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_details(code: str | None) -> dict[str, str] | None:
    """Anthropic's ``error.details`` for one of ferry's error codes, None where it has none."""
    detailed = _DETAILED_CODES.get(code) if code is not None else None
    return {"error_code": detailed[1]} if detailed is not None else None


def error_body(error: APIError, request_id: str | None = None) -> dict[str, Any]:
    """Anthropic's error body; an answer's (not a stream's ``error`` event) names its request, as
    Anthropic's do (``request_id``, also the ``request-id`` header: the SDK's ``_request_id``)."""
    body: dict[str, Any] = {
        "type": "error",
        "error": {"type": error_type(error.status), "message": error.message},
    }
    details = error_details(error.code)
    if details is not None:
        body["error"]["details"] = details
    if request_id is not None:
        body["request_id"] = request_id
    return body


def error_response(error: APIError, request_id: str | None = None) -> JSONResponse:
    status = anthropic_status(error.status, error.code)
    headers = error.headers
    if error.status == REQUEST_TIMEOUT:
        headers = {**(headers or {}), REQUEST_TIMEOUT_HEADER: "1"}
    return JSONResponse(error_body(error, request_id), status_code=status, headers=headers)


def _message_error(model: str, messages: list[Message], index: int, problem: str) -> ValidationError:
    """A validation error of message ``index`` itself, so that the 400 names it (``messages.i``)."""
    error = InitErrorDetails(
        type=PydanticCustomError("value_error", problem), loc=(index,), input=messages[index].content
    )
    return ValidationError.from_exception_data(model, [error])


class Tool(_Request):
    """A client tool: Anthropic's ``custom`` type, which its clients may leave out. Anthropic's own
    tools (``web_search_20250305``, ``bash_20250124``…) run on its servers or have schemas only its
    models know: refused by their type, not as a tool missing its ``input_schema``."""

    type: Literal["custom"] | None = None
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, data: Any) -> Any:
        kind = data.get("type", "custom") if isinstance(data, dict) else "custom"
        if kind not in ("custom", None):
            raise ValueError(f"tool type {kind!r} is not supported: this server runs client tools only")
        return data


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs the tool's name")
        return self


class Metadata(_Request):
    user_id: StrictStr | None = None


# Claude Code opens its system prompt with a line "x-anthropic-billing-header: cc_version=…;
# cch=…;" whose hash changes with every request. It tells the model nothing, and at the head of the
# prompt it would defeat the prefix cache for the whole conversation: dropped, as vLLM and SGLang do.
_BILLING_HEADER = "x-anthropic-billing-header:"


def _unbilled(text: str) -> str:
    return text.partition("\n")[2] if text.startswith(_BILLING_HEADER) else text


# ``thinking.type`` -> the template's ``enable_thinking`` (Qwen3's and most hybrid models' switch).
_THINKING_SWITCH = {"enabled": True, "adaptive": True, "disabled": False}


class OutputFormat(_Request):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    """Anthropic's ``output_config``: ``format`` constrains the answer's text to a JSON schema (as
    the chat request's ``response_format``); ``effort`` is the chat request's ``reasoning_effort``
    (the template's variable, as vLLM passes it), so it renders in the counted prompt too."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class _Conversation(_Request):
    """What both endpoints render: the conversation, its system prompt and its tools."""

    model: StrictStr
    messages: list[Message] = Field(min_length=1)
    system: StrictStr | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    # Anthropic's switch of the model's thinking: ``disabled`` turns a hybrid template's thinking
    # off, ``enabled`` / ``adaptive`` on (``enable_thinking``, as ``reasoning_effort`` does on the
    # chat API), unless ``chat_template_kwargs`` set it; left out, the template's default holds.
    thinking: dict[str, Any] | None = None
    # vLLM's: the chat template's variables (Qwen3's enable_thinking, DeepSeek-V3.1's thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    output_config: OutputConfig | None = None

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, messages: list[Message]) -> list[Message]:
        """Anthropic's rule: every message has content but a final assistant one after others (an
        empty prefill, answered as if it were not there). The chat translation would drop an empty
        message unsaid, or leave no message at all and answer with the chat request's error."""
        for i, m in enumerate(messages):
            if m.content or (i == len(messages) - 1 and i > 0 and m.role == "assistant"):
                continue
            problem = (
                "the only message must have non-empty content"
                if len(messages) == 1
                else "all messages must have non-empty content except for the optional final assistant message"
            )
            raise _message_error(cls.__name__, messages, i, problem)
        return messages

    @field_validator("messages")
    @classmethod
    def _results_answer_calls(cls, messages: list[Message]) -> list[Message]:
        """Anthropic's pairing of calls and results: each ``tool_result`` answers a ``tool_use`` of
        the assistant turn just before it, and the turn after an assistant turn with ``tool_use``
        blocks answers every one of them (a conversation may end at the calls). Consecutive
        messages of one role are one turn, as Anthropic combines them. The chat translation would
        otherwise show the model a result of no call, or a call that was never answered."""
        calls: dict[str, int] = {}  # the last assistant turn's tool_use ids -> their message
        answered: set[str] = set()
        for i, m in enumerate(messages):
            if m.role == "assistant":
                if i > 0 and messages[i - 1].role == "user":
                    calls, answered = {}, set()  # a new assistant turn
                calls.update({b.id: i for b in _blocks(m) if isinstance(b, ToolUseBlock)})
                continue
            for j, b in enumerate(_blocks(m)):
                if isinstance(b, ToolResultBlock):
                    if b.tool_use_id not in calls:
                        problem = (
                            f"content block {j} (tool_result): unexpected `tool_use_id` found in `tool_result` "
                            f"blocks: {b.tool_use_id}. Each `tool_result` block must have a corresponding "
                            "`tool_use` block in the previous message."
                        )
                        raise _message_error(cls.__name__, messages, i, problem)
                    answered.add(b.tool_use_id)
            if i + 1 < len(messages) and messages[i + 1].role == "user":
                continue  # the user's turn goes on
            missing = [call for call in calls if call not in answered]
            if missing:
                problem = (
                    f"`tool_use` ids were found without `tool_result` blocks immediately after: "
                    f"{', '.join(missing)}. Each `tool_use` block must have a corresponding `tool_result` "
                    "block in the next message."
                )
                raise _message_error(cls.__name__, messages, calls[missing[0]], problem)
            calls = {}
        return messages

    @field_validator("system", mode="before")
    @classmethod
    def _text_blocks(cls, value: Any) -> Any:
        for i, block in enumerate(value if isinstance(value, list) else ()):
            _check_block(block, _SYSTEM_BLOCKS, "block", i)
        return value

    @property
    def system_text(self) -> str | None:
        """The system prompt, without Claude Code's billing line (``_BILLING_HEADER``)."""
        if self.system is None:
            return None
        parts = [self.system] if isinstance(self.system, str) else [block.text for block in self.system]
        return "".join(_unbilled(part) for part in parts) or None

    def chat_body(self) -> dict[str, Any]:
        """The chat completions body of the same conversation (``server/serving_messages.py``
        serves it; the router keys its prompt with it): ``system`` first, ``tool_use`` blocks as
        the assistant's ``tool_calls``, ``tool_result`` blocks as ``tool`` messages before the
        user's text, tools and tool_choice as OpenAI's (``any`` is ``required``), the template
        variables as given; a conversation that ends in the assistant's text is continued (a prefill)."""
        messages: list[dict[str, Any]] = []
        if self.system_text:
            messages.append({"role": "system", "content": self.system_text})
        for m in self.messages:
            if isinstance(m.content, str):
                messages.append({"role": m.role, "content": m.content})
                continue
            texts = [{"type": "text", "text": b.text} for b in m.content if isinstance(b, TextBlock)]
            if m.role == "assistant":
                calls = [
                    {
                        "id": b.id,
                        "type": "function",
                        "function": {"name": b.name, "arguments": json.dumps(b.input)},
                    }
                    for b in m.content
                    if isinstance(b, ToolUseBlock)
                ]
                turn: dict[str, Any] = {"role": "assistant", "content": texts or None}
                if calls:
                    turn["tool_calls"] = calls
                thought = "".join(
                    b.thinking for b in m.content if isinstance(b, ThinkingBlock) and b.type == "thinking"
                )
                if thought:
                    turn["reasoning_content"] = thought
                if texts or calls:
                    messages.append(turn)
                continue
            # A user turn answers the previous turn's calls first (tool_result blocks), then speaks
            # (text and images, in their order). The results' images open the user's message: the
            # tool messages stay one run (templates expect that) and take text only, as OpenAI's.
            results = [b for b in m.content if isinstance(b, ToolResultBlock)]
            for b in results:
                messages.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text})
            # A text document is its rendered text (``DocumentBlock.text``), in its place.
            said = [b for b in m.content if isinstance(b, (TextBlock, ImageBlock, DocumentBlock))]
            parts = [
                {"type": "text", "text": b.text}
                if not isinstance(b, ImageBlock)
                else {"type": "image_url", "image_url": {"url": b.source.chat_url}}
                for b in [*(image for r in results for image in r.images), *said]
            ]
            if parts:
                messages.append({"role": "user", "content": parts})
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" not in last:
            # A prefill: the answer continues the last assistant turn's text, as Anthropic's does.
            body["add_generation_prompt"] = False
            body["continue_final_message"] = True
        kwargs = self.chat_template_kwargs
        kind = (self.thinking or {}).get("type")
        switch = _THINKING_SWITCH.get(kind) if isinstance(kind, str) else None
        if switch is not None and "enable_thinking" not in (kwargs or {}):
            kwargs = {**(kwargs or {}), "enable_thinking": switch}
        if kwargs is not None:
            body["chat_template_kwargs"] = kwargs
        if self.output_config is not None and self.output_config.effort is not None:
            body["reasoning_effort"] = self.output_config.effort
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = (
                {"type": "function", "function": {"name": choice.name}}
                if choice.type == "tool"
                else {"auto": "auto", "any": "required", "none": "none"}[choice.type]
            )
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        return body


class MessagesRequest(_Conversation):
    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool = False
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    metadata: Metadata | None = None
    # The structured-outputs beta's name for ``output_config.format``, still taken by Anthropic.
    output_format: OutputFormat | None = None
    # Internal (router -> replica): continue a stream another replica started, and give each
    # streamed chunk's token ids so that a router can resume this one (``router/messages_stream.py``).
    resume: Resume | None = None
    return_token_ids: StrictBool = False

    def chat_body(self) -> dict[str, Any]:
        body = super().chat_body()
        if self.resume is not None:
            body["resume"] = {"token_ids": self.resume.token_ids}
        if self.return_token_ids:
            body["return_token_ids"] = True
        body["max_tokens"] = self.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        if self.metadata is not None and self.metadata.user_id is not None:
            body["user"] = self.metadata.user_id
        output = self.output_config.format if self.output_config is not None else None
        output = output or self.output_format
        if output is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": output.json_schema},
            }
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return body


class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens``: the conversation alone."""
