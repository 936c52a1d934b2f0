"""The Files and Batches API's storage: one directory of files and JSON records (``--batch-dir``).

```
files/{file_id}.json     the file object (OpenAI's shape)      files/{file_id}.data   its bytes
batches/{batch_id}.json  the batch object                     batches/{batch_id}.cancel  a cancel request
                                                               batches/{batch_id}.alive   touched while it runs
batches/order/{created ns, 20 digits}-{batch_id}               an empty marker: listing order by name
```

Listing batches reads the order markers' names and then only the page's records, so a page of 20
costs the same with ten thousand batches on disk as with ten.

The disk is the only truth (nothing is cached in memory), so every API server process of a replica
(``--api-server-count``) that shares the directory sees the same files and batches. Each record
has one writer: a file's is written once at upload; a batch's only by the process running it; a
cancel request is a marker file of its own, which that process polls. Every write goes to a
temporary name and is renamed over the record, so a reader never sees half a record.

Ids are checked against their pattern before they become a path, so no id can name a file
outside the directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

_FILE_ID = re.compile(r"^file-[0-9a-f]{32}$")
_BATCH_ID = re.compile(r"^batch_[0-9a-f]{32}$")
# Batch states a cancel request turns into "cancelling" (later ones are past cancelling).
CANCELLABLE = ("validating", "in_progress")
RUNNING = (*CANCELLABLE, "finalizing")
# A running batch's process touches its ``.alive`` file every ``ALIVE_EVERY_S``; a record that says
# it runs while that file is older than ``ALIVE_STALE_S`` belongs to a process that died (kill -9,
# OOM, a host gone): it reads as failed (``owner_lost``).
ALIVE_EVERY_S = 1.0
ALIVE_STALE_S = 15.0
TERMINAL = ("completed", "failed", "cancelled", "expired")
# An uploaded file is copied into the store this many bytes at a time (never held whole).
COPY_CHUNK = 1 << 20


def _write_atomic(path: Path, data: bytes | IO[bytes] | Iterable[bytes]) -> int:
    """Write ``data`` (bytes; a binary file from where it stands to its end, copied in chunks; or
    pieces of bytes, written as they are made) to a temporary name beside ``path``, renamed over
    it when complete; the temporary file is removed if that fails. The bytes written."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with tmp.open("wb") as out:
            if isinstance(data, bytes):
                out.write(data)
            elif hasattr(data, "read"):
                shutil.copyfileobj(data, out, COPY_CHUNK)  # type: ignore[arg-type]
            else:
                out.writelines(data)
            size = out.tell()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def _public(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if not k.startswith("_")}


def cursor(ids: list[str], limit: int, after: str | None) -> tuple[list[str], bool] | None:
    """OpenAI's cursor over ``ids`` (in listing order): the ``limit`` ids after ``after`` and whether
    more follow; None when ``after`` names none of them."""
    start = 0
    if after is not None:
        if after not in ids:
            return None
        start = ids.index(after) + 1
    return ids[start : start + limit], start + limit < len(ids)


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    data = [_public(item) for item in data]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def page(
    items: list[dict[str, Any]],
    limit: int,
    after: str | None,
    order: str = "desc",
    keep: Callable[[dict[str, Any]], bool] | None = None,
) -> dict[str, Any] | None:
    """OpenAI's cursor page of ``items`` (oldest first): the ``limit`` after the id ``after`` in
    ``order`` that ``keep`` keeps; None when ``after`` names no item. The cursor is any item's id,
    kept or not (OpenAI's: a listing filtered by purpose may go on from a file of another)."""
    ordered = items if order == "asc" else items[::-1]
    by_id = {item["id"]: item for item in ordered}
    ids = list(by_id)
    start = 0
    if after is not None:
        if after not in by_id:
            return None
        start = ids.index(after) + 1
    rest = [by_id[i] for i in ids[start:] if keep is None or keep(by_id[i])]
    return list_page(rest[:limit], len(rest) > limit)


