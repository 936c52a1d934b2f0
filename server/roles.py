"""What a replica's role (``--role mixed|prefill|decode``) changes about a request's KV hand-off.

* ``prefill``: every request is a producer. A request without ``kv_transfer`` is treated as
  ``{"role": "producer"}`` and every producer computes its prompt and one token only
  (``max_tokens`` = 1), so its blocks are written to the tier and released at once; a prefill
  worker never holds KV waiting for a decode worker. Consumer requests are refused (400).
* ``decode``: consumer requests load the listed blocks from the tier; plain requests (the
  router's local-prefill path) are served whole.
* ``mixed``: both kinds of request are honoured as they come.

A consumer's ``block_hashes`` must be the leading full-block hashes of the prompt it is sent
with: the engine looks blocks up by the hashes of the tokens it was given, so a list computed
for another prompt (or another block size) would silently load nothing; it is a 400 instead.
"""

from __future__ import annotations

from typing import Any

from kvcache.keys import block_hashes, to_hex
from server.errors import bad_request

ROLES = ("mixed", "prefill", "decode")
KV_TIER_ROLES = ("prefill", "decode")  # roles that cannot work without a shared --kv-tier


def check_role_config(role: str, kv_tier: str | None) -> str | None:
    """A startup error message for a role that cannot work with this configuration, else None."""
    if role not in ROLES:
        return f"--role must be one of {', '.join(ROLES)}, got {role!r}"
    if role in KV_TIER_ROLES and not kv_tier:
        return (
            f"--role {role} needs a KV tier shared with the {'decode' if role == 'prefill' else 'prefill'} "
            "workers: pass --kv-tier redis://host:port/db"
        )
    return None


def transfer_for_role(
    role: str,
    spec: dict[str, Any] | None,
    prompt_ids: list[int],
    block_size: int,
    resumed: list[int] | None,
    extra: bytes = b"",
    *,
    check_hashes: bool = True,
) -> dict[str, Any] | None:
    """The ``kv_transfer`` spec the engine gets, after the role's rules (see the module docstring);
    ``extra``: the request's block-hash salt (its LoRA adapter's). ``check_hashes=False``: a
    consumer's listed block hashes are left for the engine to check (a prompt with images)."""
    if role == "prefill":
        if spec is not None and spec["role"] == "consumer":
            raise bad_request(
                "this replica is a prefill worker: it does not take kv_transfer consumer requests",
                param="kv_transfer.role",
            )
        spec = spec or {"role": "producer"}
    if spec is None:
        return None
    if spec["role"] == "producer" and resumed:
        raise bad_request("a kv_transfer producer request cannot carry resume", param="resume")
    if spec["role"] == "consumer" and spec.get("block_hashes") and check_hashes:
        listed = spec["block_hashes"]
        own = to_hex(block_hashes(prompt_ids, block_size, extra))
        if len(listed) > len(own) or own[: len(listed)] != listed:
            raise bad_request(
                f"kv_transfer.block_hashes ({len(listed)} hashes) are not the leading block hashes of "
                f"this prompt ({len(own)} full blocks of {block_size} tokens)",
                param="kv_transfer.block_hashes",
                code="kv_transfer_mismatch",
            )
    return spec


def producer_budget(spec: dict[str, Any] | None, max_tokens: int) -> int:
    """A producer computes its prompt and exactly one token (the first token of the answer)."""
    return 1 if spec is not None and spec["role"] == "producer" else max_tokens
