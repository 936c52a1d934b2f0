"""What this replica saw the shared tier hold, so that it can tell when a block is gone (torch-free).

A ``stored`` tier event (``kvcache/events.py``) says the tier holds a block; nothing in Redis says
when it stops holding it: ``maxmemory`` eviction (``allkeys-lru``, ``volatile-*``), a key's
``ttl`` running out, an operator's ``DEL``. Keyspace notifications would, but a managed Redis often
has them off and refuses ``CONFIG SET``, so ferry does not rely on them. A reader of the stream
(``events.PrefixIndex.tier_prefix``) would take such a block for one it can load.

Every replica with events on keeps ``TierPresence``: the blocks it saw the tier hold (its writes the
tier acknowledged, the blocks a lookup found or a load read), a bounded LRU. A read that finds one
of them gone (a lookup's first absent block, a load's missing value, a re-publication check) is a
removal this replica saw: the block is forgotten and a ``removed`` tier event goes out on the
writer's queue (after the writes queued before it). Block hashes chain, so the first absent block
of a prefix is the one a reader's prefix match needs to lose.

Two guards keep the events in order with the replica's own writes: a block whose write is pending
(queued or being written) is not reported (its write announces it again), nor one seen again since
the read that found it absent started (``generation``: a write acknowledged meanwhile).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

MAX_KNOWN_BLOCKS = 16384  # ~5 MB at most: a key string and a tuple per block


class TierPresence:
    """See the module docstring. Thread-safe (the writer, lookup, loader and engine threads)."""

    def __init__(self, capacity: int = MAX_KNOWN_BLOCKS) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._lock = threading.Lock()
        # tier key -> (fingerprint, block hash, generation it was last seen at)
        self._known: OrderedDict[str, tuple[str, bytes, int]] = OrderedDict()
        self._generation = 0
        self.removals = 0  # blocks found gone and reported (tests, stats)

    @property
    def generation(self) -> int:
        """Read before a lookup or load: what it finds absent was not seen since (``lost``)."""
        with self._lock:
            return self._generation

    def __len__(self) -> int:
        with self._lock:
            return len(self._known)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._known

    def saw(self, blocks: Iterable[tuple[str, str, bytes]]) -> None:
        """The tier holds these ``(key, fingerprint, hash)`` blocks (as of now)."""
        with self._lock:
            self._generation += 1
            gen = self._generation
            known = self._known
            for key, fingerprint, block_hash in blocks:
                known.pop(key, None)
                known[key] = (fingerprint, bytes(block_hash), gen)
            while len(known) > self.capacity:
                known.popitem(last=False)

    def lost(
        self, keys: Sequence[str], since: int, pending: Callable[[bytes], bool] = lambda h: False
    ) -> list[tuple[str, bytes]]:
        """A read that started at generation ``since`` found ``keys`` absent: the ``(fingerprint,
        hash)`` of those this replica had seen held, and not seen again since nor being written
        (``pending``), forgotten now; the caller reports them removed."""
        gone: list[tuple[str, bytes]] = []
        with self._lock:
            for key in keys:
                entry = self._known.get(key)
                if entry is None or entry[2] > since or pending(entry[1]):
                    continue
                del self._known[key]
                gone.append((entry[0], entry[1]))
            self.removals += len(gone)
        return gone
