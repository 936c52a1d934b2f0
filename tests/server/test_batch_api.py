"""OpenAI's Files and Batches API on a replica, driven by the official SDK over loopback: the whole
lifecycle (answers equal direct requests', failed requests in the error file), cancel, the
concurrency bound, the API key, and every refusal as a 4xx in OpenAI's shape. Across API server
processes: ``test_batch_api_servers`` below."""

from __future__ import annotations

import asyncio
import io
import json
import os
import threading
import time

import httpx
import openai
import pytest

from server.batch_jobs import POLL_S, BatchJobs
from server.batch_lines import AppCaller
from server.batch_store import ALIVE_STALE_S, BatchStore

KEY = "sk-batch-test"
CONCURRENCY = 2
MAX_FILE_BYTES = 20_000
PROMPTS = ["Hello there", "What is a ferry?", "Count to three"]


def _client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def replica(tiny_llama, server_process, serve_logs):
    srv = server_process(
        tiny_llama,
        [
            "--api-key",
            KEY,
            "--deterministic",
            "--max-batch-concurrency",
            str(CONCURRENCY),
            "--max-file-bytes",
            str(MAX_FILE_BYTES),
            "--num-kv-blocks",
            "512",
        ],  # fmt: skip
        serve_logs,
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(replica) -> openai.OpenAI:
    return _client(replica.url)


def _jsonl(*lines: dict) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _chat(custom_id: str, content: str, **extra: object) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0, **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _upload(client: openai.OpenAI, data: bytes, purpose: str = "batch"):
    return client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose=purpose)


def _wait(client: openai.OpenAI, batch_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
    return batch


def test_batch_lifecycle(client, replica) -> None:
    lines = [_chat(f"req-{i}", p) for i, p in enumerate(PROMPTS)]
    lines.insert(1, _chat("wrong-model", "Hi", model="no-such-model"))
    upload = _upload(client, _jsonl(*lines))
    assert upload.object == "file" and upload.purpose == "batch" and upload.status == "processed"
    assert upload.bytes == len(_jsonl(*lines)) and upload.filename == "requests.jsonl"
    assert client.files.retrieve(upload.id).model_dump() == upload.model_dump()

    created = client.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert created.status == "validating" and created.object == "batch" and created.id.startswith("batch_")
    assert created.metadata == {"job": "nightly"} and created.input_file_id == upload.id
    assert created.expires_at == created.created_at + 24 * 3600
    assert created.request_counts.total == 4

    done = _wait(client, created.id)
    assert done.status == "completed" and done.errors is None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 3, 1)
    assert created.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.failed_at is None and done.cancelled_at is None and done.metadata == {"job": "nightly"}

    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == ["req-0", "req-1", "req-2"]  # input order
    for o, prompt in zip(out, PROMPTS, strict=True):
        direct = client.chat.completions.create(
            model=replica.model_name,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=6,
            temperature=0,
        )
        body = o["response"]["body"]
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert body["usage"]["prompt_tokens"] == direct.usage.prompt_tokens
        assert body["usage"]["completion_tokens"] == direct.usage.completion_tokens == 6
    # OpenAI's batch usage: the answered requests' tokens summed; the model that answered them.
    assert created.usage.total_tokens == 0 and created.model is None
    prompt_tokens = sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in out)
    assert (done.usage.input_tokens, done.usage.output_tokens) == (prompt_tokens, 18)
    assert done.usage.total_tokens == prompt_tokens + 18 and done.model == replica.model_name
    assert done.usage.input_tokens_details.cached_tokens >= 0
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert len(errors) == 1 and errors[0]["custom_id"] == "wrong-model"
    assert errors[0]["response"]["status_code"] == 404
    assert errors[0]["response"]["body"]["error"]["code"] == "model_not_found"
    assert errors[0]["error"]["code"] == "model_not_found"

    output_file = client.files.retrieve(done.output_file_id)
    assert output_file.purpose == "batch_output" and output_file.filename == f"{done.id}_output.jsonl"
    listed = [f.id for f in client.files.list()]
    assert {upload.id, done.output_file_id, done.error_file_id} <= set(listed)
    assert [f.id for f in client.files.list(purpose="batch_output")] == [
        done.error_file_id,
        done.output_file_id,
    ]
    assert done.id in [b.id for b in client.batches.list()]
    assert client.batches.list(limit=1).data[0].id == client.batches.list().data[0].id  # newest first

    deleted = client.files.delete(upload.id)
    assert deleted.deleted is True and deleted.id == upload.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)
    assert client.batches.retrieve(done.id).status == "completed"  # a batch outlives its input file
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(done.id)


