"""Send one streamed request and time it: TTFT, every inter-chunk gap, end-to-end latency, usage.

Timing rules (the same for every backend):
* A *token chunk* is a chunk carrying output (text, reasoning text or tool-call deltas), or the
  chunk that ends the choice (``finish_reason``): that one brings the last token even when it
  shows no text (an EOS or stop token, or an answer whose only token is one), unless per-chunk
  usage says it brought none. A role-only or otherwise empty chunk is not one.
* TTFT: send -> the first token chunk.
* ITL: the gap between consecutive token chunks. A chunk may carry several tokens, so ITL is per
  chunk; ``stream_chunks`` counts those chunks and ITL has ``stream_chunks - 1`` entries.
* E2E: send -> end of the stream (``[DONE]`` or the connection's clean end after the last chunk).
* A server that answers with one JSON body despite ``stream: true`` is measured as one chunk
  (TTFT = E2E, no ITL).
* Embeddings (``--endpoint embeddings``) are one JSON answer: TTFT = E2E, no generated tokens;
  the prompt tokens come from its usage.
* The Responses API (``--endpoint responses``) streams typed events: text comes from
  ``response.output_text.delta`` (and ``response.reasoning_text.delta``) events, a function call's
  ``response.function_call_arguments.delta`` events are token chunks without answer text, the
  stream ends with ``response.completed`` or ``response.incomplete`` (finish reasons ``stop`` /
  ``length``), whose response carries the usage; ``response.failed`` and ``error`` events are
  stream errors, ``response.cancelled`` (ferry's, a cancelled background response) an abort.
* Token counts come from the final ``usage`` (``stream_options.include_usage``); without usage,
  the chunk count stands in and ``usage_missing`` is set.
* With ``--continuous-usage-stats`` (vLLM's ``stream_options.continuous_usage_stats``) every
  chunk carries the running usage, so ``chunk_tokens`` records the tokens each token chunk
  delivered (tokens of text-less chunks, e.g. held-back partial UTF-8, count with the next
  token chunk). ``token_count_mismatch`` then means sum(chunk_tokens) != usage; without per-chunk
  usage it means stream_chunks != usage, i.e. the server did not stream one token per chunk
  (it batched tokens, held text back, or dropped/duplicated text).

Failures are recorded, never raised: HTTP status, timeout, connection error, broken stream,
an error object in the stream (``{"error": ...}``, or older vLLM's ``{"object": "error", ...}``),
a stream the server aborted (``finish_reason: "abort"``, vLLM's value for a request ended before
its stop condition), an unparseable or malformed response (a chunk of the wrong shape, or a
stream that ends without any token chunk or finish reason: there is no TTFT to measure).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.client.sse import SSEParser
from bench.client.types import ENDPOINT_PATHS, ErrorKind, RequestRecord

_MAX_ERROR_CHARS = 500


@dataclass
class Outcome:
    """A record filled in plus the generated text (kept only for conversation history) and, from
    the Responses API, the response's id (a session's next turn continues it)."""

    record: RequestRecord
    text: str = ""
    response_id: str | None = None


class _StreamError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


_RESPONSES_TEXT = ("response.output_text.delta", "response.reasoning_text.delta")
# A function call's arguments are output too (as chat's tool-call deltas), but not answer text.
_RESPONSES_CALL = "response.function_call_arguments.delta"
# "response.cancelled" is ferry's event for a cancelled background response: the server gave up.
_RESPONSES_END = {
    "response.completed": "stop",
    "response.incomplete": "length",
    "response.cancelled": "abort",
}


def _responses_usage(response: dict[str, Any]) -> dict[str, Any] | None:
    """A Responses usage object in chat's terms (what ``_count_tokens`` reads)."""
    usage = response.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("input_tokens_details")
    return {
        "prompt_tokens": usage.get("input_tokens"),
        "completion_tokens": usage.get("output_tokens"),
        "prompt_tokens_details": details if isinstance(details, dict) else None,
    }


