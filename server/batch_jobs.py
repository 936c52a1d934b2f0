"""The batches running in this API server process (OpenAI's Batch API, ``server/batch_api.py``).

Lifecycle of a batch: ``validating`` (its input file was checked when it was created: every line
parses and names the batch's endpoint) → ``in_progress`` (its lines run through the replica's own
app, ``server/batch_lines.py``) → ``finalizing`` (the output file gets the 2xx answers, the error
file every other, each in input order) → ``completed``. A cancel turns ``validating`` /
``in_progress`` into ``cancelling``: no more lines start, the running ones are aborted, and the
batch ends ``cancelled`` with files of what had finished. A batch still running when the server
stops ends ``failed``.

Every batch of this process shares one gate of ``--max-batch-concurrency`` requests, so batches
never hold more of the engine than that, however many run. The process that created a batch runs
it and is the only writer of its record; it polls the store for cancel requests (which another API
server process may have written) every ``POLL_S``.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import uuid
from collections.abc import Collection
from typing import Any

from server.batch_lines import (
    AppCaller,
    Progress,
    line_error,
    output_line,
    parse_line,
    read_ahead,
    stream_lines,
)
from server.batch_results import ResultSpool
from server.batch_store import ALIVE_EVERY_S, BatchStore, batch_errors

logger = logging.getLogger("ferry.batch")

POLL_S = 0.2  # how often a running batch saves its counts and looks for a cancel request
WINDOW_S = 24 * 3600  # the one completion window ("24h")


def zero_usage() -> dict[str, Any]:
    """OpenAI's batch ``usage`` before any answer."""
    return {
        "input_tokens": 0,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 0,
    }


class _Counts(Progress):
    """The counts, and OpenAI's batch ``usage`` and ``model``, summed from the answers as they come:
    a line's ``usage`` in any endpoint's names (chat and completions' ``prompt_tokens`` /
    ``completion_tokens``, the Responses API's ``input_tokens`` / ``output_tokens``, an embedding's
    ``prompt_tokens`` alone)."""

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record["id"], record["request_counts"]["total"], every_s=30.0)
        self.usage = zero_usage()
        self.model: str | None = None

    def done(self, line: dict[str, Any]) -> None:
        super().done(line)
        body = line["response"]["body"]
        if line["error"] is not None or not isinstance(body, dict):
            return
        if self.model is None and isinstance(body.get("model"), str):
            self.model = body["model"]
        usage = body.get("usage")
        if not isinstance(usage, dict):
            return
        inputs = usage.get("input_tokens", usage.get("prompt_tokens")) or 0
        outputs = usage.get("output_tokens", usage.get("completion_tokens")) or 0
        details = usage.get("input_tokens_details") or usage.get("prompt_tokens_details") or {}
        out_details = usage.get("output_tokens_details") or usage.get("completion_tokens_details") or {}
        total = self.usage
        total["input_tokens"] += inputs
        total["output_tokens"] += outputs
        total["total_tokens"] += inputs + outputs
        total["input_tokens_details"]["cached_tokens"] += details.get("cached_tokens") or 0
        total["output_tokens_details"]["reasoning_tokens"] += out_details.get("reasoning_tokens") or 0


