"""OpenAI's Files and Batches API on a replica: ``/v1/files*`` and ``/v1/batches*``.

Files are uploaded as OpenAI's SDK sends them (``multipart/form-data`` with ``file`` and
``purpose``; at most ``--max-file-bytes``, counted by ``EdgeMiddleware`` as the body streams in: 413
the moment it is passed) and kept in the ``BatchStore``. An upload is never held in memory whole:
Starlette's form parser spools the file part to an anonymous temporary file (in memory up to 1 MiB),
which is checked line by line and copied into the store in chunks; a file is served back from disk
in chunks too. Only ``purpose="batch"`` is taken, and such a file is checked whole at upload:
every non-blank line a request line with a unique ``custom_id``, a supported ``url`` and no
streaming (else 400 naming the line). ``POST /v1/batches`` checks that its input file is a batch
file whose lines all name its ``endpoint`` and hands it to ``BatchJobs``; that check, and the run
after it, read the file from disk a line at a time (``FileLines``), so no step of a batch holds
its input (or its output, ``server/batch_results.py``) whole. An upload's ``expires_after`` and a
batch's ``output_expires_after`` (OpenAI's bounds) set a file's ``expires_at``, past which it reads
as gone (``BatchStore``). Every refusal is a 4xx in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Iterable
from typing import IO, Annotated, Any, Literal, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import ClientDisconnect

from server.batch_jobs import BatchJobs
from server.batch_lines import BATCH_URLS, FileLines, file_lines, parse_line
from server.batch_store import CANCELLABLE, page
from server.errors import APIError, bad_request, json_body, validated
from server.protocol import ErrorResponse

T = TypeVar("T")
MAX_BATCH_LINES = 50_000  # OpenAI's limit on requests per batch
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413)
}


class ExpiresAfter(BaseModel):
    """OpenAI's expiration policy of a file (``files.create``'s ``expires_after``, a batch's
    ``output_expires_after`` for its output and error files): seconds after the file is made."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=2_592_000)  # OpenAI's bounds: an hour to 30 days


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str
    completion_window: Literal["24h"]
    # OpenAI's bounds: 16 pairs, keys of at most 64 characters, values of at most 512.
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = (
        Field(default=None, max_length=16)
    )
    output_expires_after: ExpiresAfter | None = None


def check_batch_lines(lines: Iterable[str], urls: tuple[str, ...] = BATCH_URLS) -> int:
    """The number of a batch file's non-blank ``lines``, taken one at a time; 400 naming the first
    that is not a request line, or when there are none or more than ``MAX_BATCH_LINES``. Only a
    digest of each ``custom_id`` is kept (the duplicate check), never a line."""
    seen: set[bytes] = set()
    count = 0
    for count, raw in enumerate(lines, start=1):  # noqa: B007 - count is read after the loop
        if count > MAX_BATCH_LINES:
            continue  # only counted, for the message
        parsed = parse_line(raw, urls)
        if isinstance(parsed, tuple):
            raise bad_request(
                f"Line {count} of the batch file: {parsed[1]['error']['message']}", param="file"
            )
        digest = hashlib.blake2b(parsed.custom_id.encode(), digest_size=16).digest()
        if digest in seen:
            raise bad_request(
                f"Line {count}: the custom_id {parsed.custom_id!r} is used twice.", param="file"
            )
        seen.add(digest)
    if count == 0:
        raise bad_request("The batch file has no requests.", param="file")
    if count > MAX_BATCH_LINES:
        raise bad_request(f"A batch file holds at most {MAX_BATCH_LINES} requests, this one {count}.")
    return count


def check_upload(file: IO[bytes], urls: tuple[str, ...] = BATCH_URLS) -> int:
    """Check a batch file from its start, streaming, a line at a time (blocking: run it in a
    thread); its number of request lines. 400 if it is not UTF-8."""
    file.seek(0)
    try:
        return check_batch_lines(file_lines(file), urls)
    except UnicodeDecodeError as e:
        raise bad_request("The batch file is not UTF-8 text.", param="file") from e


def _found(value: T | None, kind: str, object_id: str | None) -> T:
    """``value``, or a 404 naming the object that is not there."""
    if value is None:
        raise APIError(404, f"No such {kind}: '{object_id or ''}'.", code="not_found")
    return value


async def _form(request: Request) -> tuple[FormData, UploadFile]:
    """An upload's form and its ``file`` (spooled by Starlette's form parser, python-multipart;
    the caller closes the form); 400 when the body is not such a form or its purpose not "batch"."""
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise bad_request("Upload a file as multipart/form-data with the fields 'file' and 'purpose'.")
    try:
        form = await request.form(max_files=1, max_fields=16)
    except (MultiPartException, StarletteHTTPException) as e:
        detail = getattr(e, "message", None) or getattr(e, "detail", None) or str(e)
        raise bad_request(f"The multipart body is malformed: {detail}") from None
    except ClientDisconnect:  # nothing was stored: the parser closed (so removed) its spool file
        raise bad_request("The upload ended before its body was complete.") from None
    file, purpose = form.get("file"), form.get("purpose")
    if not isinstance(file, UploadFile):
        await form.close()
        raise bad_request("The upload has no 'file' field.", param="file")
    if purpose != "batch":
        await form.close()
        raise bad_request(
            f"The purpose {purpose if isinstance(purpose, str) else ''!r} is not supported: ferry keeps "
            "files for the Batch API only (purpose 'batch').",
            param="purpose",
        )
    return form, file


