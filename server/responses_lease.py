"""Ownership leases of background responses: a response whose process died is reported failed.

A background response runs in one process (``server/responses_background.py``), and its record
says ``queued`` / ``in_progress`` until that process writes how it ended. A process killed mid-run
(kill -9, OOM, a crashed API server under ``--api-server-count``, a replica gone from a shared
Redis) never writes it, so a running process keeps proving it is alive instead: it holds a lease
on each response it runs, a store entry that lapses ``--responses-lease-ttl`` seconds (5 by
default) after its last renewal (Redis: ``ferry:response-lease:{id}``, ``PX``; the engine
process's memory store: that process's clock). The lease is taken before the queued record is
written (``ResponseStore.claim``) and all of a process's leases are renewed in one store call every
fifth of the TTL, from the loop that polls their cancel flags. A lease is not given back by a
call of its own: the final record ends the response; in Redis the lease then lapses by itself, and
the engine process's memory store drops it with that record (``MemoryRecords.put``, ``ended``),
since its lapsed leases are only swept by a renewal, which needs another response running.

One lease per response rather than one per process that its records name: records stay as they
are (no owner field for every writer to carry), a response whose run ended without its final
record (the store failed just then) is found out as a dead process's is, and a renewal is still one
round trip (pipelined ``SET``s, one engine call), N small writes a second for N running responses.

Whoever reads a record that says it runs while no lease is held (``settle``: every read through
``load_record`` — GET, GET with ``stream``, ``input_items``, cancel, DELETE,
``previous_response_id`` — and a stream following the store's log, at each of its record checks)
saves it ``failed`` with ``ORPHANED_ERROR`` through ``ResponseStore.replace_orphan``, a write that
only happens while the stored record still runs and still has no lease. Of several readers at once
one writes it (and counts it in ``ferry:responses_background_orphaned_total``), the others read
what it wrote; an owner that renewed or wrote in between is never overwritten. A streamed one's
log gets ``response.failed`` after its last held event, so every stream following it ends.

Timing: renewals every TTL / 5, so a live process loses a lease only when four in a row are missed
(its event loop stalled, or the store failed, for 4/5 of the TTL). A dead process's leases lapse
between 4/5 of the TTL and the TTL after it died; a read after that reports the response failed, a
stream following it within one more record check (``RECORD_CHECK_S``, 1 s): 6 s at worst with the
default. A process frozen past its TTL (SIGSTOP) that wakes up still writes the end it reaches,
over the failure (the later record says what happened).

Only stores that other processes share need leases: in this process's own memory a response that
says it runs runs here. This module must not import ``responses_background`` (which imports it).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from server.metrics import ServerMetrics
from server.responses_store import ResponseStore, StoreUnavailable, event_frame

logger = logging.getLogger("ferry.server")

RENEWALS_PER_TTL = 5
ORPHANED_ERROR = {
    "code": "server_error",
    "message": "The response failed: the process running it stopped before it completed.",
}


class Leases:
    """The leases of the background responses running in this process, and the check of the
    records that say a response runs elsewhere."""

    def __init__(self, store: ResponseStore, metrics: ServerMetrics, ttl_s: float) -> None:
        self.store = store
        self.metrics = metrics
        self.ttl_s = ttl_s
        self.renew_s = ttl_s / RENEWALS_PER_TTL
        self._renewed = float("-inf")  # time.monotonic() of the last renewal that went through
        self._failing = False

    async def claim(self, response_id: str) -> None:
        """Before the response's first record: it runs here (raises StoreUnavailable)."""
        await self.store.claim(response_id, self.ttl_s)

    async def renew(self, response_ids: list[str]) -> None:
        """Renew the leases of ``response_ids`` (every response running here) if it is time."""
        now = time.monotonic()
        if not response_ids or now - self._renewed < self.renew_s:
            return
        try:
            await self.store.renew_leases(response_ids, self.ttl_s)
        except StoreUnavailable as e:
            if not self._failing:
                logger.warning("leases of background responses not renewed (retried): %s", e)
            self._failing = True
            return
        self._renewed, self._failing = now, False

    async def settle(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """``record``, one that says its response runs in another process, as it stands: saved
        as failed first if no process holds its lease; None if it was deleted meanwhile (raises
        StoreUnavailable)."""
        body = record["response"]
        rid = body["id"]
        if await self.store.lease_held(rid):
            return record
        failed = {**record, "response": {**body, "status": "failed", "error": dict(ORPHANED_ERROR)}}
        if not await self.store.replace_orphan(rid, failed):
            return await self.store.get(rid)  # another reader failed it, or its process wrote
        self.metrics.background_orphaned.inc()
        logger.warning("background response %s lost the process running it: saved as failed", rid)
        if record.get("stream"):
            try:
                seq = await self.store.events_end(rid)
                frame = event_frame("response.failed", seq, response=failed["response"])
                await self.store.append_events(rid, seq, [frame])
            except StoreUnavailable as e:  # the record says it; followers end with an error event
                logger.warning("response.failed of %s not kept: %s", rid, e)
        return failed
