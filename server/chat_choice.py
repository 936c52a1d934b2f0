"""One chat choice as it is answered: what it has gathered of its outputs (``ChoiceState``), the
reasoning splitter and shaper its text goes through, and the role and echoed text around it.

Shared by the whole answer (``server/serving_chat.py``) and the stream (``server/chat_stream.py``),
so both read an output, split the reasoning and choose the answer's role the same way.
"""

from __future__ import annotations

import dataclasses

from engine.outputs import RequestOutput
from server.chat_protocol import ChatCompletionRequest, TokenLogprob
from server.chat_shape import ChoiceShaper
from server.logprobs import chat_logprobs
from server.sequence_request import SequenceRequest
from server.serving_common import delivered_text
from server.state import ServerState
from server.tools import ToolPlan


@dataclasses.dataclass
class ChoiceState:
    """What one choice has gathered of its engine outputs (``add_output``)."""

    texts: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_entries: list | None = None  # the engine's prompt logprobs (``prompt_logprobs``)


def resumed_split(state: ServerState, seq: SequenceRequest, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a resumed whole answer's ``text``, after its resumed tokens' text:
    None for a part that has no text (the caller joins them to the resumed tokens' own)."""
    shaper = ChoiceShaper(None, splitter(state, seq))
    shaper.skip(delivered_text(state, seq, seq.resume_token_ids or []))
    shaped, last = shaper.feed(text), shaper.finish()
    return (shaped.reasoning + last.reasoning) or None, (shaped.content + last.content) or None


def splitter(state: ServerState, seq: SequenceRequest):
    """The choice's reasoning splitter. Under a constraint from the first token the answer holds
    thinking only if it opens with ``<think>`` (the constraint wrote it): otherwise a parser that
    assumes the prompt opened the thinking would take the constrained answer for unfinished thoughts."""
    spec = seq.params.structured_outputs
    requires_start = True if spec is not None and spec.after_token_id is None else None
    if requires_start is None and state.reasoning is not None and state.reasoning.prompt_decides:
        tail = state.tokenizer.decode(seq.prompt_token_ids[-8:], skip_special_tokens=False)
        requires_start = state.reasoning.requires_start_after(tail)
    return state.new_reasoning_splitter(requires_start=requires_start)


def new_shaper(state: ServerState, seq: SequenceRequest, tools: ToolPlan | None) -> ChoiceShaper:
    """A stream's shaper for the choice ``seq`` (reasoning split, then ``tools``' calls taken out)."""
    return ChoiceShaper(tools, splitter(state, seq))


def add_output(
    state: ServerState, choice: ChoiceState, req: ChatCompletionRequest, out: RequestOutput
) -> tuple[str, list[TokenLogprob] | None]:
    """Takes ``out`` into ``choice``; returns its new text and (with ``logprobs``) its tokens' logprobs."""
    o = out.outputs[0]
    choice.texts.append(o.text)
    choice.token_ids += o.token_ids
    logprobs = None
    if req.logprobs:
        logprobs = chat_logprobs(
            state.tokenizer,
            o.token_ids,
            o.logprobs,
            None if req.logprob_token_ids else req.top_logprobs or 0,
            req.return_tokens_as_token_ids,
        )
        choice.logprobs += logprobs
    if out.finished:
        choice.finish_reason = o.finish_reason
        choice.stop_reason = o.stop_reason
        choice.prompt_entries = out.prompt_logprobs
    return o.text, logprobs


def answer_role(state: ServerState, req: ChatCompletionRequest) -> str:
    """The role of the answer's message, as vLLM names it: ``--response-role`` (default "assistant")
    when the prompt asks for a new turn, else the role of the message it continues."""
    if req.add_generation_prompt:
        return state.config.response_role
    return req.messages[-1].role


def echoed_text(req: ChatCompletionRequest, role: str) -> str:
    """What ``echo`` puts in front of the answer (vLLM's rule): the last message's text when that
    message has the answer's role, its text (and refusal) parts joined by newlines; else nothing."""
    if not req.echo or not req.messages or req.messages[-1].role != role:
        return ""
    content = req.messages[-1].content
    if isinstance(content, list):
        texts = (part.refusal if part.type == "refusal" else part.text for part in content)
        return "\n".join(text for text in texts if text is not None)
    return content or ""
