"""A two-level tier: a fast local L1 (memory LRU) in front of a shared L2 (Redis).

Reads try L1 first and ask L2 only for what L1 lacks; L2 hits are copied into L1 so the
next read of a hot prefix never leaves the process. Writes go to both. L2 is expected to
be guarded (never raising), so an L2 outage degrades to L1-only behaviour.

Opened with ``redis://host:port/db?l1_bytes=N``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvcache.memory_tier import MemoryTier
from kvcache.metrics import TierStats
from kvcache.tier import Tier


class CompositeTier(Tier):
    def __init__(self, l1: MemoryTier, l2: Tier) -> None:
        self.l1 = l1
        self.l2 = l2

    def contains_prefix(self, keys: Sequence[str]) -> int:
        # Alternate between levels: a key counts if either level holds it. Each L2 round trip
        # covers a whole run, so the common cases (all in L1, or L1 a prefix of L2) cost <= 1.
        i = self.l1.contains_prefix(keys)
        while i < len(keys):
            step = self.l2.contains_prefix(keys[i:])
            i += step
            if i == len(keys):
                break
            step_l1 = self.l1.contains_prefix(keys[i:])
            if step_l1 == 0:
                break
            i += step_l1
        return i

    def contains_prefix_many(self, key_lists: Sequence[Sequence[str]]) -> list[int]:
        # L1 for every list, then one batched L2 call for the lists L1 did not cover; a list whose
        # L2 run ends early goes on alternating alone (rare: L1 holding blocks L2 lost).
        found = [self.l1.contains_prefix(keys) for keys in key_lists]
        todo = [j for j, keys in enumerate(key_lists) if found[j] < len(keys)]
        if not todo:
            return found
        steps = self.l2.contains_prefix_many([key_lists[j][found[j] :] for j in todo])
        for j, step in zip(todo, steps, strict=True):
            keys, i = key_lists[j], found[j] + step
            if step and i < len(keys) and self.l1.contains_prefix(keys[i : i + 1]):
                i += self.contains_prefix(keys[i:])
            found[j] = i
        return found

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        values = self.l1.get_many(keys)
        missing = [i for i, v in enumerate(values) if v is None]
        if not missing:
            return values
        fetched = self.l2.get_many([keys[i] for i in missing])
        promote: list[tuple[str, bytes]] = []
        for i, value in zip(missing, fetched, strict=True):
            if value is not None:
                values[i] = value
                promote.append((keys[i], value))
        if promote:
            self.l1.put_many(promote)
        return values

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        # A write counts as stored when the shared level took it: L1 is this process's alone, and
        # another replica (a decode worker after a prefill) can only find what L2 holds.
        self.l1.put_many(items)
        return self.l2.put_many(items)

    def contains_many(self, keys: Sequence[str]) -> list[bool] | None:
        # L1 holds every block this process wrote: only the shared level says what others can read.
        return self.l2.contains_many(keys)

    def epoch(self) -> int:
        return self.l2.epoch()

    def available(self) -> bool:
        return self.l2.available()

    def poll(self) -> None:
        self.l2.poll()

    def poll_due_in(self) -> float | None:
        return self.l2.poll_due_in()

    def close(self) -> None:
        self.l1.close()
        self.l2.close()

    def stats(self) -> TierStats:
        l1, l2 = self.l1.stats(), self.l2.stats()
        return replace(
            l2,
            entries=l1.entries,
            bytes_used=l1.bytes_used,
            capacity_bytes=l1.capacity_bytes,
            evictions=l1.evictions,
        )
