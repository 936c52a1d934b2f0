"""OpenAI-compatible request and response models shared by every route of one replica (and the router).

These pydantic models are the HTTP edge: every limit a client can hit is declared here (or in the
per-route modules built on these bases) so a bad request fails validation with a clear message and
never reaches the engine. This module holds the bases (``_Request``, ``_Response``), the limits,
the sampling and stopping fields that completions and chat share (``SamplingFields``, with their
structured-output and internal hand-off parts) and the response parts every route answers with
(usage, errors, model cards). The per-route models live beside it: ``completion_protocol``,
``chat_protocol``, ``tokenize_protocol``, ``embedding_protocol`` (and ``pooling_protocol``,
``score_protocol``, ``anthropic_protocol`` with ``anthropic_content``). The router imports these
modules too, so they must stay torch-free: they may import pydantic, the stdlib and torch-free
engine types, never ``engine.async_engine`` or anything that loads a model.

Unknown request fields are ignored (peer routers add their own, e.g. ``separate_reasoning``,
``kv_transfer_params``). Fields that would be ignored silently but change the answer
(``suffix``, ``best_of`` != n, a ``response_format`` type or structured-outputs option not
supported, ``tool_choice="auto"`` on a server without a tool-call parser) are rejected by the
serving layer with a 400 instead.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from engine.repetition import RepetitionDetectionParams


def truncation(value: int | None) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: keep the prompt's last N tokens; -1 keeps the model's
    context length."""
    if value == 0:
        raise ValueError("must be -1 (the model's context length) or at least 1")
    return value


MAX_N = 128  # choices per request, as OpenAI allows
MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI allows
MAX_STOP_SEQUENCES = 16
MAX_LOGPROB_IDS = 1024  # logprob_token_ids: entries per generated position
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _omit_none(value: object) -> bool:
    return value is None


def random_id() -> str:
    return uuid.uuid4().hex


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Many clients send explicit nulls for fields they leave unset (LangChain, older SDKs).
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----------------------------------------------------------------- shared request parts


class StreamOptions(_Request):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class KVTransfer(_Request):
    """Internal (router -> replica): prefill/decode hand-off of KV blocks through the tier."""

    role: Literal["producer", "consumer"]
    block_hashes: list[StrictStr] | None = None  # consumer: 32-char hex hashes, in prompt order
    # producer: the client's max_tokens / max_completion_tokens / min_tokens as it sent them (the
    # request itself carries max_tokens 1): checked as a replica checks them
    # (server.handoff_params.client_budget)
    budget: dict[str, Any] | None = None


class Resume(_Request):
    """Internal (router -> replica): continue a request whose first tokens were produced elsewhere."""

    token_ids: list[StrictInt] = Field(min_length=1)


class ResumeChoice(_Request):
    """One unfinished choice of a resumed ``n`` > 1 stream: its index and the tokens it already sent."""

    index: StrictInt = Field(ge=0, lt=MAX_N)
    token_ids: list[StrictInt]  # [] when the choice had sent nothing yet


class SamplingResume(_Request):
    """A chat or completions request's ``resume``: ``token_ids`` (one choice, ``n`` = 1), or
    ``choices`` (a stream of ``n`` choices: only the listed ones run, each after its own tokens;
    the others finished before and are not sent again)."""

    token_ids: list[StrictInt] | None = Field(default=None, min_length=1)
    choices: list[ResumeChoice] | None = Field(default=None, min_length=1, max_length=MAX_N)

    @model_validator(mode="after")
    def _one_form(self) -> SamplingResume:
        if (self.token_ids is None) == (self.choices is None):
            raise ValueError("resume needs exactly one of token_ids and choices")
        if self.choices is not None and len({c.index for c in self.choices}) != len(self.choices):
            raise ValueError("resume.choices: each choice index at most once")
        return self


