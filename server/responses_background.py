"""Background responses (``background: true`` on ``POST /v1/responses``): the generation runs on
after the request that started it was answered, and its stored record says how far it got.

One ``BackgroundResponses`` per API server process holds the responses running there:

* ``start``: the record is written with status ``queued`` before anything runs (a store that
  fails is a 503, and nothing runs), then the generation runs in a task of its own as a stream
  (``responses_stream.events``) that writes the record again when the model's first output
  arrives (``in_progress``) and when it ends (``completed`` / ``incomplete`` / ``failed`` /
  ``cancelled``). The request is answered with the queued response, or with ``stream: true``
  with the run's events as they come: a client that goes away closes only its view of them.
* Events of a streamed one: all kept in the run while it runs (streams following it here read
  them there), and appended in batches to the store, which keeps the latest ``EVENT_LOG_LIMIT``:
  ``GET /v1/responses/{id}?stream=true&starting_after=N`` resumes from any API server process or
  replica sharing the store; asking for events older than those held is a 400.
* Cancel (``POST /v1/responses/{id}/cancel``, and ``DELETE`` of a running one): the process running
  it aborts its engine request (its KV blocks are freed at once); the stream ends and the record
  is saved as ``cancelled``. Cancelling a finished one returns it unchanged.
* Shutdown: a drain lets background responses finish like any request, up to ``--drain-timeout``;
  those still running then are stopped and saved as ``failed`` (``server_error``, "shut down").

Cancel across processes: the store is what every API server process (``--api-server-count``, the
engine process's memory) and every replica sharing a Redis store all see, so a cancel that reaches
a process not running the response sets a flag next to its record (``request_cancel``). A process
running background responses reads the flags of its own in one store call every ``CANCEL_POLL_S``
(only while it runs some, and only with a ``shared`` store), and stops those flagged as a local
cancel does; the canceller waits for the record to say so. One mechanism for both stores and any
topology, where routing through the engine process would reach one replica only, and a push
channel (Redis pub/sub) would need a second path for the memory store. If the record still says
it runs after ``CANCEL_WAIT_S`` (a process that holds its lease but does not answer), the canceller
saves it as cancelled.

A process killed mid-run never writes how its responses ended: the same loop renews a lease on each
response running here, and whoever reads a record that says it runs while its lease has lapsed
saves it as ``failed`` (``server/responses_lease.py`` says how, and how soon).
This module must not import ``serving_responses`` (which imports it).

One run's events and state are a ``_Run`` (``server/responses_run.py``); streaming a response
again (``GET ...?stream=true``) is ``ResponseReplay`` (``server/responses_replay.py``), which
``BackgroundResponses`` is built on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from starlette.responses import JSONResponse, Response

from server.errors import APIError, bad_request, unavailable
from server.metrics import ServerMetrics
from server.responses_lease import Leases
from server.responses_replay import ResponseReplay, _not_created_with
from server.responses_run import _Run
from server.responses_store import RUNNING, ResponseStore, StoreUnavailable
from server.streaming import SSEResponse

if TYPE_CHECKING:
    from server.generation import Generation
    from server.responses_object import _Response

logger = logging.getLogger("ferry.server")

# How often a process running background responses reads their cancel flags (shared stores).
CANCEL_POLL_S = 0.1
# How long a cancel waits for the process running the response to save it as cancelled.
CANCEL_WAIT_S = 5.0
# How long new events wait to be appended to the store together.
EVENT_FLUSH_S = 0.05
# At shutdown, how long stopped responses get to save their records before their tasks are cancelled.
CLOSE_TIMEOUT_S = 5.0
# Events 0 to 2 are response.created, response.queued and response.in_progress; event 3 comes with
# the first output.
FIRST_OUTPUT_EVENT = 3
SHUTDOWN_ERROR = {"code": "server_error", "message": "The server shut down before the response completed."}


class Saver(Protocol):
    """``responses_records.Saver``: writes the response's record as it is now."""

    async def put(self) -> bool: ...

    async def __call__(self) -> None: ...


