"""From a validated request to what the engine takes: token-id prompts and SamplingParams.

Everything here is a client-input check that needs the model (vocabulary size, context
length, chat template); shape and range checks already happened in ``server.protocol``.
Each failure is an ``APIError`` 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from engine.beam_search import BeamSearchParams, candidates_per_beam
from engine.multimodal import ImageSpec
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.tokenizer import ChatTemplateError, Tokenizer
from kvcache.keys import from_hex
from server.chat_defaults import RESERVED_TEMPLATE_KWARGS, ChatDefaults
from server.errors import bad_request, validation_error
from server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, TokenizeRequest


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

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens one sequence can hold in the KV cache (a request needs prompt + max_tokens)."""
        if self.seq_capacity > 0:
            return min(self.max_model_len, self.seq_capacity)
        if self.num_kv_blocks <= 0:
            return self.max_model_len
        return min(self.max_model_len, self.num_kv_blocks * self.block_size)


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


@dataclass(frozen=True)
class PreparedPrompt:
    token_ids: list[int]
    text: str | None  # the prompt text when the client gave text (for echo)
    embeds: Any = None  # prompt embeddings (a tensor): token_ids are then its placeholders


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
            ids, text = ids[-keep:], None
        prompts.append(PreparedPrompt(ids, text))
    return prompts


def chat_prompt(
    req: ChatCompletionRequest | TokenizeRequest,
    tokenizer: Tokenizer,
    trust_request_template: bool = False,
    defaults: ChatDefaults = ChatDefaults(),
    limits: ModelLimits | None = None,
) -> list[int]:
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
            "This model has no chat template, so /v1/chat/completions cannot format messages; "
            "use /v1/completions with a plain prompt instead.",
            param="messages",
            code="chat_template_missing",
        )
    messages = [m.template_dict() for m in req.messages or []]
    # Rendered exactly as the router's TokenKeyer renders a body (``router/prompt_keys.py``):
    # template kwargs, then tools, so router and replica agree on every block hash.
    own_kwargs = getattr(req, "chat_template_kwargs", None) or {}
    reserved = RESERVED_TEMPLATE_KWARGS.intersection(own_kwargs)
    if reserved:
        raise bad_request(
            f"chat_template_kwargs must not set {', '.join(sorted(reserved))}: use the request fields",
            param="chat_template_kwargs",
        )
    kwargs = defaults.kwargs(own_kwargs, getattr(req, "documents", None))
    if getattr(req, "continue_final_message", False):
        kwargs["continue_final_message"] = True
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
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=req.add_generation_prompt,
            tools=defaults.tools(getattr(req, "tools", None), getattr(req, "tool_choice", None)),
            **kwargs,
        )
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages") from e
    add_special = getattr(req, "add_special_tokens", None)
    ids = tokenizer.encode(text, add_special_tokens=bool(add_special))
    keep = kept_prompt_tokens(req, limits) if limits is not None else None  # /tokenize: no truncation
    if keep is not None and len(ids) > keep:
        ids = ids[-keep:]
    if not ids:
        raise bad_request("the rendered chat prompt is empty", param="messages")
    return ids


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


# vLLM's older request fields for a constraint, and the StructuredOutputsParams field each sets.
GUIDED_FIELDS = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever of its three spellings it used: OpenAI's
    ``response_format``, vLLM's ``structured_outputs`` or vLLM's older ``guided_*`` fields.

    Shape errors are 400s here; a schema, regex or grammar that is not valid is a 400 where it
    compiles (``serving_common.compile_constraints``), once per distinct constraint.
    """
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise bad_request(
                    "response_format of type 'json_schema' needs json_schema.schema",
                    param="response_format.json_schema",
                )
            found.append(("response_format", StructuredOutputsParams(json=rf.json_schema.json_schema)))
        elif rf.type == "structural_tag":
            if rf.format is not None:
                tag: dict[str, Any] = {"type": "structural_tag", "format": rf.format}
            elif rf.structures is not None and rf.triggers is not None:
                tag = {"structures": rf.structures, "triggers": rf.triggers}
            else:
                raise bad_request(
                    "response_format of type 'structural_tag' needs format (or structures and triggers)",
                    param="response_format",
                )
            found.append(("response_format", StructuredOutputsParams(structural_tag=tag)))
        else:
            raise bad_request(
                f"response_format type {rf.type!r} is not supported; use 'text', 'json_object', "
                "'json_schema' or 'structural_tag'",
                param="response_format.type",
            )
    so = req.structured_outputs
    if so is not None:
        if so.whitespace_pattern is not None:
            raise bad_request(
                "structured_outputs.whitespace_pattern is not supported by this server",
                param="structured_outputs.whitespace_pattern",
            )
        try:
            found.append(
                (
                    "structured_outputs",
                    StructuredOutputsParams(
                        json=so.json_schema,
                        regex=so.regex,
                        choice=so.choice,
                        grammar=so.grammar,
                        json_object=bool(so.json_object),
                        structural_tag=so.structural_tag,
                        disable_any_whitespace=so.disable_any_whitespace,
                    ),
                )
            )
        except ValueError as e:
            raise bad_request(str(e), param="structured_outputs") from e
    if req.guided_whitespace_pattern is not None:
        raise bad_request(
            "guided_whitespace_pattern is not supported by this server", param="guided_whitespace_pattern"
        )
    for name, key in GUIDED_FIELDS:
        value = getattr(req, name)
        if value is not None:
            found.append((name, StructuredOutputsParams(**{key: value})))
    if len(found) > 1:
        raise bad_request(
            f"give one output constraint, not {len(found)} ({', '.join(n for n, _ in found)})",
            param=found[1][0],
        )
    if not found:
        return None
    name, spec = found[0]
    try:
        _ = spec.kind  # exactly one constraint; the rest is checked where it compiles
    except ValueError as e:
        raise bad_request(str(e), param=name) from e
    return spec


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
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        structured_outputs=structured_outputs(req),
        allowed_token_ids=allowed,
        bad_words_token_ids=bad_words_token_ids(req.bad_words, tokenizer) if req.bad_words else None,
    )
    if params.allowed_token_ids and params.bad_words_token_ids:
        try:
            params.validate()
        except ValueError as e:
            raise bad_request(str(e), param="bad_words") from e
    return params


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
    # Deduplicated through a dict (ordered, as a list was): a list's ``in`` made a request with
    # many bad words quadratic, minutes of the event loop for one request of 50k words.
    seqs: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids:
                seqs[tuple(ids)] = None
    return [list(ids) for ids in seqs]


BUDGET_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens")


def client_budget(req: SamplingFields) -> SamplingFields:
    """The request with the budget its client sent, for a producer (a prefill worker's request
    carries ``max_tokens`` 1, as DESIGN's hand-off says, and the client's fields in
    ``kv_transfer.budget``); ``req`` itself otherwise. The fields are checked by the request
    model's own rules, so a bad budget is the 400 a replica gives the client, before the prefill."""
    budget = req.kv_transfer.budget if req.kv_transfer is not None else None
    if budget is None:
        return req
    chat = isinstance(req, ChatCompletionRequest)
    stub: dict[str, Any] = {"messages": [{"role": "user", "content": "."}]} if chat else {"prompt": "."}
    try:
        sent = type(req).model_validate({**stub, **{k: budget[k] for k in BUDGET_FIELDS if k in budget}})
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None
    return req.model_copy(update={k: getattr(sent, k) for k in BUDGET_FIELDS})


def check_min_tokens(req: SamplingFields, max_tokens: int) -> None:
    if req.min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens"
        )


def kv_transfer_spec(req: SamplingFields, num_prompts: int) -> dict[str, Any] | None:
    """The ``kv_transfer`` field as the engine's KV connector takes it (a dict, hashes as hex)."""
    if req.kv_transfer is None:
        return None
    if num_prompts != 1 or req.n != 1:
        raise bad_request("kv_transfer needs exactly one prompt and n = 1", param="kv_transfer")
    spec: dict[str, Any] = {"role": req.kv_transfer.role}
    if req.kv_transfer.block_hashes is not None:
        try:
            from_hex(req.kv_transfer.block_hashes)
        except ValueError as e:
            raise bad_request(f"kv_transfer.block_hashes: {e}", param="kv_transfer.block_hashes") from e
        spec["block_hashes"] = [h.lower() for h in req.kv_transfer.block_hashes]
    return spec


def resumed_choices(
    req: SamplingFields, num_prompts: int, limits: ModelLimits
) -> dict[int, list[int]] | None:
    """The choices a ``resume`` runs, each with the tokens it already produced elsewhere (in index
    order), or None without ``resume`` (every choice runs from its start). ``resume.token_ids`` is
    choice 0 of an ``n`` = 1 request; ``resume.choices`` (a stream's unfinished choices, for ``n``
    > 1) names its choices: those left out finished before and do not run again."""
    if req.resume is None:
        return None
    if req.resume.token_ids is not None:
        if num_prompts != 1 or req.n != 1:
            raise bad_request("resume needs exactly one prompt and n = 1", param="resume")
        ids = list(req.resume.token_ids)
        check_token_ids(ids, limits, "resume.token_ids")
        return {0: ids}
    if num_prompts != 1:
        raise bad_request("resume.choices needs exactly one prompt", param="resume.choices")
    if not getattr(req, "stream", False):
        # A whole answer would hold only the resumed choices, not the request's n.
        raise bad_request("resume.choices needs stream", param="resume.choices")
    out: dict[int, list[int]] = {}
    for c in sorted(req.resume.choices or (), key=lambda c: c.index):
        if c.index >= req.n:
            raise bad_request(
                f"resume.choices: index {c.index} is not below n = {req.n}", param="resume.choices"
            )
        check_token_ids(c.token_ids, limits, "resume.choices.token_ids")
        out[c.index] = list(c.token_ids)
    return out


def longest_resumed(resumed: dict[int, list[int]] | None) -> list[int] | None:
    """The resumed tokens of the choice furthest along (what a budget must leave room after)."""
    if not resumed:
        return None
    return max(resumed.values(), key=len) or None


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