def _expires_after(form: FormData) -> int | None:
    """The seconds of an upload's ``expires_after`` (sent by the SDK as the form fields
    ``expires_after[anchor]`` and ``expires_after[seconds]``), or None; 400 when out of bounds."""
    fields = {k[len("expires_after[") : -1]: v for k, v in form.items() if k.startswith("expires_after[")}
    if not fields:
        return None
    try:
        return ExpiresAfter.model_validate(fields).seconds
    except ValidationError as e:
        first = e.errors()[0]
        where = "expires_after." + ".".join(str(p) for p in first["loc"])
        raise bad_request(f"{where}: {first['msg']}.", param=where) from None


async def _chunks(data: IO[bytes], size: int = 1 << 18) -> AsyncIterator[bytes]:
    """``data`` read from disk a chunk at a time (off the event loop), then closed."""
    try:
        while chunk := await asyncio.to_thread(data.read, size):
            yield chunk
    finally:
        data.close()


def add_batch_routes(app: FastAPI, jobs: BatchJobs) -> None:
    store = jobs.store

    @app.post("/v1/files", responses=_ERRORS)
    async def upload_file(request: Request) -> Any:
        form, file = await _form(request)
        try:
            expires_s = _expires_after(form)
            await asyncio.to_thread(check_upload, file.file)  # up to 50,000 lines: off the event loop
            file.file.seek(0)
            name = file.filename or "upload.jsonl"
            record = await asyncio.to_thread(store.add_file, file.file, name, "batch", expires_s)
        finally:
            await form.close()
        return JSONResponse(record)

    @app.get("/v1/files", responses=_ERRORS)
    async def list_files(
        purpose: str | None = None,
        limit: int = Query(10_000, ge=1, le=10_000),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> Any:
        files = await asyncio.to_thread(store.files)  # reads every record: off the event loop
        keep = None if purpose is None else lambda f: f["purpose"] == purpose
        return JSONResponse(_found(page(files, limit, after, order, keep), "File", after))

    @app.get("/v1/files/{file_id}", responses=_ERRORS)
    async def retrieve_file(file_id: str) -> Any:
        return JSONResponse(_found(store.file(file_id), "File", file_id))

    @app.delete("/v1/files/{file_id}", responses=_ERRORS)
    async def delete_file(file_id: str) -> Any:
        _found(store.delete_file(file_id) or None, "File", file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    @app.get("/v1/files/{file_id}/content", responses=_ERRORS)
    async def file_content(file_id: str) -> Any:
        # Opened before it is answered: a file deleted meanwhile is still read whole (POSIX).
        data = _found(await asyncio.to_thread(store.open_file_data, file_id), "File", file_id)
        size = os.fstat(data.fileno()).st_size
        headers = {"content-length": str(size)}
        return StreamingResponse(_chunks(data), media_type="application/jsonl", headers=headers)

    @app.post("/v1/batches", responses=_ERRORS)
    async def create_batch(request: Request) -> Any:
        body = validated(BatchCreateRequest, await json_body(request))
        if body.endpoint not in BATCH_URLS:
            raise bad_request(
                f"The endpoint {body.endpoint!r} is not supported; use one of {', '.join(BATCH_URLS)}.",
                param="endpoint",
            )
        record = _found(store.file(body.input_file_id), "File", body.input_file_id)
        if record["purpose"] != "batch":
            raise bad_request(
                f"The file {body.input_file_id!r} has purpose {record['purpose']!r}, not 'batch'.",
                param="input_file_id",
            )
        # Opened once: checked from this handle, then run from it (a file deleted meanwhile is
        # still read whole, POSIX), a line at a time, never held in memory whole.
        data = _found(
            await asyncio.to_thread(store.open_file_data, body.input_file_id), "File", body.input_file_id
        )
        try:
            count = await asyncio.to_thread(check_upload, data, (body.endpoint,))
        except BaseException:
            data.close()
            raise
        lines = FileLines(data, count)
        expires_s = body.output_expires_after.seconds if body.output_expires_after else None
        return JSONResponse(jobs.start(body.input_file_id, body.endpoint, lines, body.metadata, expires_s))

    @app.get("/v1/batches", responses=_ERRORS)
    async def list_batches(limit: int = Query(20, ge=1, le=100), after: str | None = None) -> Any:
        # reads records from disk: off the event loop
        return JSONResponse(_found(await asyncio.to_thread(store.batches_page, limit, after), "Batch", after))

    @app.get("/v1/batches/{batch_id}", responses=_ERRORS)
    async def retrieve_batch(batch_id: str) -> Any:
        return JSONResponse(_found(store.batch(batch_id), "Batch", batch_id))

    @app.post("/v1/batches/{batch_id}/cancel", responses=_ERRORS)
    async def cancel_batch(batch_id: str) -> Any:
        record = _found(store.batch(batch_id), "Batch", batch_id)
        if record["status"] in CANCELLABLE:
            jobs.cancel(batch_id)
        elif record["status"] != "cancelling":
            raise APIError(
                409, f"Cannot cancel a batch with status '{record['status']}'.", code="batch_not_cancellable"
            )
        return JSONResponse(store.batch(batch_id))
