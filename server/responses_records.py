"""The stored record of a response as ``POST``, ``GET`` and ``DELETE /v1/responses`` use it: written
with the conversation that led to it once the answer is finished (a background one also as it starts
and runs: ``Saver``), read back (``load_record``: 404 / 503 as OpenAI answers them, a record of a run
no process holds any more settled as failed), its input items paged (``item_page``), and an id a
client reuses for another conversation refused (``refuse_a_taken_id``). Where records live:
``server/responses_store.py``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from server.errors import APIError, unavailable
from server.responses_store import StoreUnavailable
from server.state import ServerState

if TYPE_CHECKING:
    from server.responses_object import _Response

logger = logging.getLogger("ferry.server")


async def load_record(state: ServerState, response_id: str, param: str | None = None) -> dict[str, Any]:
    """The stored record of ``response_id`` (404 if there is none, 503 if the store failed); one
    that says it runs while no process does any more is saved and read as failed."""
    store = state.responses
    try:
        record = None if store is None else await store.get(response_id)
        if record is not None:
            record = await state.background.settle(record)
    except StoreUnavailable as e:
        raise unavailable(str(e)) from e
    if record is None:
        if param == "previous_response_id":
            raise APIError(
                404,
                f"Previous response with id '{response_id}' not found.",
                code="previous_response_not_found",
                param=param,
            )
        raise APIError(
            404, f"Response with id '{response_id}' not found.", code="response_not_found", param=param
        )
    return record


def item_page(
    items: list[dict[str, Any]], limit: int, order: str, after: str | None, before: str | None
) -> dict[str, Any]:
    """One page of a stored response's input items, as OpenAI's list endpoints page (``order``
    desc: newest first; ``after`` / ``before``: an item id the page starts after / ends before)."""
    ordered = items if order == "asc" else items[::-1]
    ids = [item.get("id") for item in ordered]
    start = ids.index(after) + 1 if after in ids else 0
    end = ids.index(before) if before in ids else len(ordered)
    page = ordered[start:end][:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": start + len(page) < end,
    }


class Saver:
    """Stores a response with the conversation that led to it (``server/responses_store``): once
    finished, and a background one also as it starts and runs (``put``)."""

    def __init__(self, state: ServerState, built: _Response, conversation: list[dict[str, Any]]) -> None:
        self.state = state
        self.built = built
        self.conversation = conversation

    async def put(self) -> bool:
        """Write the record as the response is now; False if the store did not keep it (raises
        StoreUnavailable)."""
        built, store = self.built, self.state.responses
        if not built.store or store is None:
            return False
        record: dict[str, Any] = {"response": built.body(), "input": self.conversation}
        if built.keeps_events:
            record["stream"] = True
        return await store.put(built.id, record)

    async def __call__(self) -> None:
        """The final save (a failed foreground stream is not stored: nothing would read it)."""
        built, store = self.built, self.state.responses
        if not built.store or store is None or (built.status == "failed" and not built.background):
            return
        try:
            kept = await self.put()
        except StoreUnavailable as e:
            logger.warning("response %s not stored: %s", built.id, e)
            kept = False
        if not kept:
            built.store = False  # the answer says so: a later previous_response_id would 404
            self.state.metrics.responses_not_stored.inc()
            if built.background:  # not its queued record either, which would say it still runs
                with contextlib.suppress(StoreUnavailable):
                    await store.delete(built.id)


def _without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


async def refuse_a_taken_id(state: ServerState, response_id: str, conversation: list[dict[str, Any]]) -> None:
    """409 when a stored response already has this id (it follows the X-Request-Id, or the body's
    ``request_id``) with another conversation: a client reusing one would otherwise replace it. The same input
    again is a retry (a client's, or the router's after a lost answer) and is answered anew."""
    try:
        record = await state.responses.get(response_id)  # type: ignore[union-attr]
    except StoreUnavailable:
        return  # saving it will say so
    if record is not None and _without_ids(record.get("input") or []) != _without_ids(conversation):
        raise APIError(
            409,
            f"A stored response already has id '{response_id}', for another input: "
            "send a new X-Request-Id (or request_id) for each request.",
            code="response_id_in_use",
        )
