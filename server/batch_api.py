"""OpenAI's Files and Batches API on a replica: ``/v1/files*`` and ``/v1/batches*``.

Files are uploaded as OpenAI's SDK sends them (``multipart/form-data`` with ``file`` and
``purpose``; at most ``--max-file-bytes``, checked by ``EdgeMiddleware``) and kept in the
``BatchStore``. Only ``purpose="batch"`` is taken, and such a file is checked whole at upload:
every non-blank line a request line with a unique ``custom_id``, a supported ``url`` and no
streaming (else 400 naming the line). ``POST /v1/batches`` checks that its input file is a batch
file whose lines all name its ``endpoint`` and hands it to ``BatchJobs``. Every refusal is a 4xx
in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException

from server.batch_jobs import BatchJobs
from server.batch_lines import BATCH_URLS, input_lines, parse_line
from server.batch_store import CANCELLABLE, page
from server.errors import APIError, bad_request, json_body, validated
from server.protocol import ErrorResponse

T = TypeVar("T")
MAX_BATCH_LINES = 50_000  # OpenAI's limit on requests per batch
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413)
}


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str
    completion_window: Literal["24h"]
    # OpenAI's bounds: 16 pairs, keys of at most 64 characters, values of at most 512.
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = (
        Field(default=None, max_length=16)
    )


def check_batch_file(text: str, urls: tuple[str, ...] = BATCH_URLS) -> list[str]:
    """The request lines of a batch input file; 400 naming the first line that is not one."""
    lines = input_lines(text)
    if not lines:
        raise bad_request("The batch file has no requests.", param="file")
    if len(lines) > MAX_BATCH_LINES:
        raise bad_request(f"A batch file holds at most {MAX_BATCH_LINES} requests, this one {len(lines)}.")
    seen: set[str] = set()
    for number, raw in enumerate(lines, start=1):
        parsed = parse_line(raw, urls)
        if isinstance(parsed, tuple):
            raise bad_request(
                f"Line {number} of the batch file: {parsed[1]['error']['message']}", param="file"
            )
        if parsed.custom_id in seen:
            raise bad_request(
                f"Line {number}: the custom_id {parsed.custom_id!r} is used twice.", param="file"
            )
        seen.add(parsed.custom_id)
    return lines


def _found(value: T | None, kind: str, object_id: str | None) -> T:
    """``value``, or a 404 naming the object that is not there."""
    if value is None:
        raise APIError(404, f"No such {kind}: '{object_id or ''}'.", code="not_found")
    return value


async def _form_fields(request: Request) -> dict[str, tuple[str | None, bytes]]:
    """An upload's ``multipart/form-data`` fields by name: (filename or None for a plain field,
    bytes), parsed by Starlette's form parser (python-multipart); 400 when it is not one."""
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise bad_request("Upload a file as multipart/form-data with the fields 'file' and 'purpose'.")
    try:
        form = await request.form(max_files=1, max_fields=16)
    except (MultiPartException, StarletteHTTPException) as e:
        detail = getattr(e, "message", None) or getattr(e, "detail", None) or str(e)
        raise bad_request(f"The multipart body is malformed: {detail}") from None
    try:
        fields: dict[str, tuple[str | None, bytes]] = {}
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                fields[name] = (value.filename or "", await value.read())
            else:
                fields[name] = (None, value.encode())
        return fields
    finally:
        await form.close()


def add_batch_routes(app: FastAPI, jobs: BatchJobs) -> None:
    store = jobs.store

    @app.post("/v1/files", responses=_ERRORS)
    async def upload_file(request: Request) -> Any:
        fields = await _form_fields(request)
        purpose = fields.get("purpose", (None, b""))[1].decode("utf-8", "replace")
        if "file" not in fields or fields["file"][0] is None:
            raise bad_request("The upload has no 'file' field.", param="file")
        if purpose != "batch":
            raise bad_request(
                f"The purpose {purpose!r} is not supported: ferry keeps files for the Batch API only "
                "(purpose 'batch').",
                param="purpose",
            )
        filename, data = fields["file"]
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise bad_request("The batch file is not UTF-8 text.", param="file") from e
        await asyncio.to_thread(check_batch_file, text)  # up to 50,000 lines: off the event loop
        return JSONResponse(
            await asyncio.to_thread(store.add_file, data, filename or "upload.jsonl", purpose)
        )

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
        data = _found(await asyncio.to_thread(store.file_data, file_id), "File", file_id)
        return Response(data, media_type="application/jsonl")

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
        data = _found(
            await asyncio.to_thread(store.file_data, body.input_file_id), "File", body.input_file_id
        )
        lines = await asyncio.to_thread(check_batch_file, data.decode("utf-8"), (body.endpoint,))
        return JSONResponse(jobs.start(body.input_file_id, body.endpoint, lines, body.metadata))

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