def _obj(value: Any, what: str) -> dict[str, Any]:
    """``value`` as an object ({} for null/absent); a TypeError names a part of the wrong shape."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{what} is {type(value).__name__}, not an object")
    return value


def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"{what} is {type(value).__name__}, not a string")
    return value


def _is_error(chunk: dict[str, Any], responses: bool) -> bool:
    """An error event: ``{"error": ...}`` (OpenAI, SGLang, vLLM), ``{"object": "error", ...}``
    (vLLM before its errors took OpenAI's shape), or the Responses API's failure events."""
    if chunk.get("error") or chunk.get("object") == "error":
        return True
    return responses and chunk.get("type") in ("error", "response.failed")


def _chunk_text(chunk: dict[str, Any], chat: bool) -> tuple[str, bool, str | None]:
    """Output text, whether the chunk carries tool-call deltas (output too, but not text a
    conversation's history holds), and finish reason of a streamed chunk (first choice only; n=1).
    A TypeError names a part of the wrong shape (the request is then a bad response)."""
    choices = chunk.get("choices") or []
    if not isinstance(choices, list):
        raise TypeError(f"choices is {type(choices).__name__}, not a list")
    if not choices:
        return "", False, None
    choice = _obj(choices[0], "choices[0]")
    calls = False
    if chat:
        delta = _obj(choice.get("delta"), "delta")
        text = _text(delta.get("content"), "delta.content")
        text += _text(delta.get("reasoning_content") or delta.get("reasoning"), "delta.reasoning_content")
        tool_calls = delta.get("tool_calls") or []
        if not isinstance(tool_calls, list):
            raise TypeError(f"delta.tool_calls is {type(tool_calls).__name__}, not a list")
        calls = any(isinstance(call, dict) and isinstance(call.get("function"), dict) for call in tool_calls)
    else:
        text = _text(choice.get("text"), "text")
    finish = choice.get("finish_reason")
    return text, calls, None if finish is None else _text(finish, "finish_reason")


async def send_request(
    client: httpx.AsyncClient,
    base_url: str,
    endpoint: str,
    body: dict[str, Any],
    headers: dict[str, str],
    record: RequestRecord,
    timeout_s: float,
) -> Outcome:
    """Send ``body`` streaming to ``endpoint`` and fill ``record``. Never raises on request failure."""
    out = Outcome(record)
    start = time.perf_counter()
    try:
        await asyncio.wait_for(
            _stream(client, base_url + ENDPOINT_PATHS[endpoint], endpoint, body, headers, out, start),
            timeout_s,
        )
        if record.finish_reason == "abort":  # vLLM's reason for a request ended before its stop condition
            _fail(record, ErrorKind.ABORTED, "the server aborted the request (finish_reason 'abort')")
        else:
            record.ok = True
    except (asyncio.TimeoutError, httpx.TimeoutException):
        _fail(record, ErrorKind.TIMEOUT, f"no complete answer within {timeout_s:g} s")
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        _fail(record, ErrorKind.CONNECT, str(exc) or type(exc).__name__)
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.CloseError) as exc:
        _fail(record, ErrorKind.BROKEN_STREAM, str(exc) or type(exc).__name__)
    except _StreamError as exc:
        _fail(record, exc.kind, str(exc))
    except httpx.HTTPError as exc:
        _fail(record, ErrorKind.BROKEN_STREAM, f"{type(exc).__name__}: {exc}")
    if record.e2e_s is None:
        record.e2e_s = time.perf_counter() - start
    return out


def _fail(record: RequestRecord, kind: str, message: str) -> None:
    record.ok = False
    record.error_kind = kind
    record.error = message[:_MAX_ERROR_CHARS]


async def _stream(
    client: httpx.AsyncClient,
    url: str,
    endpoint: str,
    body: dict[str, Any],
    headers: dict[str, str],
    out: Outcome,
    start: float,
) -> None:
    record = out.record
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        record.http_status = resp.status_code
        if resp.status_code != 200:
            raw = await resp.aread()
            raise _StreamError(ErrorKind.http(resp.status_code), _error_message(raw))
        if resp.headers.get("content-type", "").startswith("application/json"):
            await _whole_answer(resp, endpoint, out, start)
            return
        chat, responses = endpoint == "chat", endpoint == "responses"
        parser = SSEParser()
        last_chunk_t: float | None = None
        pieces: list[str] = []
        usage: dict[str, Any] | None = None
        counted = 0  # running completion_tokens at the last token chunk (continuous usage)
        done = False
        async for line in resp.aiter_lines():
            data = parser.feed(line)
            if data is None:
                continue
            if data.strip() == "[DONE]":
                done = True
                break
            now = time.perf_counter()
            try:
                chunk = json.loads(data)
            except ValueError:
                raise _StreamError(ErrorKind.BAD_RESPONSE, f"unparseable chunk: {data[:200]!r}") from None
            if not isinstance(chunk, dict):
                raise _StreamError(ErrorKind.BAD_RESPONSE, f"chunk is not an object: {data[:200]!r}")
            if _is_error(chunk, responses):
                raise _StreamError(ErrorKind.STREAM_ERROR, _error_message(json.dumps(chunk).encode()))
            response: dict[str, Any] = {}
            try:
                chunk_usage = _obj(chunk.get("usage"), "usage")
                if responses:
                    response = _obj(chunk.get("response"), "response")
                    kind = chunk.get("type")
                    output = kind in _RESPONSES_TEXT or kind == _RESPONSES_CALL
                    delta = _text(chunk.get("delta"), "delta") if output else ""
                    text = delta if kind in _RESPONSES_TEXT else ""
                    calls, finish = kind == _RESPONSES_CALL and bool(delta), _RESPONSES_END.get(kind)
                else:
                    text, calls, finish = _chunk_text(chunk, chat)
            except TypeError as exc:
                raise _StreamError(
                    ErrorKind.BAD_RESPONSE, f"malformed chunk ({exc}): {data[:200]!r}"
                ) from None
            running = chunk_usage.get("completion_tokens")
            running = running if isinstance(running, int) else None
            if responses:
                if isinstance(response.get("id"), str):
                    out.response_id = response["id"]
                if finish is not None:
                    usage = _responses_usage(response)
                    done = True
                delivered = bool(text) or calls  # the end event follows the last delta, brings no token
            else:
                # The chunk that ends the choice brings its last token even without text (EOS or
                # a stop token), unless per-chunk usage says it brought none.
                delivered = bool(text) or calls or (finish is not None and running != counted)
            if delivered:
                if running is not None:
                    record.chunk_tokens.append(running - counted)
                    counted = running
                if last_chunk_t is None:
                    record.ttft_s = now - start
                else:
                    record.itl_s.append(now - last_chunk_t)
                last_chunk_t = now
                record.stream_chunks += 1
                pieces.append(text)
            if finish:
                record.finish_reason = finish
                if record.ttft_s is None:  # an answer with no output at all: its end is its first token
                    record.ttft_s = now - start
            if chunk_usage:
                usage = chunk_usage
            if done:  # the Responses API's last event (it sends no [DONE])
                break
        if not done and record.finish_reason is None:
            raise _StreamError(ErrorKind.BROKEN_STREAM, "stream ended before [DONE] or a finish_reason")
        if record.ttft_s is None:  # e.g. only role / empty chunks, then [DONE]: nothing was generated
            raise _StreamError(
                ErrorKind.BAD_RESPONSE, "the stream ended without any token chunk or finish_reason"
            )
        record.e2e_s = time.perf_counter() - start
        out.text = "".join(pieces)
        _count_tokens(record, usage)


async def _whole_answer(resp: httpx.Response, endpoint: str, out: Outcome, start: float) -> None:
    """A server that ignored ``stream: true`` and sent one JSON answer: the first token arrived
    with the last, so TTFT = E2E and there are no inter-token gaps."""
    record = out.record
    raw = await resp.aread()
    record.e2e_s = record.ttft_s = time.perf_counter() - start
    try:
        body = json.loads(raw)
        if endpoint == "embeddings":
            data = body["data"]
            if not isinstance(data, list) or not data:
                raise KeyError("data")
            out.text, record.stream_chunks, record.finish_reason = "", 1, "stop"
            usage = body.get("usage") or {}
            record.prompt_tokens = usage.get("prompt_tokens")
            record.completion_tokens = 0  # nothing is generated: the answer is the vectors
            record.usage_missing = not isinstance(record.prompt_tokens, int)
            return
        if endpoint == "responses":
            text = "".join(
                part.get("text") or ""
                for item in body["output"]
                if item.get("type") == "message"
                for part in item.get("content") or []
            )
            finish = "length" if body.get("status") == "incomplete" else "stop"
            usage = _responses_usage(body)
            out.response_id = body.get("id")
        else:
            choice = body["choices"][0]
            text = (choice.get("message") or {}).get("content") if endpoint == "chat" else choice.get("text")
            finish, usage = choice.get("finish_reason"), body.get("usage")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise _StreamError(ErrorKind.BAD_RESPONSE, f"unparseable answer: {raw[:200]!r}") from None
    out.text = text or ""
    record.stream_chunks = 1 if out.text else 0
    record.finish_reason = finish
    _count_tokens(record, usage)


def _count_tokens(record: RequestRecord, usage: Any) -> None:
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        record.completion_tokens = usage["completion_tokens"]
        record.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
        details = usage.get("prompt_tokens_details")
        record.cached_tokens = (
            _int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None
        )
        if record.chunk_tokens and len(record.chunk_tokens) == record.stream_chunks:
            record.token_count_mismatch = sum(record.chunk_tokens) != record.completion_tokens
        else:
            record.chunk_tokens = []  # partial per-chunk usage says nothing reliable
            record.token_count_mismatch = record.completion_tokens != record.stream_chunks
    else:
        record.usage_missing = True
        record.completion_tokens = record.stream_chunks
        record.prompt_tokens = record.input_len


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _error_message(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace")
    try:
        body = json.loads(text)
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:_MAX_ERROR_CHARS]
        if isinstance(err, str):
            return err[:_MAX_ERROR_CHARS]
        if body.get("object") == "error" and body.get("message"):  # older vLLM's error shape
            return str(body["message"])[:_MAX_ERROR_CHARS]
    except (ValueError, AttributeError):
        pass
    return text[:_MAX_ERROR_CHARS]