class BackgroundResponses(ResponseReplay):
    def __init__(
        self,
        store: ResponseStore | None,
        generation: Generation,
        metrics: ServerMetrics,
        lease_ttl_s: float,
    ) -> None:
        self.store = store
        self.generation = generation
        self.metrics = metrics
        # Cancel flags and leases: only where another process may run what this one reads.
        self.leases = Leases(store, metrics, lease_ttl_s) if store is not None and store.shared else None
        self._runs: dict[str, _Run] = {}
        self._watcher: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._runs)

    def admit(self, response_id: str, store: bool | None) -> None:
        """Whether a request may run in the background here (``store``: its ``store`` field): it
        is read back by id, so it must be stored (400), under an id not running here (409: a
        client reused its X-Request-Id or request_id)."""
        if store is False:
            raise bad_request("background=true needs store=true (it is read back by id)", param="background")
        if self.store is None:
            raise bad_request(
                "background=true needs stored responses, and this server stores none "
                "(--responses-store none)",
                param="background",
            )
        if response_id in self._runs:
            raise APIError(
                409,
                f"Background response '{response_id}' is still running: send another X-Request-Id (or request_id).",
                code="response_in_progress",
            )

    # -- running -----------------------------------------------------------------------------------

    async def start(
        self,
        built: _Response,
        request_id: str,
        frames: AsyncIterator[bytes],
        save: Saver,
        on_close: Callable[[], None],
    ) -> Response:
        """Store ``built`` as queued and run ``frames`` (its events) on; the answer to its request."""
        queued = built.body()
        try:
            if self.leases is not None:  # before the record, which says it runs
                await self.leases.claim(built.id)
            kept = await save.put()
            why = "it is larger than the whole store"
        except StoreUnavailable as e:
            kept, why = False, str(e)
        if not kept:
            on_close()
            await frames.aclose()  # type: ignore[attr-defined]
            raise unavailable(f"The background response could not be stored: {why}.")
        run = _Run(built, request_id)
        self._runs[run.id] = run
        self.metrics.background_running.inc()
        run.task = asyncio.ensure_future(self._run(run, frames, save, on_close))
        if self.leases is not None and self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch())
        # One pass of the loop: the run submits its engine request before this answer leaves, so
        # a cancel (a later request) always finds it to abort.
        await asyncio.sleep(0)
        if built.keeps_events:
            return SSEResponse(run.follow(-1))
        return JSONResponse(queued)

    async def _run(
        self, run: _Run, frames: AsyncIterator[bytes], save: Saver, on_close: Callable[[], None]
    ) -> None:
        flusher = asyncio.ensure_future(self._flush_events(run)) if run.built.keeps_events else None
        try:
            async for frame in frames:
                run.publish(frame)
                if run.count == FIRST_OUTPUT_EVENT + 1:
                    with contextlib.suppress(StoreUnavailable):
                        await save.put()  # in_progress, for whoever polls it
        except Exception:
            logger.exception("background response %s failed", run.id)
            run.built.status = "failed"
            run.built.error = {"code": "server_error", "message": "Internal server error."}
            await save()
        finally:
            on_close()
            run.end()
            if flusher is not None:
                with contextlib.suppress(Exception):
                    await flusher  # every event in the store before a resume is served from there
            del self._runs[run.id]
            self.metrics.background_running.dec()
            self.metrics.background_finished(run.built.status)

    async def _flush_events(self, run: _Run) -> None:
        """Append the run's events to the store in batches, until the last."""
        assert self.store is not None  # a background response is stored
        sent = 0
        try:
            while sent < len(run.frames) or not run.done:
                if sent == len(run.frames):
                    await run.changed()
                    if not run.done:
                        await asyncio.sleep(EVENT_FLUSH_S)
                    continue
                batch = run.frames[sent:]
                await self.store.append_events(run.id, sent, batch)
                sent += len(batch)
        except StoreUnavailable as e:
            logger.warning("events of background response %s no longer kept: %s", run.id, e)

    # -- stopping ----------------------------------------------------------------------------------

    def _stop(self, run: _Run, status: str, error: dict[str, str] | None) -> None:
        """End ``run`` as ``status``: its engine request is aborted, its stream ends, and the record
        is saved with what it had (unless it finished first)."""
        if run.built.stopped is not None or run.done:
            return
        run.built.stopped = (status, error)
        run.aborting = asyncio.ensure_future(self.generation.abort_request(run.request_id))

    async def _watch(self) -> None:
        """Renew the runs' leases, and stop those whose cancel another process asked for (see the
        module docstring)."""
        assert self.store is not None and self.leases is not None
        try:
            while self._runs:
                await asyncio.sleep(CANCEL_POLL_S)
                await self.leases.renew(list(self._runs))  # when due: every fifth of their TTL
                ids = [rid for rid, run in self._runs.items() if run.built.stopped is None]
                if not ids:
                    continue
                try:
                    flagged = await self.store.cancel_requested(ids)
                except StoreUnavailable:
                    continue
                for rid in flagged:
                    run = self._runs.get(rid)
                    if run is not None:
                        self._stop(run, "cancelled", None)
        finally:
            self._watcher = None

    async def settle(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """A record as read, unless it says it runs while no process does any more: then saved
        and returned as failed (``server/responses_lease.py``); None if deleted meanwhile."""
        body = record["response"]
        if self.leases is None or body.get("status") not in RUNNING or body["id"] in self._runs:
            return record
        return await self.leases.settle(record)

    async def _read(self, rid: str) -> dict[str, Any] | None:
        """The record of a response running elsewhere, as it stands (``settle``)."""
        assert self.store is not None
        record = await self.store.get(rid)
        return None if record is None else await self.settle(record)

    async def cancel(self, record: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/responses/{id}/cancel``: the response as it ended."""
        body = record["response"]
        rid = body["id"]
        if not body.get("background"):
            raise _not_created_with(
                rid, "background=true", "background responses can be cancelled", code="not_background"
            )
        if body.get("status") not in RUNNING:
            return body  # finished: cancelling changes nothing
        run = self._runs.get(rid)
        if run is not None:
            self._stop(run, "cancelled", None)
            if run.task is not None:
                await asyncio.wait({run.task}, timeout=CANCEL_WAIT_S)
            return run.built.body()
        return await self._cancel_elsewhere(record)

    async def _cancel_elsewhere(self, record: dict[str, Any]) -> dict[str, Any]:
        store = self.store
        assert store is not None  # the record came from it
        rid = record["response"]["id"]
        try:
            if store.shared:  # in this process's own memory nothing else can be running it
                await store.request_cancel(rid)
                deadline = time.monotonic() + CANCEL_WAIT_S
                while time.monotonic() < deadline:
                    await asyncio.sleep(CANCEL_POLL_S / 2)
                    current = await self._read(rid)
                    if current is None:
                        raise APIError(404, f"Response with id '{rid}' not found.", code="response_not_found")
                    if current["response"].get("status") not in RUNNING:
                        return current["response"]
                    record = current
                logger.warning("no process answered the cancel of %s: saved as cancelled here", rid)
            record["response"]["status"] = "cancelled"
            await store.put(rid, record)
        except StoreUnavailable as e:
            raise unavailable(str(e)) from e
        return record["response"]

    def stop_all(self) -> None:
        """At shutdown: every running background response ends as failed."""
        for run in list(self._runs.values()):
            self._stop(run, "failed", SHUTDOWN_ERROR)

    async def close(self) -> None:
        """Stop what still runs, let it save its record (bounded), then cancel what did not."""
        self.stop_all()
        tasks = [run.task for run in self._runs.values() if run.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
