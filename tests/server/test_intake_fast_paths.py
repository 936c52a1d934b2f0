"""The per-request shortcuts the generation routes take for intake CPU give what the general code
gives: an SSE response's headers and attributes as Starlette builds them, a token-id check that
names the same first bad id."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from starlette.responses import StreamingResponse

from server.errors import APIError
from server.params import check_token_ids
from server.streaming import SSEResponse


async def _frames() -> AsyncIterator[bytes]:
    yield b"data: {}\n\n"


def test_sse_response_without_headers_is_what_starlette_builds() -> None:
    frames = _frames()
    ours = SSEResponse(frames)
    theirs = StreamingResponse(
        frames,
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )
    assert ours.raw_headers == [
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
        (b"content-type", b"text/event-stream; charset=utf-8"),
    ]
    assert {k: v for k, v in vars(ours).items() if k in vars(theirs)} == vars(theirs)
    assert vars(theirs).keys() <= vars(ours).keys()
    # each response has its own header list: one response's edits cannot reach the next
    ours.raw_headers.append((b"vary", b"Origin"))
    assert SSEResponse(_frames()).raw_headers == theirs.raw_headers


def test_sse_response_extra_headers_keep_starlette_order() -> None:
    ours = SSEResponse(_frames(), headers={"X-Extra": "1"})
    assert ours.raw_headers == [
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
        (b"x-extra", b"1"),
        (b"content-type", b"text/event-stream; charset=utf-8"),
    ]


class _Limits:
    vocab_size = 100


@pytest.mark.parametrize(
    ("ids", "bad"),
    [([5, 100, -1], 100), ([-3, 5, 200], -3), ([0, 99, 99, 150], 150), ([True, 101], 101)],
)
def test_check_token_ids_names_the_first_bad_id(ids: list[int], bad: int) -> None:
    with pytest.raises(APIError) as err:
        check_token_ids(ids, _Limits(), "prompt")  # type: ignore[arg-type]
    assert err.value.status == 400
    assert err.value.param == "prompt"
    assert err.value.message == f"token id {bad} is out of range [0, 100)"


@pytest.mark.parametrize("ids", [[], [0], [0, 99, 42], [False, True]])
def test_check_token_ids_passes_ids_in_range(ids: list[int]) -> None:
    check_token_ids(ids, _Limits(), "prompt")  # type: ignore[arg-type]
