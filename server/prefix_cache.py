"""``POST /reset_prefix_cache`` (vLLM's admin route): drop the cached, unused KV blocks.

Benchmarks call it between runs so each run starts cold. The block manager belongs to the engine
loop thread, so the reset is a command the loop runs between steps (``AsyncEngine.reset_prefix_cache``).
A busy replica answers 409 and the caller retries when idle (vLLM likewise refuses while blocks
are in use), unless asked for vLLM's ``reset_running_requests=true``: the running requests are
preempted first (they recompute, with the same tokens) and the reset goes through.
"""

from __future__ import annotations

from typing import Any

from server.errors import APIError
from server.generation import Generation


def _busy() -> APIError:
    return APIError(
        409,
        "The prefix cache cannot be reset while requests are running; retry when the replica is idle.",
        code="prefix_cache_busy",
    )


async def reset_engine_prefix_cache(engine: Any, generation: Generation, reset_running: bool = False) -> int:
    """Blocks dropped from the prefix cache; raises 409 while requests run (unless ``reset_running``)."""
    if generation.in_flight and not reset_running:
        raise _busy()
    result = await engine.reset_prefix_cache(reset_running)
    if result is False:
        raise _busy()
    return int(result)
