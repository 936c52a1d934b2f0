"""One asyncio lock per key, made on first use and dropped when no one holds or waits for it.

For changes that must run one at a time per name and in arrival order (a LoRA adapter's load and
unload: ``engine/async_lora.py`` on an engine, ``router/lora_admin.py`` across replicas). Torch-free,
so the router may import it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class KeyedLocks:
    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # key -> (lock, [holders + waiters])

    def busy(self, key: str) -> bool:
        """Whether someone holds ``key`` now (a new ``hold`` would wait)."""
        entry = self._locks.get(key)
        return entry is not None and entry[0].locked()

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        """Hold ``key``'s lock for the ``async with`` block, after those who asked before."""
        lock, users = self._locks.setdefault(key, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._locks[key]
