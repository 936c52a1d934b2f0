"""One batch input line in, one batch output line out, through the replica's own app.

Shared by `ferry run-batch` (``server/run_batch.py``) and the Batch API (``server/batch_jobs.py``).
A line is ``{"custom_id", "method": "POST", "url", "body"}`` (OpenAI's batch input shape, vLLM's
``run-batch``); its answer is ``{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}``. ``error`` is null for a 2xx answer; for any other answer it is ``{"code",
"message"}`` and ``response.body`` the OpenAI error body, so readers of OpenAI's shape (error in
the body) and of vLLM's (a non-null ``error``) both see it.

Each request is an in-process ASGI call into the same app ``ferry serve`` serves (``AppCaller``):
validation, parameters, errors and usage are the HTTP API's by construction. This module must
never answer a line any other way, and never let one bad line stop the others.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

logger = logging.getLogger("ferry.batch")

# The routes a line may name (OpenAI's batch endpoints ferry serves, and vLLM's scoring ones).
BATCH_URLS = (
    "/v1/responses",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
)
# An overloaded replica (429) is asked again after this long at least, for at most RETRY_FOR_S.
RETRY_MIN_S = 0.05
RETRY_FOR_S = 60.0

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class BatchRequestLine(BaseModel):
    """One line of a batch input file."""

    model_config = ConfigDict(extra="ignore")

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


@dataclass
class Answer:
    status: int
    body: bytes
    request_id: str


class AppCaller:
    """POSTs JSON to an ASGI app in this process, as a client on loopback would (the API key
    included, so the app's edge checks run unchanged)."""

    def __init__(self, app: ASGIApp, api_key: str | None = None) -> None:
        self.app = app
        self.api_key = api_key

    async def post(
        self, path: str, body: bytes, request_id: str, gone: asyncio.Event | None = None
    ) -> Answer:
        """The app's answer; ``gone`` set while it runs acts as a client disconnect (the engine
        request is aborted and the app answers 499)."""
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", request_id.encode()),
        ]
        if self.api_key:
            headers.append((b"authorization", b"Bearer " + self.api_key.encode()))
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": headers,
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 0),
        }
        disconnect = gone or asyncio.Event()
        sent_body = False

        async def receive() -> dict:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnect.wait()
            return {"type": "http.disconnect"}

        status = 500
        answered_id = request_id
        chunks: list[bytes] = []

        async def send(message: dict) -> None:
            nonlocal status, answered_id
            if message["type"] == "http.response.start":
                status = int(message["status"])
                for key, value in message.get("headers", ()):
                    if key.lower() == b"x-request-id":
                        answered_id = value.decode("latin-1")
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, send)
        return Answer(status, b"".join(chunks), answered_id)


def line_error(code: str, message: str, status: int = 400) -> dict[str, Any]:
    """An OpenAI error body for a line that never reached an endpoint."""
    error_type = "BadRequestError" if status < 500 else "InternalServerError"
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


def output_line(custom_id: str | None, status: int, request_id: str, body: Any) -> dict[str, Any]:
    error = None
    if not 200 <= status < 300:
        info = body.get("error") if isinstance(body, dict) else None
        info = info if isinstance(info, dict) else {}
        error = {"code": info.get("code") or str(status), "message": info.get("message") or str(body)}
    return {
        "id": f"batch_req_{request_id}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": error,
    }


def parse_line(
    raw: str | bytes, urls: Sequence[str] = BATCH_URLS
) -> BatchRequestLine | tuple[str | None, dict]:
    """The line, or (its custom_id when it has one, an error body) when it cannot be sent."""
    try:
        data = json.loads(raw)
    except ValueError as e:
        return None, line_error("invalid_json_line", f"The line is not valid JSON: {e}.")
    custom_id = data.get("custom_id") if isinstance(data, dict) else None
    custom_id = custom_id if isinstance(custom_id, str) else None
    try:
        line = BatchRequestLine.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "line"
        return custom_id, line_error("invalid_request_line", f"{where}: {first['msg']}.")
    if line.url not in urls:
        message = f"The url {line.url!r} is not supported here; use one of {', '.join(urls)}."
        return custom_id, line_error("invalid_url", message)
    if line.body.get("stream"):
        message = "Streaming is not supported in a batch: leave 'stream' unset or false."
        return custom_id, line_error("streaming_not_supported", message)
    if line.body.get("background"):  # its answer would be a queued response, not the result
        message = "Background responses are not supported in a batch: leave 'background' unset or false."
        return custom_id, line_error("background_not_supported", message)
    encoding = line.body.get("encoding_format")
    if line.url == "/v1/embeddings" and encoding in ("bytes", "bytes_only"):  # no JSON body to hold
        message = (
            f"encoding_format {encoding!r} answers binary data, which a batch output line cannot hold: "
            "use 'float' or 'base64'."
        )
        return custom_id, line_error("binary_encoding_not_supported", message)
    return line


