"""From a validated request to the token-id prompts the engine takes.

Completion prompts (a text, texts, token ids or lists of them, each encoded or range-checked),
the chat prompt (rendered with the model's chat template, or the request's own under
``--trust-request-chat-template``, with the server's ``ChatDefaults``), ``truncate_prompt_tokens``,
the request-sequence cap, and the completion-only features (``echo`` scoring, ``suffix``,
``best_of``). Client-input checks that need the model; each failure is an ``APIError`` 400 naming
the field. The router renders chat prompts exactly as ``chat_prompt`` does (``router/prompt_keys.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.tokenizer import ChatTemplateError, Tokenizer
from server.chat_defaults import ChatDefaults
from server.chat_protocol import ChatCompletionRequest
from server.completion_protocol import CompletionRequest
from server.errors import bad_request
from server.params import ModelLimits, check_token_ids
from server.tokenize_protocol import TokenizeRequest


def kept_prompt_tokens(req: Any, limits: ModelLimits) -> int | None:
    """How many of a prompt's last tokens ``truncate_prompt_tokens`` keeps (-1: the model's context
    length, as vLLM); more than the context is a 400, as vLLM answers."""
    keep = getattr(req, "truncate_prompt_tokens", None)
    if keep == -1:
        return limits.max_model_len
    if keep is not None and keep > limits.max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens ({keep}) is greater than this model's maximum context length "
            f"({limits.max_model_len})",
            param="truncate_prompt_tokens",
        )
    return keep


def truncated(tokens: Any, keep: int, req: Any) -> Any:
    """The ``keep`` tokens (a list of ids, or a tensor of embeddings) of a prompt that
    ``truncate_prompt_tokens`` keeps: its last, or its first where vLLM's ``truncation_side`` is
    "right" (the router keys it the same way: ``router.prompt_keys``)."""
    return tokens[:keep] if getattr(req, "truncation_side", None) == "right" else tokens[-keep:]


@dataclass(frozen=True)
class PreparedPrompt:
    token_ids: list[int]
    text: str | None  # the prompt text when the client gave text (for echo)
    embeds: Any = None  # prompt embeddings (a tensor): token_ids are then its placeholders


def check_request_sequences(req: CompletionRequest, num_embeds: int, limit: int) -> None:
    """400 when the request asks for more than ``limit`` sequences (prompts x n; ``num_embeds``: its
    prompts given as embeddings), before any prompt is tokenized: a body within the size limit can
    hold millions of one-token prompts, each costing the server kilobytes."""
    raw = req.prompt
    if req.prompt_embeds is not None and raw in ("", [""]):
        count = 0  # the embeddings are the prompts (``completion_prompts``)
    elif isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        count = 1
    else:
        count = len(raw)
    width = max(req.n, req.best_of or 1)
    asked = (count + num_embeds) * width
    if asked > limit:
        raise bad_request(
            f"this request asks for {asked} sequences ({count + num_embeds} prompts x n={width}), more "
            f"than this server takes in one request ({limit}, --max-request-sequences): split it",
            param="prompt",
        )


def completion_prompts(
    req: CompletionRequest, tokenizer: Tokenizer, limits: ModelLimits
) -> list[PreparedPrompt]:
    """The request's text or token-id prompts: a string, strings, a token list or token lists (none
    when it has ``prompt_embeds`` and no prompt, or ``""``: ``server/prompt_embeds.py``)."""
    raw = req.prompt
    if req.prompt_embeds is not None and raw in ("", [""]):
        return []
    if isinstance(raw, str):
        items: list[str | list[int]] = [raw]
    elif raw and isinstance(raw[0], list):
        items = list(raw)  # type: ignore[arg-type]
    elif raw and isinstance(raw[0], int):
        items = [list(raw)]  # type: ignore[arg-type]
    else:
        items = list(raw)  # type: ignore[arg-type]
    keep = kept_prompt_tokens(req, limits)
    if not items:
        raise bad_request("prompt must not be empty", param="prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
            text: str | None = item
        else:
            ids = list(item)
            check_token_ids(ids, limits, "prompt")
            text = None
        if not ids:
            raise bad_request("prompt must not be empty", param="prompt")
        if keep is not None and len(ids) > keep:
            ids, text = truncated(ids, keep, req), None
        prompts.append(PreparedPrompt(ids, text))
    return prompts


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat prompt: the template's text and the token ids the engine runs (truncated by
    ``truncate_prompt_tokens`` where asked; the text is then still the template's whole text)."""

    text: str
    token_ids: list[int]


