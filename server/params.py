"""From a validated request's sampling fields to the engine's SamplingParams (and beam search's).

Everything here is a client-input check that needs the model (vocabulary size, context length,
logprobs limit, generation defaults): the budget (``resolve_max_tokens``), the sampling and
stopping fields, ``n``'s child seeds and ``use_beam_search``. ``ModelLimits`` is what every such
check reads. Shape and range checks already happened in the request models (``server.protocol``
and its per-route modules); prompts are ``server.prompts``', output constraints
``server.structured_params``', the internal ``kv_transfer`` / ``resume`` fields
``server.handoff_params``'. Each failure is an ``APIError`` 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.beam_search import BeamSearchParams, candidates_per_beam
from engine.multimodal import ImageSpec
from engine.repetition import RepetitionDetectionParams
from engine.sampling_params import SamplingParams, bad_word_sequences
from engine.tokenizer import Tokenizer
from server.chat_protocol import ChatCompletionRequest
from server.errors import bad_request
from server.protocol import SamplingFields
from server.structured_params import structured_outputs


@dataclass(frozen=True)
class ModelLimits:
    """What the serving layer checks requests against (from ``engine.model_info``)."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int
    max_n: int
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: unknown (no capacity check)
    seq_capacity: int = 0  # the engine's tokens per sequence (ModelInfo.kv_capacity_tokens); 0: unknown
    # The model's default sampling values for fields a request leaves unset, and max_tokens' cap
    # (ModelInfo.generation_defaults: --generation-config, --override-generation-config).
    generation_defaults: Mapping[str, Any] = field(default_factory=dict)
    priority_scheduling: bool = False  # --scheduling-policy priority: requests may set priority
    eos_token_ids: tuple[int, ...] = ()  # the model's (beam search counts them among its candidates)
    engine_max_logprobs: int = 20  # the engine's --max-logprobs: beam search's candidates per beam
    image: ImageSpec | None = None  # a vision-language model's image token (ModelInfo.image)
    # --enable-prompt-embeds: the hidden size prompt embeddings must have; 0: not enabled
    prompt_embeds_hidden: int = 0
    stream_interval: int = 1  # --stream-interval: the fewest tokens a stream's chunk carries (vLLM's)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens one sequence can hold in the KV cache (a request needs prompt + max_tokens)."""
        if self.seq_capacity > 0:
            return min(self.max_model_len, self.seq_capacity)
        if self.num_kv_blocks <= 0:
            return self.max_model_len
        return min(self.max_model_len, self.num_kv_blocks * self.block_size)


def check_token_ids(ids: Sequence[int], limits: ModelLimits, param: str) -> None:
    # A token-id prompt is checked on the event loop: the usual case (all in range) by C builtins
    # rather than a Python step per token; the loop below names the first id out of range.
    if not ids or (0 <= min(ids) and max(ids) < limits.vocab_size):
        return
    for tid in ids:
        if not 0 <= tid < limits.vocab_size:
            raise bad_request(f"token id {tid} is out of range [0, {limits.vocab_size})", param=param)


def check_stream_prompt_logprobs(req: Any) -> None:
    """A stream has no place for prompt logprobs: asking for alternatives there is a 400, and
    ``prompt_logprobs: 0`` (none) is taken and unused, as vLLM takes it."""
    if req.stream and req.prompt_logprobs:
        raise bad_request("prompt_logprobs is not available with stream", param="prompt_logprobs")


