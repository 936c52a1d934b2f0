"""The ``POST /v1/responses`` request body (``ResponsesRequest``), with the router's internal
``resume`` (``ResponsesResume``) and what ``include`` may name.

Its own module so that the modules that take a request (``server/responses_to_chat.py``,
``server/responses_stream.py``, ``server/responses_object.py``) need not import the endpoint
(``server/serving_responses.py``), which imports them. Validation only: no state, no torch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from server.chat_protocol import ReasoningEffort
from server.middleware import RESPONSE_ID_PATTERN
from server.protocol import _Request


class ResponsesResume(_Request):
    """Internal (router -> replica): continue a stream another replica started
    (``server/responses_stream.py``): what the client already has of the response."""

    token_ids: list[StrictInt] = []  # the output tokens sent
    output: list[dict[str, Any]] = []  # the output items, the last ones possibly in progress
    created_at: StrictInt


class ResponsesReasoning(_Request):
    """``reasoning``: its ``effort`` reaches the chat template as the chat request's
    ``reasoning_effort`` (``server/responses_to_chat.py``). ``summary`` (OpenAI's auto, concise,
    detailed; ``generate_summary`` is its deprecated name) asks for the thought as the reasoning
    item's ``summary``: this server writes no summaries of its own, so the summary is the
    thought itself, one ``summary_text`` part, streamed with OpenAI's summary events; without one
    the thought is the item's ``content`` (``reasoning_text``), as vLLM answers
    (``server/responses_stream.py``)."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


def wants_summary(req: ResponsesRequest) -> bool:
    """Whether the thought is written as the reasoning item's summary (``reasoning.summary``)."""
    reasoning = req.reasoning
    return reasoning is not None and (reasoning.summary or reasoning.generate_summary) is not None


class ResponsesRequest(_Request):
    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    stream: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    previous_response_id: StrictStr | None = None
    store: StrictBool | None = None
    background: StrictBool = False
    include: list[StrictStr] | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    # OpenAI's bounds: 16 pairs, keys of at most 64 characters, values of at most 512 (a 400 past them).
    metadata: (
        dict[Annotated[str, Field(max_length=64)], Annotated[StrictStr, Field(max_length=512)]] | None
    ) = Field(default=None, max_length=16)
    user: StrictStr | None = None
    reasoning: ResponsesReasoning | None = None
    # vLLM's: false leaves the reasoning item out of the output (the model still thinks, and usage
    # still counts the thought's tokens), as the chat request's field does.
    include_reasoning: StrictBool = True
    # vLLM's (chat and completions): at most this many tokens of thinking (``engine/thinking_budget.py``).
    thinking_token_budget: Any = None
    # At most this many function calls in the output: the answer stops at the cap (``server/tools.py``).
    max_tool_calls: StrictInt | None = Field(default=None, ge=0)
    # OpenAI's Conversations API object: no conversation store here, so a 400 (``responses_to_chat``).
    conversation: Any = None
    # auto: a conversation too long for the context drops its oldest turns
    # (``serving_responses._chat_answer``).
    truncation: Literal["auto", "disabled"] | None = None
    # A reusable prompt stored at OpenAI (id, version, variables): no prompt store here, so a 400
    # rather than an answer without the prompt's instructions.
    prompt: Any = None
    # vLLM's structured outputs extra, as on the chat endpoint (not with ``text.format``)
    structured_outputs: Any = None
    # vLLM's: variables for the chat template, merged as on the chat endpoint (``reasoning.effort``
    # wins over their own ``reasoning_effort``, as a chat request's field does).
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's, echoed on the response and changing nothing here: every request is served alike (the
    # tier that served it is "default"), the prefix cache is keyed by the prompt itself (the router
    # keeps a ``prompt_cache_key``'s requests on one replica, ``router/proxy_route.py``).
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: StrictStr | None = None
    # vLLM's stable session identity: taken and unused here; a router keys its session policy by it
    session_id: StrictStr | None = Field(default=None, max_length=4096)
    # vLLM-compatible sampling extras, carried over to the chat request (validated there)
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    seed: Any = None
    top_k: Any = None
    min_p: Any = None
    stop: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    priority: Any = None
    cache_salt: Any = None
    # vLLM's: the response's id, as given (else ``resp_`` and the X-Request-Id: ``response_id_for``,
    # which the router's affinity follows too). The engine request keeps the X-Request-Id, which
    # is what aborts it and what the router sends every replica of a resumed stream.
    request_id: Annotated[StrictStr, Field(pattern=RESPONSE_ID_PATTERN)] | None = None
    # Internal (router -> replica): resume a stream, and group each chunk's events with its token ids
    # so that a router can resume this one (``router/responses_stream.py``).
    resume: ResponsesResume | None = None
    return_token_ids: StrictBool = False


# What ``include`` may name. Only the logprobs are something this server can add; the rest name
# output of hosted tools, images or encrypted reasoning, none of which it ever produces, so
# asking for them adds nothing (clients such as Codex send reasoning.encrypted_content).
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = frozenset(
    {
        LOGPROBS,
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
        "reasoning.encrypted_content",
    }
)


def wants_logprobs(req: ResponsesRequest) -> bool:
    return LOGPROBS in (req.include or ())
