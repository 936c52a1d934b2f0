"""Stopping a background task that talks to Redis through ``redis.asyncio``, for sure.

``task.cancel()`` then ``await task`` ends a task only if the cancellation reaches it. redis-py
(8.2, measured) can swallow one: a cancel that lands while a command's reply is being read can come
out as the command's own outcome (a ``ResponseError`` from a full Redis, say), and a heartbeat loop
that logs that error and goes on beating never ends. Its owner's ``stop()`` then waits forever: a
replica's drain, or a router's shutdown, hangs. ``cancel_and_wait`` cancels again while the task
still runs, so the next cancellation lands where nothing swallows it (the loop's own sleep). This
module must never import torch (the router uses it).
"""

from __future__ import annotations

import asyncio
import contextlib

RECANCEL_S = 0.1  # how long one cancellation is given before the task is cancelled again


async def cancel_and_wait(task: asyncio.Task) -> None:
    """Cancel ``task`` until it has ended, then raise what it raised (a cancellation excepted)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)
    with contextlib.suppress(asyncio.CancelledError):
        await task