class BatchJobs:
    def __init__(self, store: BatchStore, max_concurrency: int, window_s: float = WINDOW_S) -> None:
        self.store = store
        self.max_concurrency = max_concurrency
        self.window_s = window_s  # the completion window ("24h"): a batch still running then expires
        self.gate = asyncio.Semaphore(max_concurrency)
        self.caller: AppCaller | None = None  # set once the app exists (build_app)
        self._runs: dict[str, tuple[asyncio.Task, asyncio.Event]] = {}

    def start(
        self,
        input_file_id: str,
        endpoint: str,
        lines: Collection[str],
        metadata: dict[str, str] | None,
        output_expires_s: int | None = None,
    ) -> dict[str, Any]:
        """Record a new batch of ``lines`` (already checked; a ``FileLines`` reads them from the
        input file each time they are iterated, and is closed when the run ends) and start
        running it; its output and error files expire ``output_expires_s`` after they are made
        (OpenAI's ``output_expires_after``), or never."""
        now = int(time.time())
        record: dict[str, Any] = {
            "id": self.store.new_batch_id(),
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": "24h",
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + int(self.window_s),
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": len(lines), "completed": 0, "failed": 0},
            "metadata": metadata,
            "model": None,  # the model that answered, once one has
            "usage": zero_usage(),
            "_output_expires_s": output_expires_s,
        }
        self.store.touch_alive(record["id"])
        self.store.save_batch(record)
        gone = asyncio.Event()
        task = asyncio.ensure_future(self._run(dict(record), lines, gone))
        self._runs[record["id"]] = (task, gone)
        task.add_done_callback(lambda _: self._runs.pop(record["id"], None))
        return {k: v for k, v in record.items() if not k.startswith("_")}

    def cancel(self, batch_id: str) -> None:
        """Ask for the batch to stop (it may run in another API server process, which polls)."""
        self.store.request_cancel(batch_id)
        run = self._runs.get(batch_id)
        if run is not None:
            run[1].set()

    async def stop_all(self) -> None:
        """Stop every batch running here (each ends ``failed``, its running requests aborted)."""
        for task, gone in list(self._runs.values()):
            gone.set()
            task.cancel()
        for task, _ in list(self._runs.values()):
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass

    async def close(self) -> None:
        """``stop_all``, then drop a temporary directory."""
        await self.stop_all()
        self.store.close()

    async def _run(self, record: dict[str, Any], lines: Collection[str], gone: asyncio.Event) -> None:
        results: ResultSpool | None = None
        record.update(status="in_progress", in_progress_at=int(time.time()))
        self.store.save_batch(record)
        counts = _Counts(record)
        logger.info("batch %s: %d requests (%s)", record["id"], len(lines), record["endpoint"])
        watch = asyncio.ensure_future(self._watch(record, counts, gone))
        expired = asyncio.Event()  # the completion window ended first (OpenAI's "expired")
        expiry = asyncio.get_running_loop().call_later(
            max(0.0, record["expires_at"] - time.time()), lambda: (expired.set(), gone.set())
        )
        try:
            assert self.caller is not None
            results = ResultSpool(len(lines), self.store.root / "batches")
            await stream_lines(
                self.caller,
                read_ahead(lines),
                self.max_concurrency,
                results.add,
                urls=(record["endpoint"],),
                progress=counts,
                gate=self.gate,
                gone=gone,
            )
            # A cancel asked for before the run ended ends it cancelled, even when the last requests
            # finished before this process polled the request (the client was told "cancelling").
            cancelled = not expired.is_set() and (
                gone.is_set() or self.store.cancel_requested(record["id"]) is not None
            )
            unanswered = len(lines) - len(results)
            if expired.is_set():  # requests it never answered: batch_expired lines in the error file
                await asyncio.to_thread(_add_expired, results, lines)
            if not cancelled:
                record.update(status="finalizing", finalizing_at=int(time.time()))
            if expired.is_set():
                # Counted in ``counts``, not only in the record: the watch, still saving counts
                # while the results are written, would put back the failed count without them.
                counts.failed += unanswered
            self._count(record, counts)
            self.store.save_batch(record)
            await asyncio.to_thread(self._write_results, record, results)
            now = int(time.time())
            if expired.is_set():
                record.update(status="expired", expired_at=now)
            elif cancelled:
                cancelling_at = self.store.cancel_requested(record["id"]) or now
                record.update(status="cancelled", cancelling_at=cancelling_at, cancelled_at=now)
            else:
                record.update(status="completed", completed_at=now)
            counts.log()
        except asyncio.CancelledError:  # the server is stopping
            record.update(
                status="failed",
                failed_at=int(time.time()),
                errors=batch_errors("server_shutdown", "The server stopped before the batch finished."),
            )
            self._count(record, counts)
            raise
        except Exception as e:  # a bug: the batch fails, the server goes on
            logger.exception("batch %s failed", record["id"])
            record.update(
                status="failed", failed_at=int(time.time()), errors=batch_errors("internal_error", str(e))
            )
        finally:
            watch.cancel()
            expiry.cancel()
            if results is not None:
                results.close()
            getattr(lines, "close", lambda: None)()  # a FileLines' handle on the input file
            self.store.save_batch(record)
            logger.info("batch %s: %s", record["id"], record["status"])

    async def _watch(self, record: dict[str, Any], counts: _Counts, gone: asyncio.Event) -> None:
        """Save the counts as they change; pass on a cancel request written by any process; say
        that this process still runs the batch (``BatchStore.touch_alive``)."""
        touched = time.monotonic()
        while True:
            await asyncio.sleep(POLL_S)
            if time.monotonic() - touched >= ALIVE_EVERY_S:
                self.store.touch_alive(record["id"])
                touched = time.monotonic()
            if not gone.is_set() and self.store.cancel_requested(record["id"]) is not None:
                gone.set()
            if self._count(record, counts):
                self.store.save_batch(record)

    @staticmethod
    def _count(record: dict[str, Any], counts: _Counts) -> bool:
        new = {"total": counts.total, "completed": counts.completed, "failed": counts.failed}
        changed = new != record["request_counts"] or counts.usage != record["usage"]
        changed = changed or counts.model != record["model"]
        record.update(request_counts=new, usage=copy.deepcopy(counts.usage), model=counts.model)
        return changed

    def _write_results(self, record: dict[str, Any], results: ResultSpool) -> None:
        """The output file (2xx answers) and the error file (every other), each in input order and
        only when it has a line, copied from the spool a line at a time."""
        for key, failed, suffix in (("output_file_id", False, "output"), ("error_file_id", True, "errors")):
            if results.failed if failed else results.completed:
                name = f"{record['id']}_{suffix}.jsonl"
                expires_s = record.get("_output_expires_s")
                added = self.store.add_file(results.lines(failed), name, "batch_output", expires_s)
                record[key] = added["id"]


def _add_expired(results: ResultSpool, lines: Collection[str]) -> None:
    """A batch_expired line for every input line that has no output line (blocking: the input file
    is read again, a line at a time)."""
    for index, raw in enumerate(lines):
        if index not in results:
            results.add(index, _expired_line(raw))


def _expired_line(raw: str) -> dict[str, Any]:
    """The error-file line of a request the completion window ended before it was answered."""
    parsed = parse_line(raw)
    custom_id = parsed[0] if isinstance(parsed, tuple) else parsed.custom_id
    message = "This request could not be executed before the completion window expired."
    return output_line(custom_id, 408, uuid.uuid4().hex, line_error("batch_expired", message, 408))