# One value of vLLM's vllm_xargs: its str | int | float, which (lax there) takes a JSON true or false
# too (as 1 or 0; unused here).
XargValue = StrictStr | StrictInt | StrictFloat | StrictBool
JsonValue = dict[str, Any] | list[Any] | StrictStr | StrictInt | StrictFloat | StrictBool


class JsonSchemaFormat(_Request):
    """OpenAI's ``response_format.json_schema``."""

    name: StrictStr | None = None
    description: StrictStr | None = None
    json_schema: dict[str, Any] | StrictBool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Request):
    # text | json_object | json_schema | structural_tag (others are refused by the serving layer)
    type: StrictStr
    json_schema: JsonSchemaFormat | None = None
    # structural_tag (vLLM's): xgrammar's format, or the older structures + triggers
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[StrictStr] | None = None


class StructuredOutputsField(_Request):
    """vLLM's ``structured_outputs`` extra: exactly one constraint (checked by the serving layer)."""

    json_schema: dict[str, Any] | StrictStr | StrictBool | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = Field(default=None, min_length=1)
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False
    # Accepted as vLLM's are: without fallback there is nothing to disable, and objects already
    # take no properties beyond their schema's unless it says otherwise.
    disable_fallback: StrictBool = False
    disable_additional_properties: StrictBool = False
    # Would change the answer and are not supported: refused rather than ignored.
    whitespace_pattern: JsonValue | None = None
    # xgrammar's structural tag, as JSON text (vLLM's) or the object itself
    structural_tag: dict[str, Any] | StrictStr | None = None


class RepetitionDetectionField(_Request):
    """vLLM's ``repetition_detection``: end the output once it ends in one N-gram of
    ``min_pattern_size`` .. ``max_pattern_size`` tokens (0: 1) written ``min_count`` times in a row
    (limits: ``engine.repetition``). ``max_pattern_size`` 0 turns it off."""

    max_pattern_size: StrictInt = Field(default=0, ge=0)
    min_pattern_size: StrictInt = Field(default=0, ge=0)
    min_count: StrictInt = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> RepetitionDetectionField:
        self.engine_params().validate()  # its ValueError names the field (a 400)
        return self

    def engine_params(self) -> RepetitionDetectionParams:
        return RepetitionDetectionParams(self.max_pattern_size, self.min_pattern_size, self.min_count)