def test_batch_cancel_and_concurrency_bound(client, replica) -> None:
    lines = [_chat(f"long-{i}", f"story {i}", max_tokens=200, ignore_eos=True) for i in range(12)]
    batch = client.batches.create(
        input_file_id=_upload(client, _jsonl(*lines)).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    seen: list[int] = []
    stop = threading.Event()

    def sample_load() -> None:  # what the engine's routes are serving now (the batch's requests)
        with httpx.Client(base_url=replica.url, timeout=10) as http:
            while not stop.is_set():
                seen.append(http.get("/load").json()["server_load"])
                time.sleep(0.01)

    sampler = threading.Thread(target=sample_load)
    sampler.start()
    try:
        deadline = time.monotonic() + 30
        while client.batches.retrieve(batch.id).request_counts.completed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        stop.set()
        sampler.join()
    assert max(seen) == CONCURRENCY  # the batch filled its bound and never went past it
    # An interactive request is served while the batch runs.
    direct = client.completions.create(model=replica.model_name, prompt="hi", max_tokens=2)
    assert direct.usage.completion_tokens == 2
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    done = _wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at >= done.cancelling_at
    assert 1 <= done.request_counts.completed < 12 and done.request_counts.failed == 0
    out = client.files.content(done.output_file_id).text.splitlines()
    assert len(out) == done.request_counts.completed and done.error_file_id is None
    assert all(json.loads(x)["response"]["body"]["usage"]["completion_tokens"] == 200 for x in out)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def _error(exc: pytest.ExceptionInfo) -> dict:
    return (
        exc.value.body
        if isinstance(exc.value.body, dict) and "code" in exc.value.body
        else exc.value.body["error"]
    )


@pytest.mark.parametrize(
    ("data", "purpose", "message"),
    [
        (_jsonl(_chat("a", "x")), "fine-tune", "purpose 'fine-tune' is not supported"),
        (b'{"custom_id": "a"}\nnot json\n', "batch", "Line 1 of the batch file: method"),
        (
            _jsonl(_chat("a", "x")) + b"{oops\n",
            "batch",
            "Line 2 of the batch file: The line is not valid JSON",
        ),
        (_jsonl(_chat("a", "x"), _chat("a", "y")), "batch", "Line 2: the custom_id 'a' is used twice"),
        (_jsonl({**_chat("a", "x"), "url": "/v1/moderations"}), "batch", "The url '/v1/moderations'"),
        (_jsonl(_chat("a", "x", stream=True)), "batch", "Streaming is not supported"),
        (b"\n\n", "batch", "no requests"),
        (b"\xff\xfe", "batch", "not UTF-8"),
    ],
)
def test_bad_uploads_are_400(client, data: bytes, purpose: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        _upload(client, data, purpose)
    assert message in _error(exc)["message"]
    assert exc.value.response.json()["error"]["type"] == "BadRequestError"


def test_refusals(client, replica) -> None:
    upload = _upload(client, _jsonl(_chat("a", "x")))
    create = dict(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    cases = [
        (
            {**create, "endpoint": "/v1/images"},
            openai.BadRequestError,
            "endpoint '/v1/images' is not supported",
        ),
        ({**create, "endpoint": "/v1/completions"}, openai.BadRequestError, "Line 1"),  # lines name another
        ({**create, "completion_window": "48h"}, openai.BadRequestError, "completion_window"),
        ({**create, "input_file_id": "file-" + "0" * 32}, openai.NotFoundError, "No such File"),
        ({**create, "input_file_id": "../../etc/passwd"}, openai.NotFoundError, "No such File"),
        ({**create, "metadata": {"k" * 65: "v"}}, openai.BadRequestError, "metadata"),
        ({**create, "metadata": {f"k{i}": "v" for i in range(17)}}, openai.BadRequestError, "metadata"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error) as exc:
            client.batches.create(**kwargs)
        assert message in _error(exc)["message"], kwargs
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.batches.cancel("batch_" + "0" * 32)
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-nope")
    with pytest.raises(openai.NotFoundError):
        client.files.delete("file-" + "0" * 32)

    # Larger than --max-file-bytes: 413 before anything is stored.
    big = _jsonl(*[_chat(f"r{i}", "y" * 100) for i in range(200)])
    assert len(big) > MAX_FILE_BYTES
    with pytest.raises(openai.APIStatusError) as exc:
        _upload(client, big)
    assert exc.value.status_code == 413 and _error(exc)["code"] == "request_too_large"
    # Not multipart at all.
    r = httpx.post(
        replica.url + "/v1/files", json={"purpose": "batch"}, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]

    # The API key guards every route of the two APIs.
    wrong = _client(replica.url, "sk-wrong")
    for call in (
        lambda: wrong.files.list(),
        lambda: wrong.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="batch"),
        lambda: wrong.files.content(upload.id),
        lambda: wrong.batches.list(),
        lambda: wrong.batches.create(**create),
    ):
        with pytest.raises(openai.AuthenticationError):
            call()
    assert client.files.retrieve(upload.id).id == upload.id


def _running_batch(tiny_llama, server_process, serve_logs, tmp_path, n: int):
    """A server on ``tmp_path`` running a batch of ``n`` long requests, one at a time. Its drain
    would wait an hour: a stop held up by the batch is killed at ``stop``'s bound, not a clean exit."""
    flags = ["--batch-dir", str(tmp_path), "--max-batch-concurrency", "1", "--drain-timeout", "3600"]
    srv = server_process(tiny_llama, flags, serve_logs)
    client = _client(srv.start().url)
    lines = [_chat(f"r{i}", "x", max_tokens=500, ignore_eos=True) for i in range(n)]
    batch = client.batches.create(
        input_file_id=_upload(client, _jsonl(*lines)).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).status != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return srv, batch


def test_a_batch_running_at_shutdown_ends_failed(tiny_llama, server_process, serve_logs, tmp_path) -> None:
    """SIGTERM stops running batches at once (their requests aborted, the drain not held up by
    them); with --batch-dir the record stays on disk, saying so."""
    srv, batch = _running_batch(tiny_llama, server_process, serve_logs, tmp_path, 8)
    assert srv.stop() == 0  # a clean exit: the hour-long drain was not held up by the batch
    record = json.loads((tmp_path / "batches" / f"{batch.id}.json").read_text())
    assert record["status"] == "failed" and record["failed_at"] is not None
    assert record["errors"]["data"][0]["code"] == "server_shutdown"
    assert record["request_counts"]["completed"] < 8


def test_a_batch_whose_process_died_reads_failed(tiny_llama, server_process, serve_logs, tmp_path) -> None:
    """kill -9 mid-batch: the record on disk still says in_progress, but its process no longer
    touches the batch's .alive file, so the next server on the directory reports it failed."""
    srv, batch = _running_batch(tiny_llama, server_process, serve_logs, tmp_path, 4)
    srv.proc.kill()
    srv.stop()
    assert json.loads((tmp_path / "batches" / f"{batch.id}.json").read_text())["status"] == "in_progress"
    alive = tmp_path / "batches" / f"{batch.id}.alive"
    os.utime(alive, (time.time() - 60, time.time() - 60))  # as if it had died a minute ago
    again = server_process(tiny_llama, ["--batch-dir", str(tmp_path)], serve_logs)
    try:
        found = _client(again.start().url).batches.retrieve(batch.id)
        assert found.status == "failed" and found.errors.data[0].code == "owner_lost"
        assert found.failed_at == int(alive.stat().st_mtime)
    finally:
        again.stop()


def test_liveness_of_running_batches(tmp_path) -> None:
    store = BatchStore(str(tmp_path))
    record = {"id": store.new_batch_id(), "status": "in_progress", "created_at": 100, "request_counts": {}}
    store.save_batch(record)
    assert store.batch(record["id"])["status"] == "failed"  # never touched: no process runs it
    store.touch_alive(record["id"])
    assert store.batch(record["id"])["status"] == "in_progress"
    stale = time.time() - ALIVE_STALE_S - 1
    os.utime(tmp_path / "batches" / f"{record['id']}.alive", (stale, stale))
    assert store.batch(record["id"])["status"] == "failed"
    store.save_batch({**record, "status": "completed"})  # ended: liveness no longer matters
    assert store.batch(record["id"])["status"] == "completed"


def test_batch_listing_reads_only_the_page(tmp_path, monkeypatch) -> None:
    """Pages come newest first from the order markers' names: a page of 5 of 40 batches reads 5
    records, ``after`` continues where the last page ended, and an unknown ``after`` is None (404)."""
    import server.batch_store as batch_store

    store = BatchStore(str(tmp_path))
    ids = []
    for i in range(40):
        record = {"id": store.new_batch_id(), "status": "completed", "created_at": i, "request_counts": {}}
        store.save_batch(record)
        store.save_batch(record)  # a later save of the same batch leaves its place alone
        ids.append(record["id"])
    newest = ids[::-1]
    reads: list[str] = []
    real_read = batch_store._read_json
    monkeypatch.setattr(batch_store, "_read_json", lambda path: reads.append(path.name) or real_read(path))
    first = store.batches_page(5, None)
    assert [b["id"] for b in first["data"]] == newest[:5] and first["has_more"]
    assert (first["first_id"], first["last_id"]) == (newest[0], newest[4])
    assert sorted(reads) == sorted(f"{i}.json" for i in newest[:5])
    assert all(not k.startswith("_") for b in first["data"] for k in b)
    last = store.batches_page(20, newest[24])
    assert [b["id"] for b in last["data"]] == newest[25:] and not last["has_more"]
    assert store.batches_page(5, store.new_batch_id()) is None


def test_batches_written_before_the_order_markers_are_listed(tmp_path) -> None:
    """A batch directory from before the markers existed: its records are read once, marked, and
    listed in creation order; an unreadable record is left out, not fatal."""
    store = BatchStore(str(tmp_path))
    ids = []
    for i in range(3):
        record = {"id": store.new_batch_id(), "status": "completed", "created_at": i, "request_counts": {}}
        store.save_batch(record)
        ids.append(record["id"])
    order = tmp_path / "batches" / "order"
    for marker in order.iterdir():
        marker.unlink()
    (tmp_path / "batches" / f"{store.new_batch_id()}.json").write_text("{half a record")
    assert [b["id"] for b in store.batches_page(10, None)["data"]] == ids[::-1]
    assert len(list(order.iterdir())) == 3


def test_a_cancel_asked_for_before_the_run_ends_ends_it_cancelled(tmp_path) -> None:
    """Another API server process writes the cancel marker while this one's last requests finish,
    before its 0.2 s poll sees it: the client was told "cancelling", so the batch ends cancelled
    (with every answer in its output file), never completed."""
    store = BatchStore(str(tmp_path))
    jobs = BatchJobs(store, 2)
    batch_ids: list[str] = []

    async def app(scope, receive, send) -> None:  # a replica that answers at once
        await receive()
        store.request_cancel(batch_ids[0])  # as another process's POST /cancel would
        body = json.dumps({"object": "text_completion", "choices": []}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    jobs.caller = AppCaller(app)

    async def run() -> dict:
        lines = [json.dumps(_chat(f"r{i}", "x")) for i in range(3)]
        record = jobs.start("file-x", "/v1/chat/completions", lines, None)
        batch_ids.append(record["id"])
        task, _ = jobs._runs[record["id"]]
        await task
        return store.batch(record["id"])

    done = asyncio.run(run())
    assert done["status"] == "cancelled" and done["completed_at"] is None
    assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert len(store.file_data(done["output_file_id"]).splitlines()) == 3


async def answer_but_slow(scope, receive, send) -> None:  # noqa: ANN001
    """A stand-in replica app for batch runs: answers a chat at once, except one whose message is
    "slow", which it holds until the client goes (an abort)."""
    body = json.loads((await receive())["body"])
    if body["messages"][0]["content"] == "slow":
        await receive()  # the client is gone: nothing is answered
        return
    answer = json.dumps({"object": "chat.completion", "choices": []}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": answer})


@pytest.mark.parametrize("slow_disk", [False, True])
def test_a_batch_still_running_when_its_window_ends_expires(tmp_path, monkeypatch, slow_disk) -> None:
    """OpenAI's "expired": the answered requests go to the output file, the running ones are
    aborted and, with those never started, go to the error file as batch_expired. With a slow
    disk, the running batch's count saver polls while the result files are written: its counts
    must not lose the expired requests (they once did, on a slow CI machine)."""
    if slow_disk:
        write = BatchJobs._write_results

        def slow_write(self, record, results) -> None:
            time.sleep(3 * POLL_S)
            write(self, record, results)

        monkeypatch.setattr(BatchJobs, "_write_results", slow_write)
    store = BatchStore(str(tmp_path))
    jobs = BatchJobs(store, 2, window_s=2)

    jobs.caller = AppCaller(answer_but_slow)

    async def run() -> dict:
        lines = [json.dumps(_chat(f"r{i}", "fast" if i < 2 else "slow")) for i in range(5)]
        record = jobs.start("file-x", "/v1/chat/completions", lines, None)
        await jobs._runs[record["id"]][0]
        return store.batch(record["id"])

    done = asyncio.run(run())
    assert done["status"] == "expired" and done["expired_at"] >= done["expires_at"] - 1
    assert done["cancelled_at"] is None and done["completed_at"] is None
    assert done["request_counts"] == {"total": 5, "completed": 2, "failed": 3}
    output = [json.loads(x) for x in store.file_data(done["output_file_id"]).splitlines()]
    errors = [json.loads(x) for x in store.file_data(done["error_file_id"]).splitlines()]
    assert [x["custom_id"] for x in output] == ["r0", "r1"]
    assert [(x["custom_id"], x["error"]["code"]) for x in errors] == [
        (f"r{i}", "batch_expired") for i in (2, 3, 4)
    ]
