"""``/v1/chat/completions``: the request (messages, content parts, tools) and its answers, whole
and streamed (messages, deltas, tool calls, token logprobs).

Built on ``server.protocol`` (the shared bases, ``SamplingFields``, usage and prompt logprobs);
torch-free like it, since the router imports it. The prompt is rendered by
``server.prompts.chat_prompt``; tool-call checks are ``server.tools``'.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from engine.chat_template import template_message
from server.protocol import (
    MAX_LOGPROBS,
    KVTransferResult,
    PromptLogprobs,
    SamplingFields,
    UsageInfo,
    _omit_none,
    _Request,
    _Response,
)

# ----------------------------------------------------------------- requests

# How hard a reasoning model thinks: OpenAI's values ("none" for no reasoning, "xhigh" for its newer
# models) and DeepSeek-V4's "max", as vLLM takes them. The chat template reads it (gpt-oss's writes
# it into its system message); ``ChatDefaults.render_kwargs`` hands it over.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ImageURL(_Request):
    url: StrictStr = Field(min_length=1)
    detail: StrictStr | None = None  # OpenAI's; LLaVA sees every image the same way


class TextPart(_Request):
    """A content part: text, an image (``image_url``) for a vision-language model, or an assistant's
    earlier ``refusal`` (OpenAI's assistant part; templates see its words as text, as vLLM's do)."""

    type: StrictStr
    text: StrictStr | None = None
    image_url: ImageURL | None = None
    refusal: StrictStr | None = None


class ChatMessage(_Request):
    """One message of ``messages``. ``role`` is any non-empty string, as vLLM takes it (its custom
    message param): the chat template decides what a role means (Llama 3.1's writes ``ipython``
    turns) or refuses it (``raise_exception``: a 400 with the template's words). The Anthropic and
    Responses APIs check their own roles before they build one of these."""

    role: StrictStr = Field(min_length=1)
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # An assistant turn's reasoning, sent back in the history (vLLM's names): templates such as
    # Qwen3's write it into the turns after the last user message.
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None

    @model_validator(mode="after")
    def _known_parts(self) -> ChatMessage:
        if isinstance(self.content, list):
            for part in self.content:
                if part.type == "image_url":
                    if part.image_url is None:
                        raise ValueError("an image_url content part needs 'image_url': {'url': ...}")
                elif part.type == "refusal":
                    if part.refusal is None:
                        raise ValueError("a refusal content part needs a 'refusal' field")
                elif part.type != "text":
                    raise ValueError(f"content part type {part.type!r} is not supported")
                elif part.text is None:
                    raise ValueError("a text content part needs a 'text' field")
        return self

    @property
    def image_urls(self) -> list[str]:
        """The URLs of its image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [
            part.image_url.url
            for part in self.content
            if part.image_url is not None and part.type == "image_url"
        ]

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (``engine.chat_template.template_message``)."""
        return template_message(self.model_dump())


def non_object_schema(parameters: dict[str, Any]) -> str | None:
    """Why a function's ``parameters`` schema is not one of an object (None if it is, or names no
    type): OpenAI requires one, as a call's arguments are a JSON object; a forced call would
    otherwise be made to the schema and its arguments be, say, a string."""
    kind = parameters.get("type")
    if kind is None or kind == "object":
        return None
    return f"a function's parameters must be a JSON Schema of type 'object', not {kind!r}"


class FunctionSpec(_Request):
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and (why := non_object_schema(value)):
            raise ValueError(why)
        return value


class ToolSpec(_Request):
    """One entry of ``tools`` (validated by the serving layer; the template sees the client's dict)."""

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Request):
    name: StrictStr


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM-compatible extras
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    # vLLM's: the answer starts with the last message's text when the answer has its role (a
    # continued assistant message, written whole).
    echo: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: the template's reasoning_effort (over chat_template_kwargs' own, as vLLM merges them)
    reasoning_effort: ReasoningEffort | None = None
    # vLLM's: a Jinja template for this request (needs --trust-request-chat-template)
    chat_template: StrictStr | None = None
    # vLLM's: documents shown to templates that support RAG (``documents``), e.g. Command-R's
    documents: list[dict[str, Any]] | None = None
    # vLLM's: special tokens (BOS) added by the tokenizer on top of the template's own (rarely right)
    add_special_tokens: StrictBool = False
    # vLLM's: false leaves the reasoning (a --reasoning-parser's) out of the answer, message and
    # deltas alike; the content is the same.
    include_reasoning: StrictBool = True
    # vLLM's: the answer carries ``prompt_text``, the prompt the chat template rendered (RL
    # frameworks keep it beside ``prompt_token_ids``, which ``return_token_ids`` adds)
    return_prompt_text: StrictBool | None = None
    # OpenAI's deprecated forms of tools / tool_choice, and its audio output: each would change the
    # answer, so a request that sends them is refused rather than answered without them.
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[StrictStr] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: logprobs must be true when top_logprobs is set")
        if self.logprob_token_ids is not None and not self.logprobs:
            raise ValueError("logprob_token_ids: logprobs must be true when logprob_token_ids is set")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        for field, instead in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(self, field) is not None:
                raise ValueError(f"{field}: the deprecated {field} is not supported; send {instead}")
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise ValueError('modalities: this server answers in text only (["text"])')
        return self


