"""Overload control: at most ``max_concurrency`` requests relayed at once, ``max_queue`` waiting.

Beyond that the router answers 429 with ``Retry-After`` at once instead of queueing without bound.
Waiters are served first come, first served; a waiter whose client left (its task is cancelled)
gives up its place. ``try_acquire`` signals shortage by returning False, never by raising.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Admission:
    def __init__(self, max_concurrency: int, max_queue: int, queue_timeout: float) -> None:
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def try_acquire(self) -> bool:
        if self.active < self.max_concurrency and not self._waiters:
            self.active += 1
            return True
        if len(self._waiters) >= self.max_queue:
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout)
        except asyncio.TimeoutError:
            if fut.done():  # granted just as the timeout fired: keep the slot
                return True
            self._waiters.remove(fut)
            fut.cancel()
            return False
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed to us; pass it on
            elif fut in self._waiters:
                self._waiters.remove(fut)
            raise
        return True

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # hand our slot straight to the next waiter
                return
        self.active -= 1
