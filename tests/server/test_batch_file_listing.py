"""``GET /v1/files`` as OpenAI pages it, through the official SDK: the ``after`` cursor is a file id,
and a listing filtered by ``purpose`` may go on from a file of another purpose (a batch's output
file between two input files)."""

from __future__ import annotations

import openai
import pytest

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