# ----------------------------------------------------------------- responses


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Response):
    name: str | None = Field(default=None, exclude_if=_omit_none)
    arguments: str | None = Field(default=None, exclude_if=_omit_none)


class DeltaToolCall(_Response):
    index: int
    id: str | None = Field(default=None, exclude_if=_omit_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_omit_none)
    function: DeltaFunctionCall


class AssistantMessage(_Response):
    role: str = "assistant"  # --response-role
    content: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_omit_none)
    # A --reasoning-parser's thinking under both of vLLM's names, the same text: ``reasoning`` (its
    # name since vLLM 0.11's rename, what OpenRouter-style clients read first) and the older
    # ``reasoning_content``, which vLLM still writes beside it.
    reasoning: str | None = Field(default=None, exclude_if=_omit_none)
    reasoning_content: str | None = Field(default=None, exclude_if=_omit_none)


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=_omit_none)
    # vLLM's ``return_token_ids`` / ``return_prompt_text``: the prompt the engine ran, as ids and as
    # the template's text; absent unless asked (``server.serving_common.shown_prompt_ids``)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)
    prompt_text: str | None = Field(default=None, exclude_if=_omit_none)
    kv_transfer: KVTransferResult | None = Field(default=None, exclude_if=_omit_none)


class DeltaMessage(_Response):
    role: str | None = Field(default=None, exclude_if=_omit_none)  # --response-role
    content: str | None = Field(default=None, exclude_if=_omit_none)
    reasoning: str | None = Field(default=None, exclude_if=_omit_none)  # as AssistantMessage's
    reasoning_content: str | None = Field(default=None, exclude_if=_omit_none)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=_omit_none)


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(default=None, exclude_if=_omit_none)
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)
    # Not sent: the logprobs of the tokens whose text is ``delta.content`` (``server/text_logprobs.py``),
    # for the Responses API's output_text; None where every token's text is content (no shaper).
    text_logprobs: list[TokenLogprob] | None = Field(default=None, exclude=True)


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=_omit_none)
    # As the whole answer's, on each choice's role chunk only (vLLM's)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)
    prompt_text: str | None = Field(default=None, exclude_if=_omit_none)
    kv_transfer: KVTransferResult | None = Field(default=None, exclude_if=_omit_none)
    # Not sent: another chunk of the same engine output follows at once (text after a tool call in
    # one delta). The SSE writer sends them in one write, so a client (a router that resumes a
    # stream from the token ids it saw, which ride on the output's last chunk) never gets one
    # without the rest.
    continued: bool = Field(default=False, exclude=True)