class BatchStore:
    def __init__(self, root: str | None = None) -> None:
        self._root = Path(root) if root else None
        self._temporary = root is None  # made on first use, removed by close()

    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="ferry-batches-"))
        for sub in ("files", "batches", "batches/order"):
            (self._root / sub).mkdir(parents=True, exist_ok=True)
        return self._root

    def close(self) -> None:
        if self._temporary and self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    # ---- files --------------------------------------------------------------------------------
    def _file_paths(self, file_id: str) -> tuple[Path, Path] | None:
        if not _FILE_ID.match(file_id):
            return None
        base = self.root / "files"
        return base / f"{file_id}.json", base / f"{file_id}.data"

    def add_file(
        self,
        data: bytes | IO[bytes] | Iterable[bytes],
        filename: str,
        purpose: str,
        expires_s: int | None = None,
    ) -> dict[str, Any]:
        """Store a file: ``data`` as ``_write_atomic`` takes it (an upload streams from its spool, a
        batch's output from its results spool); it expires ``expires_s`` after it is made (OpenAI's
        ``expires_after``: from then it reads as gone, and is removed when next looked at), or
        never."""
        file_id = f"file-{uuid.uuid4().hex}"
        meta_path, data_path = self._file_paths(file_id)  # type: ignore[misc]
        now = int(time.time())
        record = {
            "id": file_id,
            "object": "file",
            "bytes": 0,  # known once written
            "created_at": now,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None if expires_s is None else now + expires_s,
            "_order": time.time_ns(),
        }
        record["bytes"] = _write_atomic(data_path, data)
        _write_atomic(meta_path, json.dumps(record).encode())  # last: the file exists once this does
        return _public(record)

    def _live(self, record: dict[str, Any] | None) -> dict[str, Any] | None:
        """``record``, or None when there is none or it has expired (then its file is removed)."""
        if record is None:
            return None
        expires_at = record.get("expires_at")
        if expires_at is not None and expires_at <= time.time():
            self._remove(record["id"])
            return None
        return record

    def file(self, file_id: str) -> dict[str, Any] | None:
        paths = self._file_paths(file_id)
        record = self._live(_read_json(paths[0]) if paths else None)
        return _public(record) if record else None

    def file_data(self, file_id: str) -> bytes | None:
        paths = self._file_paths(file_id)
        if paths is None or self.file(file_id) is None:
            return None
        try:
            return paths[1].read_bytes()
        except OSError:
            return None

    def open_file_data(self, file_id: str) -> IO[bytes] | None:
        """The file's bytes opened for reading (the caller closes it), or None."""
        paths = self._file_paths(file_id)
        if paths is None or self.file(file_id) is None:
            return None
        try:
            return paths[1].open("rb")
        except OSError:
            return None

    def files(self) -> list[dict[str, Any]]:
        """Every file, oldest first."""
        records = [self._live(_read_json(p)) for p in (self.root / "files").glob("file-*.json")]
        return sorted((r for r in records if r), key=lambda r: r["_order"])

    def delete_file(self, file_id: str) -> bool:
        """Remove the file; False when there is none (an expired one included)."""
        if self.file(file_id) is None:
            return False
        self._remove(file_id)
        return True

    def _remove(self, file_id: str) -> None:
        for path in self._file_paths(file_id) or ():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    # ---- batches ------------------------------------------------------------------------------
    def _batch_path(self, batch_id: str, suffix: str = ".json") -> Path | None:
        if not _BATCH_ID.match(batch_id):
            return None
        return self.root / "batches" / f"{batch_id}{suffix}"

    @staticmethod
    def new_batch_id() -> str:
        return f"batch_{uuid.uuid4().hex}"

    def save_batch(self, record: dict[str, Any]) -> None:
        """Only the process running the batch (or creating it) writes its record."""
        path = self._batch_path(record["id"])
        assert path is not None, record["id"]  # ids are minted here
        new = "_order" not in record
        record.setdefault("_order", time.time_ns())
        _write_atomic(path, json.dumps(record).encode())
        if new:  # after the record: a listing never names a batch it cannot read
            self._mark(record)

    def _mark(self, record: dict[str, Any]) -> None:
        (self.root / "batches" / "order" / f"{record['_order']:020d}-{record['id']}").touch()

    def _batch_ids(self) -> list[str]:
        """Every batch id, oldest first, from the order markers' names (no record is read). A
        record without a marker (a directory written by an older version) gets one here, once."""
        batches = self.root / "batches"
        ids = self._marked_ids()
        known = set(ids)
        marked = False
        for path in batches.glob("batch_*.json"):
            record = None if path.stem in known else _read_json(path)
            if record is not None and "_order" in record:
                self._mark(record)
                marked = True
        return self._marked_ids() if marked else ids

    def _marked_ids(self) -> list[str]:
        names = sorted(os.listdir(self.root / "batches" / "order"))
        return list(dict.fromkeys(name.partition("-")[2] for name in names))  # each id once, first mark

    def _batch_record(self, batch_id: str) -> dict[str, Any] | None:
        path = self._batch_path(batch_id)
        record = _read_json(path) if path else None
        if record is None:
            return None
        if record["status"] in RUNNING:
            alive_at = self.alive_at(batch_id)
            if alive_at is None or time.time() - alive_at > ALIVE_STALE_S:
                return {
                    **record,
                    "status": "failed",
                    "failed_at": int(alive_at or record["created_at"]),
                    "errors": batch_errors(
                        "owner_lost", "The server process running this batch stopped before it finished."
                    ),
                }
        cancelled_at = self.cancel_requested(batch_id)
        if cancelled_at is not None and record["status"] in CANCELLABLE:
            record["status"] = "cancelling"
            record["cancelling_at"] = cancelled_at
        return record

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        """The batch as a client sees it: "cancelling" once a cancel is asked for while it runs."""
        record = self._batch_record(batch_id)
        return _public(record) if record else None

    def batches_page(self, limit: int, after: str | None) -> dict[str, Any] | None:
        """OpenAI's page of batches, newest first: the ``limit`` after ``after`` (None when
        ``after`` names no batch); reads only those records."""
        found = cursor(self._batch_ids()[::-1], limit, after)
        if found is None:
            return None
        ids, has_more = found
        return list_page([r for r in map(self._batch_record, ids) if r is not None], has_more)

    def touch_alive(self, batch_id: str) -> None:
        """The running process says it still runs the batch (see ``ALIVE_STALE_S``)."""
        path = self._batch_path(batch_id, ".alive")
        assert path is not None, batch_id
        path.touch()

    def alive_at(self, batch_id: str) -> float | None:
        path = self._batch_path(batch_id, ".alive")
        try:
            return path.stat().st_mtime if path is not None else None
        except OSError:
            return None

    def request_cancel(self, batch_id: str) -> None:
        path = self._batch_path(batch_id, ".cancel")
        if path is not None and not path.exists():
            _write_atomic(path, str(int(time.time())).encode())

    def cancel_requested(self, batch_id: str) -> int | None:
        """When a cancel of the batch was asked for (seconds), or None."""
        path = self._batch_path(batch_id, ".cancel")
        try:
            return int(path.read_bytes()) if path is not None else None
        except (OSError, ValueError):
            return None


def batch_errors(code: str, message: str) -> dict[str, Any]:
    """A batch record's ``errors`` (OpenAI's list shape) holding one error."""
    return {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}
