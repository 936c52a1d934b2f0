"""A batch's input and output are never held whole: ``POST /v1/batches`` checks its input file a
line at a time from disk, the run reads the lines as slots free up, and the answers are spooled to
disk and copied into the output file a line at a time. Measured exactly with ``tracemalloc`` (every
Python allocation of the process, worker threads included): creating and running a batch of a
25 MiB input file with 25 MiB of answers costs no more than one of 256 KiB, give or take a few
MiB, where holding either file whole would cost over 25 MiB.

Driven by the official SDK through the real Files and Batches routes (``add_batch_routes``) in this
process; the batch's requests go to a stand-in replica app that echoes each prompt in its answer.
"""

from __future__ import annotations

import asyncio
import gc
import json
import tracemalloc
from collections.abc import Callable

import httpx
import openai
from fastapi import FastAPI

from server.batch_api import add_batch_routes
from server.batch_jobs import BatchJobs
from server.batch_lines import AppCaller
from server.batch_store import BatchStore
from server.errors import install_error_handlers
from tests.server.test_batch_api import answer_but_slow

LINE_CHARS = 64 * 1024
LARGE = 400  # lines of LINE_CHARS: a 25 MiB input file and as much output
SMALL = 4
# Holding the large input (or its output) whole once would already cost ~25 MiB more than the
# small batch; reading ahead (1 MiB) and the requests in flight cost about 2 MiB.
GROWTH_BOUND = 8 * 1024 * 1024


def _line(i: int) -> dict:
    content = f"{i:06d} " + "y" * LINE_CHARS
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def _jsonl(n: int) -> bytes:
    return b"".join(json.dumps(_line(i)).encode() + b"\n" for i in range(n))


def _replica(hold: asyncio.Event | None = None):
    """A stand-in replica: answers each chat request with its prompt as the completion; with
    ``hold``, each request waits for it first."""

    async def app(scope, receive, send) -> None:
        body = json.loads((await receive())["body"])
        content = body["messages"][0]["content"]
        if hold is not None:
            await hold.wait()
        message = {"role": "assistant", "content": content}
        answer = {"object": "chat.completion", "choices": [{"index": 0, "message": message}]}
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})

    return app


def _front(jobs: BatchJobs) -> openai.AsyncOpenAI:
    app = FastAPI()
    install_error_handlers(app)
    add_batch_routes(app, jobs)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ferry.test")
    return openai.AsyncOpenAI(base_url="http://ferry.test/v1", api_key="x", http_client=http, max_retries=0)


async def _finished(jobs: BatchJobs, client: openai.AsyncOpenAI, batch_id: str):
    run = jobs._runs.get(batch_id)
    if run is not None:
        await run[0]
    return await client.batches.retrieve(batch_id)


def _check_output(store: BatchStore, file_id: str, n: int) -> None:
    """The output file holds every answer, in input order, read here a line at a time."""
    data = store.open_file_data(file_id)
    assert data is not None
    with data:
        count = 0
        for i, raw in enumerate(data):
            line = json.loads(raw)
            assert line["custom_id"] == f"r{i}" and line["error"] is None
            content = line["response"]["body"]["choices"][0]["message"]["content"]
            assert content == _line(i)["body"]["messages"][0]["content"]
            count += 1
    assert count == n


def test_create_and_run_take_the_same_memory_for_a_large_batch(tmp_path) -> None:
    store = BatchStore(str(tmp_path))
    jobs = BatchJobs(store, 2)
    jobs.caller = AppCaller(_replica())

    async def measured(n: int, check: Callable[[int], None] | None = None) -> int:
        """Allocation peak over the live memory before, while a batch of ``n`` lines is created
        and runs to its end (its input file stored beforehand)."""
        client = _front(jobs)
        data = _jsonl(n)
        file_id = store.add_file(data, "in.jsonl", "batch")["id"]
        del data
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        batch = await client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = await _finished(jobs, client, batch.id)
        peak = tracemalloc.get_traced_memory()[1] - before
        assert done.status == "completed", done
        assert done.request_counts.total == n and done.request_counts.completed == n
        assert done.error_file_id is None
        _check_output(store, done.output_file_id, n)
        await client.close()
        return peak

    async def run() -> tuple[int, int]:
        await measured(2)  # warm-up: worker threads, lazy imports
        return await measured(SMALL), await measured(LARGE)

    tracemalloc.start()
    try:
        small, large = asyncio.run(run())
    finally:
        tracemalloc.stop()
        store.close()
    print(f"peak growth: {SMALL} lines {small} B, {LARGE} lines {large} B")
    assert large < small + GROWTH_BOUND, (small, large)


def test_input_file_deleted_while_its_batch_runs(tmp_path) -> None:
    """The run reads its input from the handle the create opened: deleting the file meanwhile (as
    OpenAI allows) takes nothing from the batch, even lines not yet read."""
    store = BatchStore(str(tmp_path))
    jobs = BatchJobs(store, 2)
    n = 100  # 6.4 MiB: far past the 1 MiB read ahead (and the 2 running) before the file is deleted

    async def run():
        hold = asyncio.Event()
        jobs.caller = AppCaller(_replica(hold))
        client = _front(jobs)
        upload = await client.files.create(file=("in.jsonl", _jsonl(n)), purpose="batch")
        batch = await client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert (await client.files.delete(upload.id)).deleted
        assert store.open_file_data(upload.id) is None
        hold.set()
        done = await _finished(jobs, client, batch.id)
        await client.close()
        return done

    try:
        done = asyncio.run(run())
        assert done.status == "completed" and done.request_counts.completed == n
        _check_output(store, done.output_file_id, n)
    finally:
        store.close()


def test_expired_batch_read_from_its_file(tmp_path) -> None:
    """OpenAI's "expired" with the input read from disk: the answered lines in the output file, the
    others (running, aborted, or never read) as batch_expired lines of the error file, whose
    custom_ids come from the input file read again, in input order."""
    store = BatchStore(str(tmp_path))
    jobs = BatchJobs(store, 2, window_s=2)

    jobs.caller = AppCaller(answer_but_slow)  # r3 on are held until aborted
    lines = []
    for i in range(200):
        line = _line(i)
        line["body"]["messages"][0]["content"] = "fast" if i < 3 else "slow"
        lines.append(line)

    async def run():
        client = _front(jobs)
        data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        upload = await client.files.create(file=("in.jsonl", data), purpose="batch")
        batch = await client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = await _finished(jobs, client, batch.id)
        await client.close()
        return done

    try:
        done = asyncio.run(run())
        assert done.status == "expired"
        assert done.request_counts.model_dump() == {"total": 200, "completed": 3, "failed": 197}
        output = [json.loads(x) for x in store.file_data(done.output_file_id).splitlines()]
        errors = [json.loads(x) for x in store.file_data(done.error_file_id).splitlines()]
        assert [x["custom_id"] for x in output] == ["r0", "r1", "r2"]
        assert [(x["custom_id"], x["error"]["code"]) for x in errors] == [
            (f"r{i}", "batch_expired") for i in range(3, 200)
        ]
    finally:
        store.close()