def resolve_max_tokens(
    req: SamplingFields, prompt_len: int, limits: ModelLimits, default: int | None, num_resumed: int = 0
) -> int:
    """The completion budget for one prompt; 400 (with the numbers) when it cannot fit the context.

    Resumed tokens count against ``max_tokens`` (they are the request's first outputs). With no
    budget asked for, the rest of the context is the budget, as in vLLM.
    """
    requested = req.requested_max_tokens if req.requested_max_tokens is not None else default
    cap = limits.generation_defaults.get("max_tokens")
    capacity = limits.kv_capacity_tokens
    room = capacity - prompt_len
    if room <= num_resumed:
        raise bad_request(
            f"This model's maximum context length is {capacity} tokens, but the prompt has {prompt_len} "
            "tokens, leaving no room for a completion. Shorten the prompt.",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    if requested is None:
        return room if cap is None else max(min(room, cap), num_resumed + 1)
    if prompt_len + requested > capacity:
        raise bad_request(
            f"This model's maximum context length is {capacity} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion). "
            "Reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if num_resumed >= requested:
        raise bad_request(
            f"resume carries {num_resumed} tokens, which leaves nothing to generate under max_tokens={requested}",
            param="resume.token_ids",
        )
    # The model's max_new_tokens caps every budget, the asked-for one too (as vLLM's).
    return requested if cap is None else max(min(requested, cap), num_resumed + 1)


def sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    limits: ModelLimits,
    prompt_logprobs: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> SamplingParams:
    """The engine's SamplingParams for one choice (the caller adjusts ``seed`` per child for n > 1)."""
    if req.stream_options is not None and not req.stream:
        # As OpenAI and vLLM answer: the options would silently do nothing.
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    if req.n > limits.max_n:
        raise bad_request(f"n must be at most {limits.max_n}, got {req.n}", param="n")
    if req.priority != 0 and not limits.priority_scheduling:
        raise bad_request(
            "priority needs priority scheduling: start the server with --scheduling-policy priority",
            param="priority",
        )
    # Chat asks for alternatives in top_logprobs (its logprobs is a switch); completions in logprobs.
    field = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
    for name, asked in ((field, logprobs), ("prompt_logprobs", req.prompt_logprobs)):
        if asked is not None and asked > limits.max_logprobs:
            raise bad_request(f"{name} must be at most {limits.max_logprobs}, got {asked}", param=name)
    check_min_tokens(req, max_tokens)
    logit_bias = None
    if req.logit_bias:
        logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        check_token_ids(list(logit_bias), limits, "logit_bias")
    stop_token_ids = list(req.stop_token_ids or [])
    check_token_ids(stop_token_ids, limits, "stop_token_ids")
    allowed = list(req.allowed_token_ids) if req.allowed_token_ids is not None else None
    if allowed is not None:
        check_token_ids(allowed, limits, "allowed_token_ids")
    named = list(req.logprob_token_ids) if req.logprob_token_ids is not None else None
    if named is not None:
        if logprobs is None:
            raise bad_request("logprob_token_ids needs logprobs to be set", param="logprob_token_ids")
        check_token_ids(named, limits, "logprob_token_ids")
    defaults = limits.generation_defaults
    top_k = _or_default(req.top_k, "top_k", defaults, -1)
    params = SamplingParams(
        n=1,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        temperature=_or_default(req.temperature, "temperature", defaults, 1.0),
        top_p=_or_default(req.top_p, "top_p", defaults, 1.0),
        top_k=-1 if top_k == 0 else top_k,
        min_p=_or_default(req.min_p, "min_p", defaults, 0.0),
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=_or_default(req.repetition_penalty, "repetition_penalty", defaults, 1.0),
        logit_bias=logit_bias,
        seed=req.seed,
        stop=req.stop_list,
        stop_token_ids=stop_token_ids,
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logprob_token_ids=named,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        structured_outputs=structured_outputs(req),
        allowed_token_ids=allowed,
        bad_words_token_ids=bad_words_token_ids(req.bad_words, tokenizer) if req.bad_words else None,
        repetition_detection=repetition_detection(req),
        # A request's own interval may only raise the server's (as vLLM clamps it).
        stream_interval=max(req.stream_interval or 1, limits.stream_interval) if req.stream else None,
    )
    if params.allowed_token_ids and params.bad_words_token_ids:
        try:
            params.validate()
        except ValueError as e:
            raise bad_request(str(e), param="bad_words") from e
    return params


def repetition_detection(req: SamplingFields) -> RepetitionDetectionParams | None:
    """The engine's repetition check, or None when not asked for (or turned off): the postprocessor
    then skips it for this request."""
    asked = req.repetition_detection
    if asked is None or asked.max_pattern_size == 0:
        return None
    return asked.engine_params()


def _or_default(value: Any, name: str, defaults: Mapping[str, Any], neutral: Any) -> Any:
    """The request's value; if unset, the model's default (generation_config.json); else neutral."""
    if value is not None:
        return value
    return defaults.get(name, neutral)


def bad_words_token_ids(words: Sequence[str], tokenizer: Tokenizer | None) -> list[list[int]]:
    """Each bad word's token ids alone and after a space (a word inside text is usually tokenized
    with its leading space), as vLLM derives them."""
    if tokenizer is None:
        raise bad_request("bad_words needs the model's tokenizer", param="bad_words")
    return bad_word_sequences(words, lambda text: tokenizer.encode(text, add_special_tokens=False))


def check_min_tokens(req: SamplingFields, max_tokens: int) -> None:
    if req.min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens"
        )


def child_seed(seed: int | None, index: int) -> int | None:
    """Seed of the ``index``-th choice: ``seed + index`` (ARCHITECTURE.md), wrapped into int64."""
    if seed is None:
        return None
    value = seed + index
    return ((value + 2**63) % 2**64) - 2**63


def beam_search_params(
    req: SamplingFields, params: SamplingParams, limits: ModelLimits, top_n: int | None
) -> BeamSearchParams | None:
    """vLLM's ``use_beam_search``: the search's parameters (``n`` beams, each choice one of them),
    or None for a sampled request. ``params``: the request's SamplingParams, for the stopping
    fields; ``top_n``: the logprobs alternatives asked for per token.

    The search is deterministic: temperature, top_p/top_k/min_p, penalties and seed do not apply
    (as in vLLM). Fields that would change which tokens may be chosen are refused rather than
    ignored, and so is a beam wider than the logprobs limit lets a step look at."""
    if not req.use_beam_search:
        return None
    refused = [
        ("logit_bias", bool(req.logit_bias)),
        ("allowed_token_ids", req.allowed_token_ids is not None),
        ("bad_words", bool(req.bad_words)),
        ("repetition_detection", repetition_detection(req) is not None),
        ("logprob_token_ids", req.logprob_token_ids is not None),
        ("kv_transfer", req.kv_transfer is not None),
        ("resume", req.resume is not None),
    ]
    for name, given in refused:
        if given:
            raise bad_request(f"{name} cannot be combined with use_beam_search", param=name)
    if params.structured_outputs is not None:
        raise bad_request(
            "structured outputs (response_format, structured_outputs, guided_*) cannot be combined with "
            "use_beam_search",
            param="use_beam_search",
        )
    beam = BeamSearchParams(
        beam_width=req.n,
        max_tokens=params.max_tokens or 1,
        ignore_eos=req.ignore_eos,
        length_penalty=req.length_penalty,
        include_stop_str_in_output=req.include_stop_str_in_output,
        min_tokens=req.min_tokens,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        logprobs=top_n,
        prompt_logprobs=params.prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
    )
    try:
        beam.validate()
    except ValueError as e:
        raise bad_request(str(e), param="use_beam_search") from e
    ending = len(set(params.stop_token_ids) | (set() if req.ignore_eos else set(limits.eos_token_ids)))
    k = candidates_per_beam(beam, ending)
    if k > limits.engine_max_logprobs:
        raise bad_request(
            f"use_beam_search with n={req.n} looks at the top {k} tokens of each beam, more than the "
            f"server's --max-logprobs ({limits.engine_max_logprobs}) allows; lower n",
            param="n",
        )
    return beam
