"""The messages of a prefill/decode hand-off (``router/pd.py``), as pure functions of JSON.

What the router sends a prefill worker, what it reads from its answer, which requests can be handed
off, and how the client's answer is put together from the first token and the decode worker's
rest (streamed: opening events and a tracker that keeps ``usage`` whole; not streamed: one merged
body). No I/O here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from router.sse import StreamTracker


@dataclass(frozen=True)
class Prefilled:
    """The prefill worker's answer, reduced to what the hand-off needs."""

    first_token: int
    text: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    block_hashes: list[str]
    id: str
    created: int
    model: str


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


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The producer request: the client's sampling fields, one token, and that token's id."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
    out.update(max_tokens=1, kv_transfer={"role": "producer"}, return_token_ids=True)
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 1:
        out["min_tokens"] = 1  # the first token still may not be EOS
    return out


def parse_prefill(path: str, content: bytes) -> Prefilled | None:
    try:
        obj = json.loads(content)
        choice = obj["choices"][0]
        token = choice["token_ids"][0]
        if path.endswith("/chat/completions"):
            text = choice["message"]["content"] or ""
        else:
            text = choice["text"]
        usage = obj["usage"]
        transfer = obj["kv_transfer"]
        return Prefilled(
            first_token=int(token),
            text=text,
            finish_reason=choice.get("finish_reason"),
            prompt_tokens=int(usage["prompt_tokens"]),
            cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
            block_hashes=list(transfer["block_hashes"]),
            id=str(obj["id"]),
            created=int(obj["created"]),
            model=str(obj["model"]),
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
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        events.append({**head, "choices": [role]})
        delta = {"content": p.text} if p.text else {}
        first = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        head["object"] = "text_completion"
        first = {"index": 0, "text": p.text, "logprobs": None, "finish_reason": finish}
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
            "choices": [{"index": 0, "logprobs": None, "finish_reason": p.finish_reason}],
            "usage": {"prompt_tokens": p.prompt_tokens, "completion_tokens": 0},
        }
        choice = obj["choices"][0]
        if chat:
            choice["message"] = {"role": "assistant", "content": ""}
        else:
            choice["text"] = ""
    else:
        obj = json.loads(content)
        choice = obj["choices"][0]
    if chat:
        message = choice.setdefault("message", {"role": "assistant"})
        message["content"] = p.text + (message.get("content") or "")
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
