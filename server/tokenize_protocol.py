"""vLLM's ``/tokenize`` and ``/detokenize``: their requests and answers (``server/serving_tokenize.py``).

A tokenize request counts a completion ``prompt`` or renders chat ``messages`` as a chat request
would, so it shares ``chat_protocol``'s message model. Torch-free, like ``server.protocol``.
"""

from __future__ import annotations

from typing import Any

from pydantic import StrictBool, StrictInt, StrictStr, model_validator

from server.chat_protocol import ChatMessage
from server.protocol import _Request, _Response

# ----------------------------------------------------------------- requests


class TokenizeRequest(_Request):
    """vLLM's /tokenize: either a completion ``prompt`` or chat ``messages``."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    # As on chat requests: the prompt ends inside the last message, so a count made here is the
    # chat request's.
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool | None = None  # default: True for prompt, False for messages
    return_token_strs: StrictBool = False
    chat_template: StrictStr | None = None  # as on chat requests
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered by the template, as on chat requests (vLLM's)
    documents: list[dict[str, Any]] | None = None  # as on chat requests

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


class DetokenizeRequest(_Request):
    model: StrictStr | None = None
    tokens: list[StrictInt]


# ----------------------------------------------------------------- responses


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str
