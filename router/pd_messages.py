"""The messages of a prefill/decode hand-off (``router/pd.py``), as pure functions of JSON.

What the router sends a prefill worker, what it reads from its answer, which requests can be handed
off, and how the client's answer is put together from the first token and the decode worker's
rest (streamed: opening events and a tracker that keeps ``usage`` whole; not streamed: one merged
body). No I/O here.

A disaggregated request must be refused exactly as a replica refuses it (status and OpenAI error
body, before any 200): the producer request therefore carries every client field a producer
checks as the client sent it (the budget in ``kv_transfer.budget``: a producer checks it against
its context, then computes one token, ``server/handoff_params.client_budget``), and ``request_error``
validates the client's body as a replica does first, before the fields the producer request moves
(the budget, ``stream``, ``stream_options``) could be checked later than a replica checks them
(after ``model``, say: a replica's 400 for ``max_tokens: -1`` would be the producer's 404).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from router.sse import StreamTracker
from server.chat_protocol import ChatCompletionRequest
from server.completion_protocol import CompletionRequest
from server.errors import APIError, validation_error


@dataclass(frozen=True)
class Prefilled:
    """The prefill worker's answer, reduced to what the hand-off needs."""

    first_token: int
    text: str  # the first token's content as a stream shows it
    reasoning: str | None  # its reasoning_content (a replica's --reasoning-parser), None: none
    finish_reason: str | None
    stop_reason: int | str | None  # the stop token or string that ended the request there
    prompt_tokens: int
    cached_tokens: int
    block_hashes: list[str]
    id: str
    created: int
    model: str
    # The answer's role (chat): the replicas' --response-role, or the role of the message a
    # continued prompt ends in (a custom one included), which the router cannot know on its own.
    role: str = "assistant"
    # vLLM's prompt fields of the prefill answer (the producer is always asked for token ids; the text
    # only when the client asked): the client's first chunk carries them, or its whole answer.
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None


class PDTracker(StreamTracker):
    """A stream tracker that reports the prefill worker's ``cached_tokens`` in ``usage``."""

    cached_tokens: int | None = None

    def process(self, event: bytes) -> bytes | None:
        out = super().process(event)
        if out is None or self.cached_tokens is None or b'"prompt_tokens_details"' not in out:
            return out
        obj = json.loads(out[6:])
        details = (obj.get("usage") or {}).get("prompt_tokens_details")
        if not isinstance(details, dict):
            return out
        details["cached_tokens"] = self.cached_tokens
        return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def wants_disaggregation(path: str, body: dict[str, Any]) -> str | None:
    """None when the request can be disaggregated, else why not (a ``local_prefill`` reason)."""
    if body.get("n") not in (None, 1):
        return "n"
    if body.get("resume") is not None or body.get("kv_transfer") is not None:
        # The client's own hand-off fields (a router in front of this one): the hand-off's
        # would replace them, so the request is served whole, as a replica serves it.
        return "resume" if body.get("resume") is not None else "kv_transfer"
    if body.get("use_beam_search"):
        return "beam_search"  # each step of the search is a request of its own, on one replica
    if body.get("prompt_logprobs") is not None:
        return "logprobs"  # the decode worker loads the prompt's KV: it computes no prompt logits
    if path.endswith("/chat/completions"):
        if body.get("logprobs"):
            return "logprobs"
        if body.get("tools") and body.get("tool_choice") != "none":
            # A tool call's first token is not text the router could send on its own.
            return "tools"
        if body.get("echo"):
            return "echo"  # the last message's text goes before the first token, which the router sends
    else:
        if body.get("logprobs") is not None or body.get("echo"):
            return "logprobs" if body.get("logprobs") is not None else "echo"
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)) and len(prompt) != 1:
            return "prompts"
    return None


