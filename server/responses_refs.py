"""Input items that name a stored item instead of repeating it: OpenAI's item reference,
``{"type": "item_reference", "id": …}`` (``type`` may be left out or null: an item with an ``id``
and no ``role`` is then a reference).

Each reference is replaced by the item it names as the response store holds it (an item of an
earlier request's input or of a response's output, ``ResponseStore.find_item``) before the request
is translated or stored, so the prompt, the stored conversation and ``input_items`` hold the item
itself. An id no stored record holds is OpenAI's 404 (``Item with id '…' not found.``, ``param``
``input``); so is one whose record expired or was deleted. A router cannot read the store, so it
keys such a request's prompt by nothing (``router/prompt_keys.py``): a routing hint only.
"""

from __future__ import annotations

from typing import Any

from server.errors import APIError, bad_request, unavailable
from server.responses_store import ResponseStore, StoreUnavailable


def is_reference(item: Any) -> bool:
    if not isinstance(item, dict):
        return False
    kind = item.get("type")
    return kind == "item_reference" or (kind is None and "id" in item and "role" not in item)


def _stored(record: dict[str, Any], item_id: str) -> dict[str, Any] | None:
    """The record's item ``item_id`` (the last one of that id: a client may send an item again)."""
    items = [*record.get("input", ()), *record["response"].get("output", ())]
    return next((item for item in reversed(items) if item.get("id") == item_id), None)


async def resolve_references(store: ResponseStore | None, input_: Any) -> Any:
    """``input_`` with each item reference replaced by the stored item it names (``input_`` itself
    when it has none)."""
    if not isinstance(input_, list) or not any(is_reference(item) for item in input_):
        return input_
    if store is None:
        raise bad_request(
            "item_reference needs stored responses, and this server stores none "
            "(--responses-store none): send the item itself",
            param="input",
        )
    resolved = []
    for i, item in enumerate(input_):
        if not is_reference(item):
            resolved.append(item)
            continue
        item_id = item.get("id")
        if not isinstance(item_id, str) or not item_id:
            raise bad_request(f"input[{i}]: an item_reference needs the id of a stored item", param="input")
        try:
            record = await store.find_item(item_id)
        except StoreUnavailable as e:
            raise unavailable(str(e)) from e
        found = None if record is None else _stored(record, item_id)
        if found is None:
            raise APIError(404, f"Item with id '{item_id}' not found.", param="input")
        if found.get("status") == "in_progress":  # a background response's item, still being written
            raise bad_request(
                f"input[{i}]: item '{item_id}' is still in progress: wait until its response completes",
                param="input",
            )
        resolved.append(found)
    return resolved
