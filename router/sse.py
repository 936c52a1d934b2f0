"""Server-sent events of OpenAI streams: splitting, and the bookkeeping that makes failover exact.

The router needs the ids of the tokens a stream has sent, to resume it elsewhere. It asks replicas
for ``return_token_ids`` (each chunk's choice then carries ``token_ids``, as in vLLM) and, from
replicas not yet seen honouring that, for logprobs with ``return_tokens_as_token_ids`` (tokens
written ``"token_id:123"``, also vLLM's). ``StreamTracker`` reads each event once: it collects the
ids (the ``resume.token_ids`` of a failover), removes what the client did not ask for (dropping
chunks that only carried router-requested ids or logprobs: a replica sends no chunk for a token that
shows nothing yet unless the client asked for its ids, logprobs or continuous usage), and, after a
failover, makes the new replica's chunks look like the rest of the stream (same ``id`` and
``created``, no second ``role`` chunk nor second ``prompt_token_ids`` / ``prompt_text``, ``usage``
counting every token sent).

A replica that cannot finish a stream it started (its engine process died or is stopping) says so
with an error event before ``[DONE]`` (``{"error": {"type": "ServiceUnavailableError", "code":
"service_unavailable", …}}``): the tracker holds that event back (``replica_error``) and drops the
``[DONE]``, so the relay treats the stream as broken and resumes it on another replica, as it does
for a replica that died outright. Errors a client caused (4xx, and 408: the replica's own request
timeout) and 500s (a bug, which another replica would likely meet too) end the stream as they are.
"""

from __future__ import annotations

import json
from typing import Any

from server.error_types import error_type

DONE = b"[DONE]"
# The statuses whose in-stream error means "this replica could not finish": those a whole answer
# is retried on (router/retry.py) but 429, which a replica answers before a stream starts.
_REPLICA_FAILURE_STATUSES = (502, 503, 504)
_REPLICA_FAILURE_TYPES = frozenset(error_type(s) for s in _REPLICA_FAILURE_STATUSES)
_REPLICA_FAILURE_CODES = frozenset({"service_unavailable", *_REPLICA_FAILURE_STATUSES})
# Chunk fields the client asked for that make a chunk worth sending though its choices show nothing.
_CLIENT_FIELDS = ("usage", "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer")
# vLLM's prompt fields of a chat chunk (top level, on each choice's role chunk) and of a completions
# choice (``prompt_token_ids``, on its first chunk): each choice's are relayed once, from the replica
# that started it (a resumed replica shows the same prompt again).
_PROMPT_FIELDS = ("prompt_token_ids", "prompt_text")


def replica_failure(error: Any) -> bool:
    """An OpenAI error object sent in a stream says the replica failed (its engine died, it is
    stopping, an upstream of its own failed), not that the request is at fault: another replica
    can finish the stream."""
    if not isinstance(error, dict):
        return False
    return error.get("type") in _REPLICA_FAILURE_TYPES or error.get("code") in _REPLICA_FAILURE_CODES


