"""The internal router -> replica fields of a sampling request: ``kv_transfer`` and ``resume``.

``kv_transfer`` is the prefill/decode hand-off (DESIGN's): a producer's request carries the
client's budget (``client_budget`` checks it as the client's own request would be checked) and a
consumer's the block hashes to load. ``resume`` continues choices whose first tokens were produced
elsewhere (the router's failover). Each failure is an ``APIError`` 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kvcache.keys import from_hex
from server.chat_protocol import ChatCompletionRequest
from server.errors import bad_request, validation_error
from server.params import ModelLimits, check_token_ids
from server.protocol import SamplingFields

BUDGET_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens")


def client_budget(req: SamplingFields) -> SamplingFields:
    """The request with the budget its client sent, for a producer (a prefill worker's request
    carries ``max_tokens`` 1, as DESIGN's hand-off says, and the client's fields in
    ``kv_transfer.budget``); ``req`` itself otherwise. The fields are checked by the request
    model's own rules, so a bad budget is the 400 a replica gives the client, before the prefill."""
    budget = req.kv_transfer.budget if req.kv_transfer is not None else None
    if budget is None:
        return req
    chat = isinstance(req, ChatCompletionRequest)
    stub: dict[str, Any] = {"messages": [{"role": "user", "content": "."}]} if chat else {"prompt": "."}
    try:
        sent = type(req).model_validate({**stub, **{k: budget[k] for k in BUDGET_FIELDS if k in budget}})
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None
    return req.model_copy(update={k: getattr(sent, k) for k in BUDGET_FIELDS})


def kv_transfer_spec(req: SamplingFields, num_prompts: int) -> dict[str, Any] | None:
    """The ``kv_transfer`` field as the engine's KV connector takes it (a dict, hashes as hex)."""
    if req.kv_transfer is None:
        return None
    if num_prompts != 1 or req.n != 1:
        raise bad_request("kv_transfer needs exactly one prompt and n = 1", param="kv_transfer")
    spec: dict[str, Any] = {"role": req.kv_transfer.role}
    if req.kv_transfer.block_hashes is not None:
        try:
            from_hex(req.kv_transfer.block_hashes)
        except ValueError as e:
            raise bad_request(f"kv_transfer.block_hashes: {e}", param="kv_transfer.block_hashes") from e
        spec["block_hashes"] = [h.lower() for h in req.kv_transfer.block_hashes]
    return spec


def resumed_choices(
    req: SamplingFields, num_prompts: int, limits: ModelLimits
) -> dict[int, list[int]] | None:
    """The choices a ``resume`` runs, each with the tokens it already produced elsewhere (in index
    order), or None without ``resume`` (every choice runs from its start). ``resume.token_ids`` is
    choice 0 of an ``n`` = 1 request; ``resume.choices`` (a stream's unfinished choices, for ``n``
    > 1) names its choices: those left out finished before and do not run again."""
    if req.resume is None:
        return None
    if req.resume.token_ids is not None:
        if num_prompts != 1 or req.n != 1:
            raise bad_request("resume needs exactly one prompt and n = 1", param="resume")
        ids = list(req.resume.token_ids)
        check_token_ids(ids, limits, "resume.token_ids")
        return {0: ids}
    if num_prompts != 1:
        raise bad_request("resume.choices needs exactly one prompt", param="resume.choices")
    if not getattr(req, "stream", False):
        # A whole answer would hold only the resumed choices, not the request's n.
        raise bad_request("resume.choices needs stream", param="resume.choices")
    out: dict[int, list[int]] = {}
    for c in sorted(req.resume.choices or (), key=lambda c: c.index):
        if c.index >= req.n:
            raise bad_request(
                f"resume.choices: index {c.index} is not below n = {req.n}", param="resume.choices"
            )
        check_token_ids(c.token_ids, limits, "resume.choices.token_ids")
        out[c.index] = list(c.token_ids)
    return out


def longest_resumed(resumed: dict[int, list[int]] | None) -> list[int] | None:
    """The resumed tokens of the choice furthest along (what a budget must leave room after)."""
    if not resumed:
        return None
    return max(resumed.values(), key=len) or None