def requested_budget(path: str, body: dict[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        if isinstance(body.get(key), int):
            return body[key]
    return None if path.endswith("/chat/completions") else 16  # the replicas' defaults


# The client's budget: the producer request says ``max_tokens`` 1 (DESIGN's hand-off) and carries
# these as the client sent them in ``kv_transfer.budget``, for the producer to check them as a
# replica would (``server.handoff_params.client_budget``).
BUDGET_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The producer request: the client's fields, one token (``max_tokens`` 1, the client's budget
    in ``kv_transfer.budget``), answered whole, with that token's id."""
    streamed = body.get("stream") is True  # anything else is the producer's to accept or refuse
    drop = (*BUDGET_FIELDS, "stream", "stream_options") if streamed else BUDGET_FIELDS
    out = {k: v for k, v in body.items() if k not in drop}
    out["max_tokens"] = 1
    out["kv_transfer"] = {"role": "producer", "budget": {k: body[k] for k in BUDGET_FIELDS if k in body}}
    asked = body.get("return_token_ids")
    if asked is None or isinstance(asked, bool):
        out["return_token_ids"] = True  # else the client's value, for the producer to refuse
    least = body.get("min_tokens")
    if isinstance(least, int) and not isinstance(least, bool) and least >= 1:
        out["min_tokens"] = 1  # the first token still may not be EOS
    return out


def request_error(path: str, raw: bytes) -> APIError | None:
    """The 400 a replica answers for the client's body (``server/generation_routes``: the whole body
    through the route's model, its first error named), or None when the body is valid. The
    producer request cannot give it: its budget fields and a stream's ``stream_options`` are moved
    or left out, so a bad one would be checked after the fields a replica checks later (``model``)."""
    model = ChatCompletionRequest if path.endswith("/chat/completions") else CompletionRequest
    try:
        model.model_validate_json(raw)
    except ValidationError as e:
        return validation_error(e.errors(include_url=False))
    return None


def parse_prefill(path: str, body: dict[str, Any], content: bytes) -> Prefilled | None:
    try:
        obj = json.loads(content)
        choice = obj["choices"][0]
        token = choice["token_ids"][0]
        reasoning = None
        role = "assistant"
        prompt_ids = choice.get("prompt_token_ids")  # a completion's; a chat answer's is top-level
        if path.endswith("/chat/completions"):
            prompt_ids = obj.get("prompt_token_ids")
            role = str(choice["message"].get("role") or role)
            text = choice["message"]["content"] or ""
            reasoning = choice["message"].get("reasoning_content")
            reasoning = str(reasoning) if reasoning is not None else None
        else:
            text = choice["text"]
        finish, stop = choice.get("finish_reason"), choice.get("stop_reason")
        if finish == "stop" and isinstance(stop, str) and "\ufffd" in stop:
            # The producer's one-token end flushed an unfinished character as U+FFFD, which this
            # stop string matched: a replica going on waits for the character's next bytes. Its
            # text stops where that match starts, as a stream would have shown it so far.
            if body.get("include_stop_str_in_output") is True and text.endswith(stop):
                text = text[: -len(stop)]
            finish, stop = "length", None
        usage = obj["usage"]
        transfer = obj["kv_transfer"]
        return Prefilled(
            first_token=int(token),
            text=text,
            reasoning=reasoning,
            finish_reason=finish,
            stop_reason=stop,
            prompt_tokens=int(usage["prompt_tokens"]),
            cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
            block_hashes=list(transfer["block_hashes"]),
            id=str(obj["id"]),
            created=int(obj["created"]),
            model=str(obj["model"]),
            role=role,
            prompt_token_ids=[int(i) for i in prompt_ids] if isinstance(prompt_ids, list) else None,
            prompt_text=obj["prompt_text"] if isinstance(obj.get("prompt_text"), str) else None,
        )
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


def first_events(path: str, body: dict[str, Any], p: Prefilled, done: bool) -> list[bytes]:
    """The stream's opening events, written by the router from the prefill answer: the role chunk
    (chat) and the first token's chunk (its ``token_ids`` let the tracker resume after it)."""
    chat = path.endswith("/chat/completions")
    usage = {
        "prompt_tokens": p.prompt_tokens,
        "completion_tokens": 1,
        "total_tokens": p.prompt_tokens + 1,
        "prompt_tokens_details": {"cached_tokens": p.cached_tokens},
    }
    stream_options = body.get("stream_options") or {}
    head = {"id": p.id, "created": p.created, "model": p.model}
    events = []
    finish = p.finish_reason if done else None
    if chat:
        head["object"] = "chat.completion.chunk"
        role = {
            "index": 0,
            "delta": {"role": p.role, "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        opening: dict[str, Any] = {**head, "choices": [role]}
        if stream_options.get("continuous_usage_stats"):  # a replica's role chunk counts the prompt
            opening["usage"] = {**usage, "completion_tokens": 0, "total_tokens": p.prompt_tokens}
        opening.update(_prompt_fields(p))  # the tracker keeps what the client asked for
        events.append(opening)
        delta = {"reasoning": p.reasoning, "reasoning_content": p.reasoning} if p.reasoning else {}
        if p.text:
            delta["content"] = p.text
        first = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        head["object"] = "text_completion"
        first = {"index": 0, "text": p.text, "logprobs": None, "finish_reason": finish}
        if p.prompt_token_ids is not None:
            first["prompt_token_ids"] = p.prompt_token_ids
    if done and p.stop_reason is not None:
        first["stop_reason"] = p.stop_reason
    first["token_ids"] = [p.first_token]
    chunk: dict[str, Any] = {**head, "choices": [first]}
    if stream_options.get("continuous_usage_stats"):
        chunk["usage"] = usage
    events.append(chunk)
    if done and stream_options.get("include_usage"):
        events.append({**head, "choices": [], "usage": usage})
    return [b"data: " + json.dumps(e, separators=(",", ":")).encode() for e in events]


def merge_answer(path: str, body: dict[str, Any], p: Prefilled, content: bytes | None) -> bytes:
    """The client's answer: the first token's text in front of the decode worker's, usage whole."""
    chat = path.endswith("/chat/completions")
    if content is None:  # the prefill worker's token ended the request
        obj: dict[str, Any] = {
            "id": p.id,
            "object": "chat.completion" if chat else "text_completion",
            "created": p.created,
            "model": p.model,
            "choices": [
                {"index": 0, "logprobs": None, "finish_reason": p.finish_reason, "stop_reason": p.stop_reason}
            ],
            "usage": {"prompt_tokens": p.prompt_tokens, "completion_tokens": 0},
        }
        choice = obj["choices"][0]
        if chat:
            choice["message"] = {"role": p.role, "content": ""}
            obj.update(_prompt_fields(p))
        else:
            choice["text"] = ""
            if p.prompt_token_ids is not None:
                choice["prompt_token_ids"] = p.prompt_token_ids
        if not body.get("return_token_ids"):
            obj.pop("prompt_token_ids", None)
            choice.pop("prompt_token_ids", None)
    else:
        obj = json.loads(content)
        choice = obj["choices"][0]
    if chat:
        message = choice.setdefault("message", {"role": p.role})
        reasoning = (p.reasoning or "") + (message.get("reasoning_content") or "")
        content = p.text + (message.get("content") or "")
        if reasoning or p.reasoning is not None or "reasoning_content" in message:
            # A replica's reasoning parser shaped the answer: a part with no text is null there.
            # Both of vLLM's names, as a replica writes them (server/chat_protocol.AssistantMessage).
            message["reasoning"] = message["reasoning_content"] = reasoning or None
            content = content or None
        message["content"] = content
    else:
        choice["text"] = p.text + (choice.get("text") or "")
    if body.get("return_token_ids"):
        choice["token_ids"] = [p.first_token, *(choice.get("token_ids") or [])]
    usage = obj.setdefault("usage", {})
    usage["completion_tokens"] = int(usage.get("completion_tokens", 0)) + 1
    usage["total_tokens"] = int(usage.get("prompt_tokens", p.prompt_tokens)) + usage["completion_tokens"]
    usage["prompt_tokens_details"] = {"cached_tokens": p.cached_tokens}
    obj.pop("kv_transfer", None)
    return json.dumps(obj, ensure_ascii=False).encode()


def _prompt_fields(p: Prefilled) -> dict[str, Any]:
    """A chat answer's top-level prompt fields, from the prefill answer (those it carried)."""
    fields = {"prompt_token_ids": p.prompt_token_ids, "prompt_text": p.prompt_text}
    return {k: v for k, v in fields.items() if v is not None}