def chat_prompt(
    req: ChatCompletionRequest | TokenizeRequest,
    tokenizer: Tokenizer,
    trust_request_template: bool = False,
    defaults: ChatDefaults = ChatDefaults(),
    limits: ModelLimits | None = None,
) -> list[int]:
    """The token ids of ``rendered_chat_prompt``."""
    return rendered_chat_prompt(req, tokenizer, trust_request_template, defaults, limits).token_ids


def rendered_chat_prompt(
    req: ChatCompletionRequest | TokenizeRequest,
    tokenizer: Tokenizer,
    trust_request_template: bool = False,
    defaults: ChatDefaults = ChatDefaults(),
    limits: ModelLimits | None = None,
) -> ChatPrompt:
    """Render the messages with the model's chat template (or the request's own, when the server
    trusts requests with one: ``--trust-request-chat-template``) and encode them; ``defaults``: the
    server's template variables under the request's own, and whether tool_choice "none" hides the
    tools (``server/chat_defaults.py``)."""
    own = getattr(req, "chat_template", None)
    if own is not None and not trust_request_template:
        raise bad_request(
            "this request carries a chat_template, but the server does not run templates from requests "
            "(start it with --trust-request-chat-template)",
            param="chat_template",
        )
    if own is None and not tokenizer.has_chat_template:
        raise bad_request(
            "This model has no chat template, so its messages cannot be formatted into a prompt; "
            "send a plain prompt instead (prompt to /v1/completions, input to the pooling routes).",
            param="messages",
            code="chat_template_missing",
        )
    messages = [m.template_dict() for m in req.messages or []]
    # Rendered exactly as the router's TokenKeyer renders a body (``router/prompt_keys.py``), with
    # the same merge of the template's variables, so router and replica agree on every block hash.
    own_kwargs = getattr(req, "chat_template_kwargs", None) or {}
    if "messages" in own_kwargs:
        raise bad_request(
            "chat_template_kwargs must not set messages: the template renders the request's messages",
            param="chat_template_kwargs",
        )
    kwargs = defaults.render_kwargs(
        own_kwargs,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        documents=getattr(req, "documents", None),
        reasoning_effort=getattr(req, "reasoning_effort", None),
        tools=getattr(req, "tools", None),
        tool_choice=getattr(req, "tool_choice", None),
    )
    if own is not None:
        kwargs["chat_template"] = own
    elif (
        "chat_template" in kwargs
        and kwargs["chat_template"] not in tokenizer.chat_template_names
        and not trust_request_template
    ):  # a template's text rather than the name of one of the model's
        raise bad_request(
            "chat_template_kwargs.chat_template must name one of the model's chat templates "
            f"({', '.join(tokenizer.chat_template_names) or 'it has none'}); a template of the request's "
            "own needs --trust-request-chat-template",
            param="chat_template_kwargs",
        )
    try:
        text = tokenizer.apply_chat_template(messages, **kwargs)
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages") from e
    add_special = getattr(req, "add_special_tokens", None)
    ids = tokenizer.encode(text, add_special_tokens=bool(add_special))
    keep = kept_prompt_tokens(req, limits) if limits is not None else None  # /tokenize: no truncation
    if keep is not None and len(ids) > keep:
        ids = truncated(ids, keep, req)
    if not ids:
        raise bad_request("the rendered chat prompt is empty", param="messages")
    return ChatPrompt(text, ids)


def scores_prompt(req: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens`` 0: the answer is the prompt with its logprobs (the engine runs
    it for one token, which the answer leaves out)."""
    return req.echo and req.max_tokens == 0 and req.max_completion_tokens is None


def check_completion_features(req: CompletionRequest) -> None:
    if req.max_tokens == 0 and not scores_prompt(req):
        raise bad_request(
            "max_tokens must be at least 1 (0 only with echo, which answers the prompt scored)",
            param="max_tokens",
        )
    if req.suffix:
        raise bad_request("suffix is not supported by this server", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(
            "best_of must equal n (or be omitted): best-of sampling is not supported", param="best_of"
        )
    if req.echo and req.resume is not None:
        raise bad_request("echo cannot be combined with resume", param="echo")
