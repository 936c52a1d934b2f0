"""``GET /v1/files`` as OpenAI pages it, through the official SDK: the ``after`` cursor is a file id,
and a listing filtered by ``purpose`` may go on from a file of another purpose (a batch's output
file between two input files)."""

from __future__ import annotations

import openai
import pytest

from server.batch_store import BatchStore
from tests.server.test_batch_api import _chat, _jsonl, _upload, _wait, client, replica  # noqa: F401 (fixtures)


def test_purpose_filter_with_a_cursor_of_another_purpose(client: openai.OpenAI) -> None:  # noqa: F811
    first = _upload(client, _jsonl(_chat("a", "Hello there")))
    batch = client.batches.create(
        input_file_id=first.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    output = client.files.retrieve(_wait(client, batch.id).output_file_id)  # type: ignore[arg-type]
    assert output.purpose == "batch_output"
    second = _upload(client, _jsonl(_chat("b", "Hi")))

    # Newest first (the default): the batch files older than the output file.
    older = client.files.list(purpose="batch", after=output.id)
    assert [f.id for f in older.data] == [first.id] and older.has_more is False
    newer = client.files.list(purpose="batch", after=output.id, order="asc")
    assert [f.id for f in newer.data] == [second.id] and newer.has_more is False
    # limit counts the kept files only; has_more says whether kept files follow.
    everything = client.files.list(order="asc")
    assert [f.id for f in everything.data] == [first.id, output.id, second.id]
    page = client.files.list(purpose="batch", after=first.id, order="asc", limit=1)
    assert [f.id for f in page.data] == [second.id] and page.has_more is False
    page = client.files.list(purpose="batch", order="asc", limit=1)
    assert [f.id for f in page.data] == [first.id] and page.has_more is True
    # The SDK's auto-paging walks the filtered listing page by page.
    assert [f.id for f in client.files.list(purpose="batch", limit=1)] == [second.id, first.id]
    assert client.files.list(purpose="batch_output", after=second.id).data[0].id == output.id
    # A cursor that names no file at all is still a 404.
    missing = "file-" + "0" * 32
    with pytest.raises(openai.NotFoundError, match=missing):
        client.files.list(purpose="batch", after=missing)


def test_expires_after(client: openai.OpenAI) -> None:  # noqa: F811
    """OpenAI's ``expires_after`` on an upload and ``output_expires_after`` on a batch (its output
    and error files): ``expires_at`` is the file's ``created_at`` plus the seconds, within OpenAI's
    bounds (an hour to 30 days)."""
    hour = {"anchor": "created_at", "seconds": 3600}
    upload = client.files.create(
        file=("r.jsonl", _jsonl(_chat("a", "Hi"), _chat("b", "Hi", model="nope"))),
        purpose="batch",
        expires_after=hour,  # type: ignore[arg-type]
    )
    assert upload.expires_at == upload.created_at + 3600
    assert client.files.retrieve(upload.id).expires_at == upload.expires_at
    assert client.files.create(file=("r.jsonl", _jsonl(_chat("a", "Hi"))), purpose="batch").expires_at is None
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    done = _wait(client, batch.id)
    for file_id in (done.output_file_id, done.error_file_id):
        made = client.files.retrieve(file_id)  # type: ignore[arg-type]
        assert made.expires_at == made.created_at + 7200
    with pytest.raises(openai.BadRequestError, match=r"expires_after\.seconds"):
        client.files.create(
            file=("r.jsonl", _jsonl(_chat("a", "Hi"))),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 60},  # type: ignore[arg-type]
        )
    for bad in (
        {"anchor": "created_at", "seconds": 2_592_001},
        {"anchor": "last_active_at", "seconds": 3600},
    ):
        with pytest.raises(openai.BadRequestError, match="output_expires_after"):
            client.batches.create(
                input_file_id=upload.id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
                output_expires_after=bad,  # type: ignore[arg-type]
            )


def test_an_expired_file_is_gone(tmp_path) -> None:
    store = BatchStore(str(tmp_path))
    kept = store.add_file(b"{}\n", "kept.jsonl", "batch", expires_s=3600)
    gone = store.add_file(b"{}\n", "gone.jsonl", "batch", expires_s=0)  # expires as it is made
    assert [f["id"] for f in store.files()] == [kept["id"]]
    assert store.file(gone["id"]) is None and store.open_file_data(gone["id"]) is None
    assert not store.delete_file(store.add_file(b"{}\n", "x.jsonl", "batch", expires_s=0)["id"])
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == sorted(
        f"{kept['id']}{suffix}" for suffix in (".data", ".json")
    )
