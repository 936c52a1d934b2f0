"""``/v1/completions``: the request and its answers, whole and streamed.

Built on ``server.protocol`` (the shared bases, ``SamplingFields``, usage and prompt logprobs);
torch-free like it, since the router imports it. The checks that need the model are
``server.prompts`` (prompts, ``check_completion_features``) and ``server.params``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, model_validator

from server.protocol import (
    MAX_LOGPROBS,
    MAX_N,
    KVTransferResult,
    PromptInput,
    PromptLogprobs,
    SamplingFields,
    UsageInfo,
    _omit_none,
    _Response,
)

# ----------------------------------------------------------------- requests


class CompletionRequest(SamplingFields):
    # With prompt_embeds, an empty text prompt ("", as the OpenAI SDK must send; or none) adds no
    # prompt (vLLM's rule).
    prompt: PromptInput
    # vLLM's --enable-prompt-embeds: base64 of torch.save'd tensors [seq_len, hidden] (server/prompt_embeds.py);
    # their prompts come before the text prompts'.
    prompt_embeds: StrictStr | list[StrictStr] | None = None
    # 0 with echo: the prompt scored (its text and logprobs), nothing generated, as OpenAI's legacy
    # API and vLLM allow (``server.prompts.scores_prompt``).
    max_tokens: StrictInt | None = Field(default=16, ge=0)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    # vLLM's: false for a prompt that already holds them (a chat template rendered by the client),
    # so its BOS is not doubled
    add_special_tokens: StrictBool = True

    @model_validator(mode="before")
    @classmethod
    def _embeds_need_no_prompt(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("prompt") is None and data.get("prompt_embeds") is not None:
            return {**data, "prompt": ""}
        return data


# ----------------------------------------------------------------- responses


class CompletionLogprobs(_Response):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=_omit_none)
    # vLLM's ``return_token_ids``: this choice's own prompt (a batch's prompts differ); absent for a
    # prompt given as embeddings, which has no token ids (``server.serving_common.shown_prompt_ids``)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=_omit_none)
    kv_transfer: KVTransferResult | None = Field(default=None, exclude_if=_omit_none)


class CompletionStreamChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(default=None, exclude_if=_omit_none)
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)  # its first chunk only


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=_omit_none)
    kv_transfer: KVTransferResult | None = Field(default=None, exclude_if=_omit_none)
