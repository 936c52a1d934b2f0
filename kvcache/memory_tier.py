"""``memory://`` — a process-local LRU of KV block values bounded by bytes.

URL forms:

* ``memory://?max_bytes=N`` — a private store for this opener (default bound 1 GiB).
* ``memory://NAME?max_bytes=N`` — a store shared by every opener of ``NAME`` *in this process*
  (e.g. two engines in one test process); it lives while any opener holds it open.

Only values count against the bound (keys are ~60 bytes next to ~100 KiB+ values). A value
larger than the whole bound is refused, and one that a later value of the same ``put_many``
evicts again counts as not written (a batch larger than the bound keeps only its tail).
``get_many`` refreshes recency; ``contains_prefix`` does not, so probing for a prefix never
reorders eviction. Nothing here is shared across processes: "shared by every replica" needs Redis.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvcache.metrics import TierStats
from kvcache.tier import Tier, TierURL, register_tier

DEFAULT_MAX_BYTES = 1 << 30


class LRUStore:
    """The byte-bounded LRU map behind a memory tier; every method holds one lock."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("memory tier max_bytes must be positive")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._evictions = 0

    def contains_prefix(self, keys: Sequence[str]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._data:
                    return i
            return len(keys)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                value = self._data.get(key)
                if value is not None:
                    self._data.move_to_end(key)
                out.append(value)
        return out

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        """One flag per item: ``False`` for a value larger than the whole bound, and for one that a
        later value of the same call evicted again (it never was readable once the call returned)."""
        stored = [False] * len(items)
        written: dict[str, list[int]] = {}  # key -> the items of this call that stored it
        with self._lock:
            for i, (key, value) in enumerate(items):
                size = len(value)
                if size > self.max_bytes:
                    continue
                old = self._data.pop(key, None)
                if old is not None:
                    self._bytes -= len(old)
                while self._bytes + size > self.max_bytes:
                    evicted_key, evicted = self._data.popitem(last=False)
                    self._bytes -= len(evicted)
                    self._evictions += 1
                    for j in written.pop(evicted_key, ()):
                        stored[j] = False
                self._data[key] = bytes(value)
                self._bytes += size
                stored[i] = True
                written.setdefault(key, []).append(i)
        return stored

    def keys(self) -> list[str]:
        """Keys from least to most recently used (for tests and debugging)."""
        with self._lock:
            return list(self._data)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                entries=len(self._data),
                bytes_used=self._bytes,
                capacity_bytes=self.max_bytes,
                evictions=self._evictions,
            )


_SHARED_LOCK = threading.Lock()
_SHARED: dict[str, tuple[LRUStore, int]] = {}  # name -> (store, number of open tiers using it)


class MemoryTier(Tier):
    """A ``Tier`` over an ``LRUStore``; never raises, never blocks beyond its lock."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, *, name: str | None = None) -> None:
        self.name = name
        self._closed = False
        if name is None:
            self.store = LRUStore(max_bytes)
            return
        with _SHARED_LOCK:
            store, users = _SHARED.get(name, (None, 0))
            if store is None:
                store = LRUStore(max_bytes)
            elif store.max_bytes != max_bytes:
                raise ValueError(
                    f"memory tier {name!r} is already open with max_bytes={store.max_bytes}, not {max_bytes}"
                )
            _SHARED[name] = (store, users + 1)
        self.store = store

    def contains_prefix(self, keys: Sequence[str]) -> int:
        return 0 if self._closed else self.store.contains_prefix(keys)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [None] * len(keys) if self._closed else self.store.get_many(keys)

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        return [False] * len(items) if self._closed else self.store.put_many(items)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.name is None:
            return
        with _SHARED_LOCK:
            store, users = _SHARED[self.name]
            if users <= 1:
                del _SHARED[self.name]
            else:
                _SHARED[self.name] = (store, users - 1)

    def stats(self) -> TierStats:
        return self.store.stats()


@register_tier("memory")
def _open_memory(url: TierURL) -> Tier:
    max_bytes = url.pop_int("max_bytes", DEFAULT_MAX_BYTES, minimum=1)
    assert max_bytes is not None
    name = url.parts.netloc or None
    if url.parts.path not in ("", "/"):
        raise ValueError(f"memory tier URL {url.url!r} takes no path (use memory://NAME?max_bytes=N)")
    return MemoryTier(max_bytes, name=name)
