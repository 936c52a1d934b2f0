"""Which replica holds which KV blocks, as far as the router knows: a bounded LRU map.

Keys are chained block hashes (``kvcache.keys``), so holding block i implies holding the prefix
up to i: a replica's cached prefix for a prompt is the run of leading hashes it holds. Entries
come from two sources with one API: the router's own routing history (approximate: a replica
that served a prompt probably still holds its blocks) and replicas' block stored/removed events
(exact). Memory is bounded by ``capacity`` hash entries; the least recently used go first.
Each entry is an int bitmask over replica slots, so an entry costs the same for 1 or 64 replicas.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self, capacity: int = 1 << 18) -> None:
        if capacity < 1:
            raise ValueError("prefix index capacity must be positive")
        self.capacity = capacity
        self._entries: OrderedDict[bytes, int] = OrderedDict()
        self._slot: dict[str, int] = {}  # url -> bit index
        self._free_slots: list[int] = []
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _bit(self, url: str) -> int:
        slot = self._slot.get(url)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot)
            self._slot[url] = slot
        return 1 << slot

    def insert(self, hashes: Iterable[bytes], url: str) -> None:
        """``url`` holds these blocks (refreshes their recency)."""
        bit = self._bit(url)
        entries = self._entries
        for h in hashes:
            mask = entries.pop(h, 0)
            entries[h] = mask | bit
        while len(entries) > self.capacity:
            entries.popitem(last=False)
            self.evictions += 1

    def remove(self, hashes: Iterable[bytes], url: str) -> None:
        """``url`` evicted these blocks (exact events)."""
        slot = self._slot.get(url)
        if slot is None:
            return
        bit = 1 << slot
        for h in hashes:
            mask = self._entries.get(h)
            if mask is not None and mask & bit:
                mask &= ~bit
                if mask:
                    self._entries[h] = mask
                else:
                    del self._entries[h]

    def drop_replica(self, url: str) -> None:
        """Forget everything ``url`` held (it left, or it reported a cleared cache)."""
        slot = self._slot.pop(url, None)
        if slot is None:
            return
        bit = 1 << slot
        for h in [h for h, m in self._entries.items() if m & bit]:
            mask = self._entries[h] & ~bit
            if mask:
                self._entries[h] = mask
            else:
                del self._entries[h]
        self._free_slots.append(slot)

    def match(self, hashes: Sequence[bytes], urls: Sequence[str]) -> dict[str, int]:
        """For each url, how many leading blocks of ``hashes`` it holds (O(blocks + replicas))."""
        bits = {u: 1 << s for u in urls if (s := self._slot.get(u)) is not None}
        result = dict.fromkeys(urls, 0)
        alive = 0
        for bit in bits.values():
            alive |= bit
        depth = 0
        entries = self._entries
        for h in hashes:
            if not alive:
                break
            mask = entries.get(h, 0) & alive
            if mask != alive:  # some replicas' prefixes end here
                self._settle(bits, alive & ~mask, depth, result)
                alive = mask
                if not alive:
                    break
            entries.move_to_end(h)
            depth += 1
        self._settle(bits, alive, depth, result)
        return result

    @staticmethod
    def _settle(bits: dict[str, int], mask: int, depth: int, result: dict[str, int]) -> None:
        if mask:
            for u, bit in bits.items():
                if mask & bit:
                    result[u] = depth

    def holders(self, block_hash: bytes) -> set[str]:
        mask = self._entries.get(block_hash, 0)
        return {u for u, s in self._slot.items() if mask >> s & 1}

    def check_integrity(self) -> None:
        assert len(self._entries) <= self.capacity
        used = set(self._slot.values())
        assert len(used) == len(self._slot), "two replicas share a slot"
        assert not used & set(self._free_slots), "a free slot is in use"
        all_bits = 0
        for s in used:
            all_bits |= 1 << s
        for mask in self._entries.values():
            assert mask and not mask & ~all_bits, "entry points at no replica or a freed slot"
