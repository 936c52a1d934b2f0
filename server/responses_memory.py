"""``--responses-store memory``: the records of stored responses in one process's memory
(``MemoryRecords``), bounded in bytes and age, with the event logs, cancel flags and leases of
background responses. What a record is and what each store keeps: ``server/responses_store.py``;
the async stores over these records (this process's, or the engine process's for every API
server): ``server/responses_memory_stores.py``.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import islice

from prometheus_client import Gauge

from server.responses_store import EVENT_LOG_LIMIT, EVENT_READ_BATCH, says_running

# What the memory store counts beyond the JSON it holds (CPython 3.11, 64-bit, measured with
# tracemalloc and rounded up), so that ``--responses-store-max-bytes`` bounds real memory and not
# only the JSON, which small records would pass by half or more:
# a record: its id (``+ len(id)``), the ``bytes`` object, its entry in the ordered map, its
# (expiry, data) tuple, its set of indexed item ids, and its cancel flag or lease when it has one;
RECORD_OVERHEAD = 480
# an indexed item: its id (``+ len(id)``), its entry in the item map and in its record's set;
ITEM_OVERHEAD = 200
# a record's event log (the log and its deque), and each event in it (the ``bytes`` object's
# header and the deque's slot).
EVENT_LOG_OVERHEAD = 1024
EVENT_OVERHEAD = 48

# The memory store's size (process-wide registry; with --api-server-count, the engine process's,
# summed with the API servers' zeros).
STORED = Gauge(
    "ferry:responses_stored", "Responses held in this replica's memory store.", multiprocess_mode="livesum"
)
STORED_BYTES = Gauge(
    "ferry:responses_stored_bytes", "Bytes of the responses (their JSON, kept events and index entries, with the overheads counted) in this replica's memory store.",
    multiprocess_mode="livesum",
)  # fmt: skip


def _record_bytes(response_id: str, data: bytes) -> int:
    return RECORD_OVERHEAD + len(response_id) + len(data)


def _item_bytes(item_id: str) -> int:
    return ITEM_OVERHEAD + len(item_id)


@dataclass
class _EventLog:
    """The latest events of one response: ``frames[0]`` is event ``first``."""

    first: int = 0
    frames: deque[bytes] = field(default_factory=deque)
    bytes: int = 0


class MemoryRecords:
    """Records as JSON bytes in insertion/use order, bounded in bytes and age, with the event logs,
    cancel flags and leases of background responses (synchronous: the engine process serves it to
    API servers from its event loop, so each call is atomic). A record's events and index entries
    count in its bytes (with the fixed overheads above) and go with it."""

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._logs: dict[str, _EventLog] = {}
        self._cancels: set[str] = set()
        self._leases: dict[str, float] = {}  # response id -> when its lease expires (clock)
        self._item_records: dict[str, str] = {}  # item id -> the latest record holding it
        self._items_of: dict[str, set[str]] = {}  # response id -> the item ids it indexed
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def _live(self, response_id: str) -> bytes | None:
        """The record's bytes unless it is absent or expired (then dropped)."""
        entry = self._records.get(response_id)
        if entry is None:
            return None
        if self._clock() >= entry[0]:
            self.delete(response_id)
            return None
        return entry[1]

    def get(self, response_id: str) -> bytes | None:
        data = self._live(response_id)
        if data is not None:
            self._records.move_to_end(response_id)
        return data

    def put(self, response_id: str, data: bytes, items: Iterable[str] = (), ended: bool = False) -> bool:
        """``items``: the record's item ids (``item_ids``), indexed to it; a record replaced
        without them keeps the ones it indexed. ``ended``: the record says its response no longer
        runs, so its lease is given back now (nothing else would drop it while no other background
        response renews leases)."""
        if ended:
            self._leases.pop(response_id, None)
        indexed = self._items_of.get(response_id, set())
        new_items = {item_id for item_id in items if item_id not in indexed}
        charge = _record_bytes(response_id, data) + sum(map(_item_bytes, new_items))
        if charge + sum(map(_item_bytes, indexed)) > self.max_bytes:
            self.delete(response_id)
            self._leases.pop(response_id, None)
            return False
        old = self._records.pop(response_id, None)  # replaced: its events and flag stay
        if old is not None:
            self.bytes -= _record_bytes(response_id, old[1])
        self._records[response_id] = (self._clock() + self.ttl_s, data)
        self.bytes += charge
        if new_items:  # no empty set kept per record (216 bytes each)
            self._items_of[response_id] = indexed | new_items
        for item_id in items:
            self._item_records[item_id] = response_id
        self._evict()
        return True

    def find_item(self, item_id: str) -> bytes | None:
        response_id = self._item_records.get(item_id)
        return None if response_id is None else self.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._records.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= _record_bytes(response_id, entry[1])
        log = self._logs.pop(response_id, None)
        if log is not None:
            self.bytes -= log.bytes
        self._cancels.discard(response_id)
        self._leases.pop(response_id, None)
        for item_id in self._items_of.pop(response_id, ()):
            self.bytes -= _item_bytes(item_id)
            if self._item_records.get(item_id) == response_id:  # not since indexed to a later one
                del self._item_records[item_id]
        self._publish()
        return True

    def append_events(self, response_id: str, first_seq: int, frames: Iterable[bytes]) -> None:
        if self._live(response_id) is None:
            return
        log = self._logs.get(response_id)
        if log is None:
            log = self._logs[response_id] = _EventLog(first=first_seq, bytes=EVENT_LOG_OVERHEAD)
            self.bytes += EVENT_LOG_OVERHEAD
        for frame in frames:
            log.frames.append(frame)
            log.bytes += len(frame) + EVENT_OVERHEAD
            self.bytes += len(frame) + EVENT_OVERHEAD
        while len(log.frames) > EVENT_LOG_LIMIT:
            dropped = log.frames.popleft()
            log.first += 1
            log.bytes -= len(dropped) + EVENT_OVERHEAD
            self.bytes -= len(dropped) + EVENT_OVERHEAD
        self._records.move_to_end(response_id)
        self._evict()

    def read_events(self, response_id: str, after: int) -> tuple[int | None, list[bytes]]:
        log = self._logs.get(response_id) if self._live(response_id) is not None else None
        if log is None or not log.frames:
            return None, []
        start = max(0, after + 1 - log.first)
        return log.first, list(islice(log.frames, start, start + EVENT_READ_BATCH))

    def request_cancel(self, response_id: str) -> None:
        if self._live(response_id) is not None:
            self._cancels.add(response_id)

    def cancel_requested(self, response_ids: list[str]) -> list[str]:
        return [rid for rid in response_ids if rid in self._cancels]

    def claim(self, response_id: str, ttl_s: float) -> None:
        self._cancels.discard(response_id)
        self._leases[response_id] = self._clock() + ttl_s

    def renew_leases(self, response_ids: list[str], ttl_s: float) -> None:
        now = self._clock()
        # Leases nobody renews (their process died, their record was never kept) go here.
        for rid in [rid for rid, until in self._leases.items() if until <= now]:
            del self._leases[rid]
        for rid in response_ids:
            self._leases[rid] = now + ttl_s

    def lease_held(self, response_id: str) -> bool:
        return self._clock() < self._leases.get(response_id, float("-inf"))

    def replace_orphan(self, response_id: str, data: bytes) -> bool:
        current = self._live(response_id)
        if current is None or self.lease_held(response_id) or not says_running(current):
            return False
        return self.put(response_id, data, ended=True)

    def events_end(self, response_id: str) -> int:
        log = self._logs.get(response_id) if self._live(response_id) is not None else None
        return 0 if log is None else log.first + len(log.frames)

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._records:
            self.delete(next(iter(self._records)))
        self._publish()

    def _publish(self) -> None:
        STORED.set(len(self._records))
        STORED_BYTES.set(self.bytes)


# What an API server process may ask of the engine process's MemoryRecords (``EngineClient.store``).
MEMORY_OPS = frozenset(
    "get put find_item delete append_events read_events request_cancel cancel_requested claim "
    "renew_leases lease_held replace_orphan events_end".split()
)