async def answer_line(
    caller: AppCaller,
    raw: str | bytes,
    urls: Sequence[str] = BATCH_URLS,
    gone: asyncio.Event | None = None,
) -> dict[str, Any] | None:
    """The output line of one input line (None when ``gone`` was set before it was answered)."""
    request_id = uuid.uuid4().hex
    parsed = parse_line(raw, urls)
    if isinstance(parsed, tuple):
        return output_line(parsed[0], 400, request_id, parsed[1])
    payload = json.dumps(parsed.body).encode()
    deadline = time.monotonic() + RETRY_FOR_S
    while True:
        try:
            answer = await caller.post(parsed.url, payload, request_id, gone)
        except Exception:  # the app's 500 was sent before it raised: the line fails, the rest run
            logger.exception("batch request %s failed", request_id)
            return output_line(
                parsed.custom_id, 500, request_id, line_error("internal_error", "Internal error.", 500)
            )
        if gone is not None and gone.is_set():
            return None
        if answer.status != 429 or time.monotonic() >= deadline:
            break
        await asyncio.sleep(RETRY_MIN_S)  # the queue is full: a slot frees within steps
    try:
        body: Any = json.loads(answer.body)
    except ValueError:
        body = line_error("invalid_response", answer.body.decode("utf-8", "replace"), answer.status)
    return output_line(parsed.custom_id, answer.status, answer.request_id, body)


@dataclass
class Progress:
    """Counts of a batch run, logged every ``every_s`` seconds and at the end."""

    name: str
    total: int
    every_s: float = 5.0
    completed: int = 0
    failed: int = 0
    _last_log: float = 0.0

    def done(self, line: dict[str, Any]) -> None:
        if line["error"] is None:
            self.completed += 1
        else:
            self.failed += 1
        now = time.monotonic()
        if now - self._last_log >= self.every_s or self.completed + self.failed == self.total:
            self._last_log = now
            self.log()

    def log(self) -> None:
        logger.info(
            "%s: %d/%d requests done (%d failed)",
            self.name,
            self.completed + self.failed,
            self.total,
            self.failed,
        )


async def stream_lines(
    caller: AppCaller,
    lines: AsyncIterator[str | bytes],
    concurrency: int,
    done: Callable[[int, dict[str, Any]], None],
    urls: Sequence[str] = BATCH_URLS,
    progress: Progress | None = None,
    gate: asyncio.Semaphore | None = None,
    gone: asyncio.Event | None = None,
) -> None:
    """Answer every line of ``lines``, handing each output line to ``done(index, line)`` as it
    comes (in any order); at most ``concurrency`` requests at once (and at most ``gate``'s count
    across every run sharing it). A line is taken from ``lines`` only once a slot is free, so no
    more than the running lines are held. Once ``gone`` is set no line starts and the running ones
    are aborted; ``done`` never hears of them."""
    own = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task] = set()

    def release() -> None:
        own.release()
        if gate is not None:
            gate.release()

    async def one(index: int, raw: str | bytes) -> None:
        try:
            line = await answer_line(caller, raw, urls, gone)
            if line is not None:
                done(index, line)
                if progress is not None:
                    progress.done(line)
        finally:
            release()

    index = 0
    try:
        while True:
            await own.acquire()
            if gate is not None:
                await gate.acquire()
            raw = None if gone is not None and gone.is_set() else await anext(lines, None)
            if raw is None:
                release()
                break
            task = asyncio.ensure_future(one(index, raw))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            index += 1
        if tasks:
            await asyncio.gather(*tasks)
    except BaseException:  # ``done`` failed (a full disk), or the run is cancelled: none goes on
        for task in tasks:
            task.cancel()
        raise
    finally:
        aclose = getattr(lines, "aclose", None)
        if aclose is not None:
            await aclose()


async def read_ahead(
    lines: Iterable[str | bytes], max_lines: int = 64, max_chars: int = 1 << 20
) -> AsyncIterator[str | bytes]:
    """``lines``, taken from their iterator in a worker thread a few at a time (at most
    ``max_lines``, and no more once ``max_chars`` are taken), so that a file's lines are read from
    disk off the event loop while only a little of it is held."""
    it = iter(lines)

    def take() -> list[str | bytes]:
        chunk: list[str | bytes] = []
        size = 0
        for line in it:
            chunk.append(line)
            size += len(line)
            if len(chunk) >= max_lines or size >= max_chars:
                break
        return chunk

    while chunk := await asyncio.to_thread(take):
        for line in chunk:
            yield line


def file_lines(file: IO[bytes]) -> Iterator[str]:
    """The non-blank lines of a binary file from where it stands (blank ones are skipped, as vLLM
    and OpenAI do), read one at a time. Lines end at ``\n`` only (a ``\r`` before it is JSON
    whitespace; ``str.splitlines`` would also cut at U+2028, U+2029 and U+0085, which JSON allows raw
    inside a string); a leading byte order mark (a file saved as "UTF-8 with BOM") is dropped when
    reading from the start. UnicodeDecodeError if it is not UTF-8: a line is decoded alone, and ``\n`` is never
    part of a multi-byte UTF-8 sequence, so this is the whole file's check."""
    first = file.tell() == 0
    for raw in file:
        line = raw.decode("utf-8").removesuffix("\n")
        if first:
            line = line.removeprefix("\ufeff")
            first = False
        if line.strip():
            yield line


class FileLines:
    """The request lines of a checked batch input file, read from its open handle each time they
    are iterated (never held whole). The handle stays valid when the stored file is deleted
    meanwhile (POSIX); ``close`` closes it."""

    def __init__(self, file: IO[bytes], count: int) -> None:
        self.file = file
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[str]:
        self.file.seek(0)
        return file_lines(self.file)

    def close(self) -> None:
        self.file.close()
