"""``POST /reset_prefix_cache`` (vLLM's admin route): drop the cached, unused KV blocks.

Benchmarks call it between runs so each run starts cold. The block manager belongs to the engine
loop thread, so the reset must not run while that thread works: with an engine that offers
``reset_prefix_cache()`` (run on its own loop) that is the engine's business; otherwise the reset
runs only when no request is in flight, under the loop's wake lock, so the loop cannot start a
step meanwhile. A busy replica answers 409 and the caller retries when idle (vLLM likewise refuses
while blocks are in use).
"""

from __future__ import annotations

import inspect
from typing import Any

from server.errors import APIError
from server.generation import Generation


def _busy() -> APIError:
    return APIError(
        409,
        "The prefix cache cannot be reset while requests are running; retry when the replica is idle.",
        code="prefix_cache_busy",
    )


async def reset_engine_prefix_cache(engine: Any, generation: Generation) -> int:
    """Blocks dropped from the prefix cache; raises 409 while requests run."""
    if generation.in_flight:
        raise _busy()
    reset = getattr(engine, "reset_prefix_cache", None)
    if reset is not None:
        result = reset()
        if inspect.isawaitable(result):
            result = await result
        if result is False:
            raise _busy()
        return int(result or 0)
    core = engine.engine  # the LLMEngine the loop thread drives
    with engine._wake:  # the loop thread waits on this condition while it has nothing to do
        if core.has_unfinished_requests():
            raise _busy()
        dropped = core.block_manager.reset_prefix_cache()
        engine._stats = core.stats()
    return dropped