class SSESplitter:
    """Reassembles events (``...\\n\\n``) from arbitrary network chunks."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk if self._buf else chunk
        if b"\n\n" not in buf:
            if b"\r\n\r\n" in buf:  # some servers frame with CRLF
                buf = buf.replace(b"\r\n", b"\n")
            else:
                self._buf = buf
                return []
        parts = buf.split(b"\n\n")
        self._buf = parts.pop()
        return [p for p in parts if p]

    @property
    def pending(self) -> bytes:
        return self._buf


def event_data(event: bytes) -> bytes | None:
    """The payload of a ``data:`` event (multi-line data joined), or None for comments/others."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]
    lines = [ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def typed_event(event: bytes) -> dict[str, Any] | None:
    """A named event's JSON object (one with a string ``type``: Anthropic's and the Responses API's),
    or None for anything else (comments, ``[DONE]``, malformed data), which is relayed as it is."""
    data = event_data(event)
    if data is None:
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and isinstance(obj.get("type"), str) else None


class StreamTracker:
    # What ends the client's stream when its replica died after the last token was sent.
    END_EVENT = b"data: [DONE]\n\n"

    def __init__(
        self,
        *,
        chat: bool,
        client_wants_token_ids: bool,
        client_ids_in_logprobs: bool = False,
        num_choices: int = 1,
        client_sent_kv_transfer: bool = False,
        resumed: list[int] | None = None,
    ) -> None:
        self.chat = chat
        # The client's own ``resume.token_ids`` (a router in front of this one): a failover's resume
        # goes on after them and what was sent (``usage`` counts only what was sent, as a replica's).
        self.resumed = list(resumed or [])
        self.num_choices = num_choices  # the stream is finished once each has its finish_reason
        self.keep_ids = client_wants_token_ids
        # A replica's kv_transfer result is the router's business (prefill/decode hand-off), never
        # a client's: relayed only to a client that sent kv_transfer itself (one router behind another).
        self.keep_kv_transfer = client_sent_kv_transfer
        # Where this stream's token ids come from besides ``token_ids``: logprobs the router added
        # (``router_logprobs``: stripped before the client sees them) or the client's own
        # ``return_tokens_as_token_ids`` logprobs.
        self.client_ids_in_logprobs = client_ids_in_logprobs
        self.router_logprobs = False  # set per replica stream by the relay
        self.token_ids: list[int] = []  # completion tokens already sent to the client (all choices)
        self.choice_ids: dict[Any, list[int]] = {}  # the same, per choice index (an n > 1 resume)
        self.ids_complete = True  # False once a content chunk came without ids: no exact resume
        self.saw_token_ids_field = False  # the replica supports return_token_ids
        self.finished_choices: set[Any] = set()  # indexes of choices whose finish_reason was sent
        self.done = False  # [DONE] was sent
        # This replica's error event saying it could not finish (``replica_failure``), held back:
        # the relay resumes the stream elsewhere, or sends it (``failure_end``) when it cannot.
        self.replica_error: bytes | None = None
        self.roles_sent: set[Any] = set()  # indexes of choices whose role chunk was sent
        self.prompts_sent: set[Any] = set()  # indexes of choices whose prompt fields were sent
        self.failovers = 0
        self.stream_id: str | None = None
        self.created: int | None = None
        self.content_choices = 0  # choices with content relayed so far (the first one: TTFT)

    @property
    def finished(self) -> bool:
        """Every choice's finish_reason was sent: what is missing is at most the usage and [DONE]."""
        return len(self.finished_choices) >= self.num_choices

    def begin_failover(self) -> None:
        self.failovers += 1

    def failure_end(self) -> bytes | None:
        """What ends the client's stream when the replica's failure cannot be resumed: its own
        error event and ``[DONE]`` (None: it sent none)."""
        if self.replica_error is None:
            return None
        return self.replica_error + b"\n\n" + self.END_EVENT

    def process(self, event: bytes) -> bytes | None:
        """The event to send the client (bytes without the trailing blank line), or None to drop it."""
        data = event_data(event)
        if data is None:
            return event
        if not self.keep_ids and _PROMPT_IDS in data:
            data = _without_prompt_ids(data)
            event = b"data: " + data
        if data == DONE:
            if self.replica_error is not None:
                return None  # the end of a stream its replica could not finish: not the client's end
            self.done = True
            return event
        try:
            obj = json.loads(data)
        except ValueError:
            return event
        if not isinstance(obj, dict):
            return event
        if "error" in obj and "choices" not in obj:  # an error event (OpenAI's shape)
            if not self.finished and replica_failure(obj["error"]):
                self.replica_error = event
                return None
            return event
        changed = False
        if self.stream_id is None:
            self.stream_id, self.created = obj.get("id"), obj.get("created")
        elif self.failovers and "id" in obj:
            obj["id"], obj["created"] = self.stream_id, self.created
            changed = True
        changed, prompted = self._prompt_fields(obj, changed)
        if "kv_transfer" in obj and not self.keep_kv_transfer:
            del obj["kv_transfer"]
            changed = True
        choices = obj.get("choices")
        if isinstance(choices, list):
            if self.failovers and self.chat and self._is_bare_role_chunk(choices, obj):
                return None
            for choice in choices:
                changed |= self._choice(choice)
            if choices and not any(obj.get(k) for k in _CLIENT_FIELDS) and all(map(self._empty, choices)):
                # A chunk that only carried the ids or logprobs the router asked for (a token that
                # completes no character yet): the replica would not have sent it to the client.
                return None
            self.prompts_sent.update(prompted)
            if self.chat:
                self.roles_sent.update(
                    c.get("index")
                    for c in choices
                    if isinstance(c.get("delta"), dict) and "role" in c["delta"]
                )
        usage = obj.get("usage")
        if self.failovers and isinstance(usage, dict) and self.ids_complete:
            # Each replica counts only what it saw; the client must see the whole request's count.
            usage["completion_tokens"] = len(self.token_ids)
            usage["total_tokens"] = usage.get("prompt_tokens", 0) + len(self.token_ids)
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                # The resuming replica found cached KV for the prompt and the resumed tokens: of the
                # prompt, at most all of it was cached.
                details["cached_tokens"] = min(details["cached_tokens"], usage.get("prompt_tokens", 0))
            changed = True
        if not changed:
            return event
        return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()

    def _prompt_fields(self, obj: dict, changed: bool) -> tuple[bool, list[Any]]:
        """Removes the prompt fields the client does not get: ``prompt_token_ids`` it did not ask for
        (the router asks for ``return_token_ids`` itself) and those of choices already sent them.
        Returns whether ``obj`` changed, and the choices whose prompt fields it carries on."""
        choices = obj.get("choices")
        indexes = (
            [c.get("index") for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []
        )
        fresh = [i for i in indexes if i not in self.prompts_sent]
        for key in _PROMPT_FIELDS:  # a chat chunk's, for its choices
            if key in obj and (not fresh or (key == "prompt_token_ids" and not self.keep_ids)):
                del obj[key]
                changed = True
        prompted = fresh if any(key in obj for key in _PROMPT_FIELDS) else []
        for choice in choices if isinstance(choices, list) else ():  # a completions choice's
            if isinstance(choice, dict) and "prompt_token_ids" in choice:
                if self.keep_ids and choice.get("index") not in self.prompts_sent:
                    prompted.append(choice.get("index"))
                else:
                    del choice["prompt_token_ids"]
                    changed = True
        return changed, prompted

    def _choice(self, choice: Any) -> bool:
        if not isinstance(choice, dict):
            return False
        changed = False
        ids = choice.get("token_ids")
        if ids is not None:
            self.saw_token_ids_field = True
            if not self.keep_ids:
                del choice["token_ids"]
                changed = True
        elif self.router_logprobs or self.client_ids_in_logprobs:
            ids = _ids_from_logprobs(choice.get("logprobs"), self.chat)
        if self.router_logprobs and choice.get("logprobs") is not None:
            choice["logprobs"] = None
            changed = True
        if isinstance(ids, list) and ids:
            self.token_ids.extend(ids)
            self.choice_ids.setdefault(choice.get("index"), []).extend(ids)
        elif self._has_content(choice):
            self.ids_complete = False
        if self._has_content(choice):
            self.content_choices += 1
        if choice.get("finish_reason"):
            self.finished_choices.add(choice.get("index"))
        return changed

    def _has_content(self, choice: dict) -> bool:
        if self.chat:
            delta = choice.get("delta")
            return isinstance(delta, dict) and bool(
                delta.get("content")
                or delta.get("tool_calls")
                or delta.get("reasoning_content")
                or delta.get("reasoning")
            )
        return bool(choice.get("text"))

    def _empty(self, choice: Any) -> bool:
        if not isinstance(choice, dict) or choice.get("finish_reason"):
            return False
        if self.keep_ids and choice.get("token_ids"):
            return False  # ids the client asked for (a token that completes no character yet)
        if choice.get("logprobs") is not None:
            return False  # the client's logprobs (the router's were set to None by _choice)
        if self.chat:
            delta = choice.get("delta")
            return isinstance(delta, dict) and "role" not in delta and not any(delta.values())
        return not choice.get("text")

    def _is_bare_role_chunk(self, choices: list, obj: dict) -> bool:
        """The resumed replica's opening ``{"role": "assistant", "content": ""}`` chunk, already sent once
        (with ``continuous_usage_stats`` it carries a ``usage``, which the next chunk has too)."""
        if not choices:  # (no choices: the final usage chunk)
            return False
        for c in choices:
            delta = c.get("delta") if isinstance(c, dict) else None
            if not isinstance(delta, dict) or "role" not in delta or c.get("finish_reason"):
                return False
            if c.get("index") not in self.roles_sent:
                return False  # this choice's role was not sent yet: the client needs it
            if delta.get("content") or delta.get("tool_calls") or c.get("token_ids") or c.get("logprobs"):
                return False
        return True

    def resume_body(self, body: dict) -> dict:
        """The request to send the next replica: the same request, resumed after what was sent.
        With ``n`` > 1 choices: ``resume.choices``, each unfinished choice with its own tokens (the
        finished ones are left out: the replica does not run them again)."""
        out = dict(body)
        if self.num_choices > 1:
            out["resume"] = {
                "choices": [
                    {"index": i, "token_ids": self.choice_ids.get(i, [])}
                    for i in range(self.num_choices)
                    if i not in self.finished_choices
                ]
            }
        elif self.token_ids:
            out["resume"] = {"token_ids": [*self.resumed, *self.token_ids]}
        return out


class GenerateTracker(StreamTracker):
    """A stream of vLLM's ``/inference/v1/generate``: chunks whose choices carry only ``token_ids``
    (and the client's logprobs), relayed as they are, their ids collected for a resume. Its chunks
    are named by ``request_id`` (the router's X-Request-Id, which every replica it tries is sent),
    with no ``id`` or ``created`` to keep after a failover."""

    def __init__(self, num_choices: int, resumed: list[int] | None = None) -> None:
        super().__init__(chat=False, client_wants_token_ids=True, num_choices=num_choices, resumed=resumed)

    def _has_content(self, choice: dict) -> bool:
        return bool(choice.get("token_ids"))


# A prompt's ids as a replica writes them (compact JSON): a list of integers, so its end is the next
# "]". The key with both its quotes cannot occur inside a JSON string (whose quotes are escaped).
_PROMPT_IDS = b'"prompt_token_ids":['


def _without_prompt_ids(data: bytes) -> bytes:
    """``data`` without its ``prompt_token_ids`` fields, cut from the bytes: a long prompt's ids (the
    router asked for them, not the client) are not parsed and written again, which costs tens of
    milliseconds of the event loop for a 100k-token prompt."""
    while (start := data.find(_PROMPT_IDS)) >= 0:
        end = data.find(b"]", start) + 1
        if end == 0:
            return data  # not JSON: left to the parser
        if data[start - 1 : start] == b",":
            start -= 1  # a field after others: its comma goes with it
        elif data[end : end + 1] == b",":
            end += 1  # the object's first field: the comma after it
        data = data[:start] + data[end:]
    return data


def client_resume(body: dict) -> list[int] | None:
    """The token ids of the client's own ``resume`` ([] when it sent none), or None when its
    ``resume`` is not one the router can extend on a failover (a replica's to accept or refuse;
    such a stream is relayed without failover)."""
    resume = body.get("resume")
    if resume is None:
        return []
    if not isinstance(resume, dict) or set(resume) != {"token_ids"}:
        return None
    ids = resume["token_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return None
    return ids


def _ids_from_logprobs(logprobs: Any, chat: bool) -> list[int] | None:
    """Token ids from logprobs written with ``return_tokens_as_token_ids`` (``"token_id:123"``)."""
    if not isinstance(logprobs, dict):
        return None
    if chat:
        entries = logprobs.get("content")
        tokens = (
            [e.get("token") for e in entries if isinstance(e, dict)] if isinstance(entries, list) else None
        )
    else:
        tokens = logprobs.get("tokens")
    if not isinstance(tokens, list):
        return None
    out = []
    for t in tokens:
        if not isinstance(t, str) or not t.startswith("token_id:"):
            return None
        try:
            out.append(int(t[9:]))
        except ValueError:
            return None
    return out
