"""Generation through the relay (completions, chat, Anthropic Messages, streamed Responses, vLLM's
tokens-in/tokens-out generate): whole answers with retries, streams with failover.

A non-streamed answer is read whole before the client sees it, so a replica dying mid-answer is
one more retry. A stream is relayed event by event; when its replica dies part-way, the request
is re-sent to another replica with ``resume.token_ids`` = the completion tokens already sent (for
``n`` > 1, ``resume.choices``: each unfinished choice with its own tokens), and
the new replica's chunks are spliced in (``router/sse.py``, ``router/messages_stream.py``,
``router/responses_stream.py``), so the client sees one unbroken stream. A replica that ends a
stream with an error event saying it could not finish (its engine process died: a 503) counts as
one that died: the trackers hold that event back, and send it only when the stream cannot be
resumed. vLLM's generate streams are resumed as completions are (each chunk carries its token ids).
Prefill/decode orchestration can reuse ``Generation.pump`` the same way.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from router.http import Send, error_body, send_bytes, send_error
from router.messages_stream import MessagesTracker
from router.pool import Pool
from router.relay import (
    CLIENT_GONE,
    TRANSPORT_ERRORS,
    Failed,
    Opened,
    ProxyCall,
    Relay,
    response_headers,
    with_request_id,
)
from router.replica import Replica
from router.responses_stream import ResponsesTracker
from router.sse import GenerateTracker, SSESplitter, StreamTracker, client_resume
from server.error_types import error_type

Tracker = StreamTracker | MessagesTracker | ResponsesTracker


class Generation(Relay):
    """The relay plus the generation routes (``/v1/completions``, ``/v1/chat/completions``,
    ``/v1/messages``, streamed ``/v1/responses``, ``/inference/v1/generate``)."""

    async def generate(self, pool: Pool, call: ProxyCall, send: Send) -> None:
        body = call.json or {}
        if body.get("stream"):
            await self._generate_stream(pool, call, body, send)
        else:
            await self._generate_whole(pool, call, send)

    async def _generate_whole(self, pool: Pool, call: ProxyCall, send: Send) -> None:
        client_sent = "kv_transfer" in (call.json or {})
        await self.answer_whole(pool, call, call.body, send, None if client_sent else _without_kv_transfer)

    async def answer_whole(
        self,
        pool: Pool,
        call: ProxyCall,
        payload: bytes,
        send: Send,
        transform: Callable[[int, bytes], bytes] | None = None,
        failure: str = "replica failed while answering",
    ) -> None:
        """Send ``payload`` and relay the whole answer (``transform(status, content)`` applied), or
        retry on another replica (after a jittered backoff) when one dies before its answer is read;
        502 with ``failure`` when retries run out."""
        tried: set[str] = set()
        attempt = [0]
        while True:
            opened = await self.open(pool, call, payload, tried, attempt)
            if isinstance(opened, Failed):
                await send_bytes(send, opened.status, opened.body, with_request_id(opened.headers, call))
                return
            content = None
            try:
                content = await opened.response.aread()
            except TRANSPORT_ERRORS:
                self.finish(opened, False)
            finally:
                await opened.response.aclose()
                if content is None:
                    self.finish(opened, False, CLIENT_GONE)  # no-op unless the client left mid-read
            if content is None:
                tried.add(opened.replica.url)
                if not self.retry.can_retry(attempt[0]):
                    await send_error(send, 502, failure, with_request_id([], call))
                    return
                attempt[0] += 1
                call.retries += 1
                self.metrics.retries.inc()
                self.log_retry(call, opened.replica, "broke off its answer", attempt[0])
                await asyncio.sleep(self.retry.backoff(attempt[0] - 1, self.rng))
                continue
            self.finish(opened, True)
            status = opened.response.status_code
            headers = with_request_id(response_headers(opened.response), call)
            await send_bytes(
                send,
                status,
                transform(status, content) if transform is not None else content,
                headers,
                content_type=opened.response.headers.get("content-type", "application/json").encode(),
            )
            return

    async def _generate_stream(self, pool: Pool, call: ProxyCall, body: dict, send: Send) -> None:
        chat = call.path.endswith("/chat/completions")
        client_logprobs = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
        # Logprobs the router asks for (then strips) must not make a body valid that a replica refuses
        # (logprob_token_ids, chat's top_logprobs, without the client's logprobs) nor replace a chat
        # logprobs that is not a boolean (the replica's 400 too).
        asked, named = body.get("logprobs"), body.get("logprob_token_ids")
        addable = not client_logprobs and named is None
        addable &= not chat or (body.get("top_logprobs") is None and (asked is None or asked is False))
        resumed = client_resume(body)
        num_choices = _num_choices(body, chat)
        n = body.get("n")
        # Streamed text that is all completion (echo would mix prompt tokens in), of one prompt: n > 1
        # choices resume each after its own tokens (``resume.choices``), seeded ones at their own
        # seeds, as the replica derives them from the index; a client's own resume (one choice's
        # tokens) cannot say which choice it continues.
        can_resume = (
            self.max_failovers > 0
            and resumed is not None
            and (n in (None, 1) or (num_choices == n and not resumed))
            and not body.get("echo")
            and not body.get("use_beam_search")  # a search is not resumed from its best beam so far
        )

        def payload(replica: Replica, base: dict) -> tuple[bytes, bool]:
            if not _token_ids_askable(base):
                return json.dumps(base).encode(), False  # the replica answers its 400
            extra: dict[str, Any] = {"return_token_ids": True}
            router_logprobs = addable and not replica.emits_token_ids
            if router_logprobs:  # until this replica shows it honours return_token_ids
                extra.update(logprobs=True if chat else 0, return_tokens_as_token_ids=True)
            return json.dumps({**base, **extra}).encode(), router_logprobs

        tracker = StreamTracker(
            chat=chat,
            client_wants_token_ids=bool(body.get("return_token_ids")),
            client_ids_in_logprobs=client_logprobs and bool(body.get("return_tokens_as_token_ids")),
            num_choices=num_choices,
            client_sent_kv_transfer="kv_transfer" in body,
            resumed=resumed,
        )
        await self.stream(pool, call, body, send, tracker, payload if can_resume else None, _stream_error)

    async def messages(self, pool: Pool, call: ProxyCall, send: Send) -> None:
        """``POST /v1/messages`` (Anthropic's API): whole answers with retries, streams with failover
        (``router/messages_stream.py``)."""
        body = call.json or {}
        if not body.get("stream"):
            await self.answer_whole(pool, call, call.body, send)
        else:
            resumed = client_resume(body)
            tracker = MessagesTracker(
                client_wants_token_ids=bool(body.get("return_token_ids")), resumed=resumed
            )
            resumable = _with_token_ids if self.max_failovers > 0 and resumed is not None else None
            await self.stream(pool, call, body, send, tracker, resumable, _messages_error)

    async def tokens_generate(self, pool: Pool, call: ProxyCall, send: Send) -> None:
        """vLLM's ``POST /inference/v1/generate``: whole answers retried as a completion's are; streams
        resumed as a completion's (every chunk carries its token ids: the replica is asked for
        nothing more than the ``resume`` after them)."""
        body = call.json or {}
        if not body.get("stream"):
            await self.answer_whole(pool, call, call.body, send)
            return
        params = body.get("sampling_params")
        n = params.get("n") if isinstance(params, dict) else None
        num_choices = n if type(n) is int and n > 0 else 1
        resumed = client_resume(body)
        # As completions: one choice after the client's own resume, or n choices each after its own.
        can_resume = self.max_failovers > 0 and resumed is not None and (num_choices == 1 or not resumed)
        tracker = GenerateTracker(num_choices, resumed=resumed)
        await self.stream(pool, call, body, send, tracker, _as_is if can_resume else None, _stream_error)

    async def responses_stream(self, pool: Pool, call: ProxyCall, send: Send) -> None:
        """``POST /v1/responses`` with ``stream`` (not ``background``): relayed with mid-stream
        failover (``router/responses_stream.py``)."""
        tracker = ResponsesTracker()
        # A client's own resume (its response's items so far) is not state the tracker follows:
        # such a stream is relayed without failover.
        own = (call.json or {}).get("resume") is not None
        resumable = _with_token_ids if self.max_failovers > 0 and not own else None
        await self.stream(pool, call, call.json or {}, send, tracker, resumable, tracker.error_event)
        if call.on_response is not None and tracker.final is not None:
            call.on_response(tracker.final)

    async def stream(
        self,
        pool: Pool,
        call: ProxyCall,
        body: dict,
        send: Send,
        tracker: Tracker,
        payload: Callable[[Replica, dict], tuple[bytes, bool]] | None,
        error_event: Callable[[str], bytes],
    ) -> None:
        """Relay a stream; when its replica dies part-way and ``payload`` (the body to send a replica,
        asking for token ids) is given, resume it on another replica (``tracker.resume_body``)."""
        tried: set[str] = set()
        opened: Opened | Failed | None = None
        can_resume = payload is not None
        try:
            first = (lambda r: payload(r, body)) if payload is not None else call.body
            opened = await self.open(pool, call, first, tried, [0])
            if isinstance(opened, Failed):
                await send_bytes(send, opened.status, opened.body, with_request_id(opened.headers, call))
                return
            response = opened.response
            if response.status_code != 200 or not response.headers.get("content-type", "").startswith(
                "text/event-stream"
            ):
                await self.send_whole(opened, call, send)
                return
            self._answered(call, opened)
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": with_request_id(response_headers(response), call),
                }
            )
            while True:
                ok = await self.pump(opened, tracker, call, send)
                if ok or tracker.done:
                    break
                tried.add(opened.replica.url)
                opened.replica.next_probe_at = self.clock()  # let the prober confirm the death at once
                if tracker.finished:
                    await send({"type": "http.response.body", "body": tracker.END_EVENT, "more_body": True})
                    break
                if not (can_resume and tracker.ids_complete and tracker.failovers < self.max_failovers):
                    message = "the replica serving this stream failed and it cannot be resumed"
                    call.broken = True
                    self.log_stream_failure(call, opened.replica, tracker, None)
                    end = tracker.failure_end() or error_event(message)  # the replica's own words first
                    await send({"type": "http.response.body", "body": end, "more_body": True})
                    break
                tracker.begin_failover()
                self.metrics.failovers.inc()
                self.log_stream_failure(
                    call, opened.replica, tracker, (tracker.failovers, self.max_failovers)
                )
                resumed = tracker.resume_body(body)
                opened = await self.open(pool, call, lambda r, b=resumed: payload(r, b), tried, [0])
                if isinstance(opened, Failed) or opened.response.status_code != 200:
                    message = "the replica serving this stream failed and no replica could resume it"
                    call.broken = True
                    await send(
                        {"type": "http.response.body", "body": error_event(message), "more_body": True}
                    )
                    break
                self._answered(call, opened)
            await send({"type": "http.response.body", "body": b""})
        finally:
            if isinstance(opened, Opened) and not opened.finished:
                await opened.response.aclose()
                self.finish(opened, False, CLIENT_GONE)

    def log_stream_failure(
        self, call: ProxyCall, replica: Replica, tracker: Tracker, failover: tuple[int, int] | None
    ) -> None:
        """One line per stream that broke: resumed (``failover``: its number, of how many allowed)
        or ended (None)."""
        why = "sent an error event" if tracker.replica_error is not None else "broke off"
        if failover is None:
            self.request_log.warning(
                "request %s: stream from %s %s after %d tokens; it cannot be resumed",
                call.request_id,
                replica.url,
                why,
                len(tracker.token_ids),
            )
            return
        self.request_log.warning(
            "request %s: stream from %s %s after %d tokens; resumed on another replica (failover %d of %d)",
            call.request_id,
            replica.url,
            why,
            len(tracker.token_ids),
            *failover,
        )

    @staticmethod
    def _answered(call: ProxyCall, opened: Opened) -> None:
        """Tell the call who answers its stream (a resumed stream: the replica that took it over)."""
        if call.on_answered is not None:
            call.on_answered(opened.replica, opened.response)

    async def send_whole(self, opened: Opened, call: ProxyCall, send: Send) -> None:
        """A non-stream answer (or an error answer to a stream request): read it, then send it."""
        response = opened.response
        try:
            content = await response.aread()
        except TRANSPORT_ERRORS:
            self.finish(opened, False)
            await send_error(send, 502, "replica failed while answering", with_request_id([], call))
            return
        finally:
            await response.aclose()
        self.finish(opened, True)
        await send_bytes(
            send,
            response.status_code,
            content,
            with_request_id(response_headers(response), call),
            content_type=response.headers.get("content-type", "application/json").encode(),
        )

    async def pump(self, opened: Opened, tracker: Tracker, call: ProxyCall, send: Send) -> bool:
        """Relay one replica's events; True when its stream ended normally."""
        splitter = SSESplitter()
        tracker.router_logprobs = opened.router_logprobs
        tracker.replica_error = None  # this replica's own, if it says it cannot finish
        ok = False
        gone: int | None = None
        before = tracker.content_choices  # content relayed from earlier replicas (failover)
        streams = opened.replica.streams  # cut if the replica is ejected (Replica._cut_streams)
        streams.add(opened.response)
        try:
            async for chunk in opened.response.aiter_raw():
                out = []
                for event in splitter.feed(chunk):
                    relayed = tracker.process(event)
                    if relayed is not None:
                        out.append(relayed)
                        out.append(b"\n\n")
                    if opened.prefilling and tracker.content_choices > before:
                        opened.first_content()  # this replica's prefill is done
                        if not before:
                            self.metrics.ttft.observe(time.perf_counter() - call.started)
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
            ok = tracker.done or tracker.finished
            return ok
        except TRANSPORT_ERRORS:
            return False
        except asyncio.CancelledError:
            gone = CLIENT_GONE
            raise
        finally:
            streams.discard(opened.response)
            await opened.response.aclose()
            self.finish(opened, ok, 200 if ok else gone)
            if tracker.saw_token_ids_field:
                opened.replica.emits_token_ids = True