class SamplingFields(_Request):
    """Sampling and stopping fields shared by /v1/completions and /v1/chat/completions."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[StrictStr, StrictFloat] | None = None
    user: StrictStr | None = None
    # vLLM's: the render routes answer each prompt token's character offsets in its source text
    # (server/token_offsets.py); other routes ignore it
    return_token_offsets: StrictBool = False
    # vLLM's extra arguments for custom extensions (its type checked as vLLM checks it); ferry has no
    # extension hook: taken and unused
    vllm_xargs: dict[str, XargValue | list[XargValue]] | None = None
    # vLLM's stable session identity: taken and unused by a replica; a router's session policy keeps
    # a session's requests on one replica by it (router/proxy_route.py)
    session_id: StrictStr | None = Field(default=None, max_length=4096)
    # vLLM-compatible extras
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: StrictFloat | None = Field(default=None, gt=0.0, le=10.0)
    min_tokens: StrictInt = Field(default=0, ge=0)
    # vLLM's: under --scheduling-policy priority, lower values are served first (0 otherwise)
    priority: StrictInt = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    # vLLM's: salts the prompt's block hashes, so cached blocks are reused only among requests
    # with the same salt (one per tenant, kept secret, stops prompt probing by timing)
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=4096)
    ignore_eos: StrictBool = False
    # vLLM's: the n best beams of a beam search instead of n samples (engine/beam_search.py)
    use_beam_search: StrictBool = False
    length_penalty: StrictFloat = 1.0  # beam search ranks by cum_logprob / length ** length_penalty
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    return_tokens_as_token_ids: StrictBool = False  # logprob tokens as "token_id:{id}"
    return_token_ids: StrictBool = False  # vLLM: each choice (and stream delta) carries its token ids
    # vLLM: per prompt position, the prompt token's logprob and the top-N (not with stream)
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    allowed_token_ids: list[StrictInt] | None = Field(default=None, min_length=1)
    # vLLM's: these vocab ids' logprobs at each generated position (beside the sampled token's),
    # instead of the natural top-N; needs logprobs (chat: ``logprobs: true``).
    logprob_token_ids: list[StrictInt] | None = Field(default=None, min_length=1, max_length=MAX_LOGPROB_IDS)
    bad_words: list[StrictStr] | None = None
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)  # keep the prompt's last N
    _check_truncation = field_validator("truncate_prompt_tokens")(truncation)
    # vLLM's: "right" keeps the prompt's first N tokens instead (``server.prompts.truncated``)
    truncation_side: Literal["left", "right"] | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, or vLLM's older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | StrictStr | StrictBool | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = Field(default=None, min_length=1)
    guided_grammar: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None
    guided_decoding_backend: StrictStr | None = None  # ignored: there is one backend (xgrammar)
    # vLLM's: at most this many tokens of thinking, then the end of thinking (``</think>``) is forced
    # and the answer goes on (engine/thinking_budget.py); -1: no cap. Needs a reasoning parser whose
    # model thinks between <think> and </think> (``server.reasoning_parsers.thinking_budget``).
    thinking_token_budget: StrictInt | None = None
    repetition_detection: RepetitionDetectionField | None = None
    # vLLM's: a stream's chunks carry this many tokens each (the first and last sent at once); raised
    # to the server's --stream-interval; unused without stream
    stream_interval: StrictInt | None = Field(default=None, ge=1)
    # internal (router -> replica)
    kv_transfer: KVTransfer | None = None
    resume: SamplingResume | None = None

    @model_validator(mode="after")
    def _check_stop(self) -> SamplingFields:
        if self.thinking_token_budget is not None and self.thinking_token_budget < -1:
            raise ValueError(
                "thinking_token_budget: must be a non-negative integer or -1 for unlimited, "
                f"got {self.thinking_token_budget}"
            )
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"stop: at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop: stop sequences must be non-empty strings")
        if self.logit_bias:
            for key, value in self.logit_bias.items():
                if not key.lstrip("-").isdigit():
                    raise ValueError(f"logit_bias: keys must be token ids, got {key!r}")
                if not -100.0 <= value <= 100.0:
                    raise ValueError(f"logit_bias: values must be in [-100, 100], got {value}")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (newer OpenAI name, sent by sglang-router) wins over ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


# A prompt field (completions, embeddings, /pooling, /score): a text, texts, a token list or token lists.
PromptInput = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


# ----------------------------------------------------------------- shared response parts


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class KVTransferResult(_Response):
    """The producer's answer; extra keys the engine's KV connector reports (``tier_blocks``,
    ``tier_write_complete``…) pass through to the router."""

    model_config = ConfigDict(extra="allow")

    block_hashes: list[str]
    num_cached_tokens: int


class PromptLogprob(_Response):
    """vLLM's shape of one prompt-logprob entry."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position (the first has none): token id -> entry, the prompt's token and the top-N.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ferry"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    # A LoRA adapter's: the digest of its files, which salts its KV blocks' hashes (kvcache.keys).
    lora_weights_id: str | None = None
    # A LoRA adapter's: served as ``--lora-modules`` named it at start (True) or loaded at run time
    # (False). Routers adopt only the latter (router/lora_learn.py): the former come with the flag.
    lora_preloaded: bool | None = None
    # A LoRA adapter's: served from ``--lora-resolver-dir``'s entry of its name, which this replica
    # loads again whenever it is named (True). Routers neither adopt nor restore those, nor take
    # another replica's entry (another path) for a conflict (router/lora_learn.py).
    lora_resolved: bool | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionResponse(_Response):
    version: str
    role: str | None = Field(default=None, exclude_if=_omit_none)


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo
