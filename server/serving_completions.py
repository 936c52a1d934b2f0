"""POST /v1/completions: prompts (text or token ids, one or many) x n choices, streamed or not."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable

from engine.outputs import RequestOutput
from server.admission_ticket import Ticket
from server.completion_protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
)
from server.errors import bad_request
from server.handoff_params import client_budget, kv_transfer_spec, longest_resumed, resumed_choices
from server.logprobs import CompletionLogprobsBuilder, merge_completion_logprobs, prompt_logprobs_out
from server.params import (
    beam_search_params,
    check_min_tokens,
    check_stream_prompt_logprobs,
    child_seed,
    resolve_max_tokens,
    sampling_params,
)
from server.prompt_embeds import check_embeds_features, embeds_prompts
from server.prompts import (
    PreparedPrompt,
    check_completion_features,
    check_request_sequences,
    completion_prompts,
    scores_prompt,
)
from server.reasoning_parsers import thinking_budget
from server.roles import producer_budget, transfer_for_role
from server.sequence_request import SequenceRequest, block_extra
from server.serving_common import (
    UsageTracker,
    answer_whole,
    compile_constraints,
    constraint_field,
    delivered_text,
    is_producer,
    kv_transfer_result,
    plan_off_loop,
    prompt_chars,
    refused_before_start,
    shown_prompt_ids,
    stream_errors,
)
from server.state import ServerState
from server.streaming import DONE_FRAME, FinalFrames, SSEResponse, sse_frame
from server.vllm_flags import apply_request_defaults, log_request

logger = logging.getLogger("ferry.server")


@dataclasses.dataclass
class _Choice:
    prompt: PreparedPrompt
    texts: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[CompletionLogprobs] = dataclasses.field(default_factory=list)
    builder: CompletionLogprobsBuilder | None = None
    prompt_logprobs: CompletionLogprobs | None = None  # echoed prompt's entries, filled in at the end
    prompt_entries: list | None = None  # the engine's prompt logprobs, for ``prompt_logprobs``
    started: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def plan_completion(
    state: ServerState, req: CompletionRequest, embeds: list[PreparedPrompt]
) -> tuple[list[PreparedPrompt], list[SequenceRequest]]:
    """``embeds``: the request's prompts given as embeddings (``server/prompt_embeds.py``)."""
    lora = state.check_model(req.model)
    extra = block_extra(lora, req.cache_salt)
    budget = client_budget(req)  # a producer's: the client's (it computes one token whatever it says)
    check_completion_features(budget)
    limits = state.limits
    check_request_sequences(req, len(embeds), state.config.max_request_sequences)
    prompts = embeds + completion_prompts(req, state.tokenizer, limits)
    resumed = resumed_choices(req, len(prompts), limits)
    resume = longest_resumed(resumed)
    kv = kv_transfer_spec(req, len(prompts))
    if state.config.role == "prefill" and (len(prompts) != 1 or req.n != 1 or req.use_beam_search):
        raise bad_request("a prefill worker takes exactly one prompt, n = 1 and no beam search", param="n")
    kv = transfer_for_role(state.config.role, kv, prompts[0].token_ids, state.block_size, resume, extra)
    check_stream_prompt_logprobs(req)
    echoed = req.logprobs if (req.echo and req.logprobs is not None) else None
    asked = [n for n in (echoed, None if req.stream else req.prompt_logprobs) if n is not None]
    prompt_logprobs = max(asked) if asked else None
    seqs = []
    budget_req = budget.model_copy(update={"max_tokens": 1}) if scores_prompt(budget) else budget
    for pi, prompt in enumerate(prompts):
        max_tokens = resolve_max_tokens(
            budget_req, len(prompt.token_ids), limits, default=16, num_resumed=len(resume or [])
        )
        if budget is not req:
            check_min_tokens(budget, max_tokens)
        max_tokens = producer_budget(kv, max_tokens)
        base = sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=req.logprobs,
            limits=limits,
            prompt_logprobs=prompt_logprobs,
            tokenizer=state.tokenizer,
        )
        if req.thinking_token_budget is not None:
            thinking = thinking_budget(
                state.reasoning, state.config.reasoning_parser, req.thinking_token_budget
            )
            base = dataclasses.replace(base, thinking_token_budget=thinking)
        beam = beam_search_params(req, base, limits, req.logprobs)
        for j in range(req.n) if resumed is None else resumed:  # resumed: one prompt
            params = dataclasses.replace(base, seed=child_seed(req.seed, j)) if j else base
            seqs.append(
                SequenceRequest(
                    pi * req.n + j,
                    pi,
                    prompt.token_ids,
                    params,
                    (resumed or {}).get(j) or None,
                    kv,
                    lora=lora,
                    priority=req.priority,
                    cache_salt=req.cache_salt,
                    beam=beam,
                    prompt_embeds=prompt.embeds,
                    n=req.n,
                )
            )
    return prompts, seqs


def _without_generation(out: RequestOutput) -> RequestOutput:
    """``out`` with its generated token left out (a scored prompt: ``max_tokens`` 0 with echo)."""
    outputs = [
        dataclasses.replace(o, text="", token_ids=[], logprobs=[] if o.logprobs is not None else None)
        for o in out.outputs
    ]
    return dataclasses.replace(out, outputs=outputs)


def _echo_prefix(state: ServerState, choice: _Choice, req: CompletionRequest, out: RequestOutput) -> str:
    """On a choice's first delta: the prompt text (echo) and its logprobs' start."""
    prompt = choice.prompt
    text = ""
    if req.echo:
        # A token prompt reads as generated text does: its special tokens shown or not as asked.
        text = prompt.text
        if text is None:
            text = state.tokenizer.decode(prompt.token_ids, skip_special_tokens=req.skip_special_tokens)
    if req.logprobs is not None:
        choice.builder = CompletionLogprobsBuilder(
            state.tokenizer,
            None if req.logprob_token_ids else req.logprobs,
            as_ids=req.return_tokens_as_token_ids,
            skip_special_tokens=req.skip_special_tokens,
        )
        if req.echo:
            # The engine hands prompt logprobs over with the last output; the entries (tokens and
            # offsets) are laid out now and their values filled in then.
            choice.prompt_logprobs = choice.builder.add(
                prompt.token_ids, [None] * len(prompt.token_ids), shown=text
            )
            choice.logprobs.append(choice.prompt_logprobs)
    return text


def _delta(
    state: ServerState, choice: _Choice, req: CompletionRequest, out: RequestOutput
) -> tuple[str, CompletionLogprobs | None]:
    """Text and logprobs this output adds to ``choice`` (echoed prompt included on its first delta)."""
    prefix_logprobs = len(choice.logprobs)
    text = ""
    if not choice.started:
        choice.started = True
        text = _echo_prefix(state, choice, req, out)
    o = out.outputs[0]
    text += o.text
    choice.texts.append(text)
    choice.num_tokens += len(o.token_ids)
    choice.token_ids += o.token_ids
    if choice.builder is not None:
        choice.logprobs.append(choice.builder.add(o.token_ids, o.logprobs))
    if out.finished:
        choice.finish_reason = o.finish_reason
        choice.stop_reason = o.stop_reason
        if req.prompt_logprobs is not None:
            choice.prompt_entries = out.prompt_logprobs
        if choice.prompt_logprobs is not None and choice.builder is not None and out.prompt_logprobs:
            choice.builder.fill(choice.prompt_logprobs, choice.prompt.token_ids, out.prompt_logprobs)
    new_logprobs = choice.logprobs[prefix_logprobs:]
    return text, (merge_completion_logprobs(new_logprobs) if choice.builder is not None else None)


async def create_completion(
    state: ServerState,
    req: CompletionRequest,
    request_id: str,
    receive,
    submitted: Callable[[], None] | None = None,
) -> object:
    arrival = time.perf_counter()
    apply_request_defaults(req, state.config.http)
    embeds = []
    if req.prompt_embeds is not None:
        check_embeds_features(req, state.config.role)
        # Decoding and checking megabytes of rows: off the event loop.
        embeds = await asyncio.to_thread(embeds_prompts, req, state.limits)
    await state.resolve_model(req.model)  # a LoRA adapter of --lora-resolver-dir, loaded on first use
    prompts, seqs = await plan_off_loop(prompt_chars(req.prompt), plan_completion, state, req, embeds)
    await compile_constraints(state, seqs, constraint_field(req))
    ticket = state.generation.admit(len(seqs), submitted)
    for first in seqs[:: req.n]:  # per prompt, as vLLM runs each prompt as a request
        state.metrics.observe_params(req.n, first.params.max_tokens)
        if state.config.http.log_requests:
            prompt = prompts[first.prompt_index]
            shown = prompt.text if prompt.text is not None else prompt.token_ids
            model = state.answer_model(first.lora)
            log_request(
                logger, state.config.http, f"{request_id}-{first.prompt_index}", model, shown, first.params
            )
    response_id = f"cmpl-{request_id}"
    choices = [_Choice(prompts[i // req.n]) for i in range(len(prompts) * req.n)]  # resumed: some run
    usage = UsageTracker(len(prompts), req.n)
    producer = is_producer(seqs)
    if req.stream:
        frames = _stream(state, req, seqs, choices, usage, response_id, request_id, arrival, producer, ticket)
        return SSEResponse(frames, on_close=ticket.close, hold_start=True)

    scoring = scores_prompt(req)

    def on_output(seq: SequenceRequest, out: RequestOutput) -> None:
        if scoring:
            out = _without_generation(out)
        _delta(state, choices[seq.choice_index], req, out)
        usage.add(seq, out)

    def build() -> CompletionResponse:
        return CompletionResponse(
            id=response_id,
            model=state.answer_model(seqs[0].lora),
            choices=[
                CompletionChoice(
                    index=i,
                    text="".join(c.texts),
                    logprobs=merge_completion_logprobs(c.logprobs) if c.builder is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=list(c.token_ids) if req.return_token_ids else None,
                    prompt_logprobs=prompt_logprobs_out(
                        state.tokenizer, c.prompt.token_ids, c.prompt_entries or [], req.prompt_logprobs
                    )
                    if req.prompt_logprobs is not None
                    else None,
                    prompt_token_ids=shown_prompt_ids(
                        req.return_token_ids, c.prompt.token_ids, c.prompt.embeds
                    ),
                )
                for i, c in enumerate(choices)
            ],
            usage=usage.info(),
        )

    def deliver(result: CompletionResponse) -> None:
        result.choices[0].text = delivered_text(state, seqs[0], choices[0].token_ids)

    return await answer_whole(state, seqs, request_id, arrival, ticket, receive, on_output, build, deliver)


async def _stream(
    state: ServerState,
    req: CompletionRequest,
    seqs: list[SequenceRequest],
    choices: list[_Choice],
    usage: UsageTracker,
    response_id: str,
    request_id: str,
    arrival: float,
    producer: bool,
    ticket: Ticket,
) -> AsyncIterator[bytes]:
    created = int(time.time())
    model = state.answer_model(seqs[0].lora)
    scoring = scores_prompt(req)
    # Echo + logprobs: the prompt's logprobs arrive with the last output, so each choice is sent
    # as one chunk when it finishes (correct values over early bytes).
    defer = req.echo and req.logprobs is not None
    # The last sequence's last chunk waits (briefly: the outputs end right after it) to leave
    # with the usage chunk, [DONE] and the end of the body in one write.
    unfinished = {seq.choice_index for seq in seqs}
    tail = b""
    produced = False
    continuous_usage = req.continuous_usage  # a property: read once, not per token
    # vLLM's: each choice's prompt ids ride on its first chunk (``return_token_ids``)
    prompt_ids = {
        seq.choice_index: shown_prompt_ids(req.return_token_ids, seq.prompt_token_ids, seq.prompt_embeds)
        for seq in seqs
    }
    async with stream_errors() as failed:
        async for seq, out in state.generation.merged(request_id, seqs, arrival, ticket):
            produced = True
            if scoring:
                out = _without_generation(out)
            if out.finished:
                unfinished.discard(seq.choice_index)
            choice = choices[seq.choice_index]
            text, logprobs = _delta(state, choice, req, out)
            usage.add(seq, out)
            ids = list(out.outputs[0].token_ids) if req.return_token_ids else None
            if defer:
                if not out.finished:
                    continue
                text, logprobs = "".join(choice.texts), merge_completion_logprobs(choice.logprobs)
                ids = list(choice.token_ids) if req.return_token_ids else None
            progress = (continuous_usage or req.return_token_ids) and bool(out.outputs[0].token_ids)
            if not text and not out.finished and not (logprobs and logprobs.tokens) and not progress:
                # Nothing a client could see (a held-back partial character): skip, unless it
                # follows token progress through continuous usage stats.
                continue
            chunk = CompletionChunk(
                id=response_id,
                created=created,
                model=model,
                choices=[
                    CompletionStreamChoice(
                        index=seq.choice_index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=choice.finish_reason if out.finished else None,
                        stop_reason=choice.stop_reason if out.finished else None,
                        token_ids=ids,
                        prompt_token_ids=prompt_ids.pop(seq.choice_index, None),
                    )
                ],
            )
            if continuous_usage:
                chunk.usage = usage.info()
            if producer and out.finished:
                chunk.kv_transfer = kv_transfer_result(state, out, seq)
            frame = tail + sse_frame(chunk.model_dump_json())
            if unfinished:
                tail = b""
                yield frame
            else:
                tail = frame
        if req.include_usage:
            final = CompletionChunk(
                id=response_id, created=created, model=model, choices=[], usage=usage.info()
            )
            tail += sse_frame(final.model_dump_json())
    refused_before_start(failed, produced)
    yield FinalFrames(tail + (failed.frame or b"") + DONE_FRAME)