def _without_kv_transfer(status: int, content: bytes) -> bytes:
    """A whole answer without the replica's ``kv_transfer`` result (a prefill worker's, or a replica
    that took the client's request as a producer): the router's business, never a client's."""
    if b'"kv_transfer"' not in content:
        return content
    try:
        obj = json.loads(content)
    except ValueError:
        return content
    if not isinstance(obj, dict) or "kv_transfer" not in obj:
        return content
    del obj["kv_transfer"]
    return json.dumps(obj, ensure_ascii=False).encode()


def _as_is(replica: Replica, base: dict) -> tuple[bytes, bool]:
    """A generate request as it is: its chunks carry their token ids already."""
    return json.dumps(base).encode(), False


def _with_token_ids(replica: Replica, base: dict) -> tuple[bytes, bool]:
    """A Messages or Responses request asking the replica to group each chunk's events with its
    token ids (what a resume needs)."""
    if not _token_ids_askable(base):
        return json.dumps(base).encode(), False  # the replica answers its 400
    return json.dumps({**base, "return_token_ids": True}).encode(), False


def _token_ids_askable(body: dict) -> bool:
    """The router may set ``return_token_ids``: the client's own value, if any, is one a replica
    takes (overwriting an invalid one would turn the replica's 400 into a 200)."""
    return isinstance(body.get("return_token_ids", False), bool)


def _num_choices(body: dict, chat: bool) -> int:
    """How many choices a chat or completions stream has: ``n`` per prompt (a completions
    ``prompt`` may be a list of prompts)."""
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return n * len(prompt)
    return n


def _stream_error(message: str) -> bytes:
    return b"data: " + error_body(message, error_type(502), 502) + b"\n\ndata: [DONE]\n\n"


def _messages_error(message: str) -> bytes:
    error = {"type": "error", "error": {"type": "api_error", "message": message}}
    return b"event: error\ndata: " + json.dumps(error).encode() + b"\n\n"
