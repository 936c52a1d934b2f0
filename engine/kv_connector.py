"""The engine's hook for an external KV store (the KV tier): load blocks before a prefill.

The base class is the "no tier" connector: every method is a cheap no-op, so the scheduler calls
it unconditionally and no hot path tests whether a tier exists. A tier implementation subclasses
it; ``build_kv_connector`` creates it from ``EngineConfig.kv_tier`` through
``kvcache.connector.create_connector(config, engine)`` (imported only when a tier is configured).

Contract, in the order the engine calls it (all on the engine loop thread):

1. ``num_loadable_blocks(request, hashes)`` at admission, after the device prefix cache matched
   ``request.num_computed_tokens`` tokens: how many *leading* blocks of ``hashes`` (the request's
   next full-block hashes) the tier can supply. A connector whose tier is remote may also have
   ``num_loadable_blocks_async(request, hashes)``: a ``Future[int]`` for the same answer, or
   None when asking synchronously is as cheap (an in-process tier). The scheduler starts one
   when a request arrives (or returns to the queue), over its leading blocks from the first, and
   admits it once the answer is in: other requests keep stepping while the tier is slow.
2. The scheduler allocates device blocks for them, then calls
   ``load_blocks(request, block_ids, hashes)``: write each block's KV into
   ``engine.model_runner.kv_caches`` at ``block_ids[i]`` and return how many leading blocks were
   written (a partial return is fine: the rest is recomputed). Loaded blocks join the device prefix
   cache and count as cached tokens.
3. Full blocks of any request are announced through ``BlockManager`` listeners
   (``engine.block_manager.add_listener``) after their KV is written: the place for tier writes
   and block events.
4. ``request_finished(request)`` when a request ends (any reason, before its blocks are freed,
   so a producer can still read its KV; ``request.finish_reason`` is set); may set
   ``request.kv_transfer_result`` (a dict that the engine returns on the final
   ``RequestOutput.kv_transfer``), or ``request.kv_transfer_future`` (a ``Future`` of that dict:
   the engine frees the request's blocks at once and holds its final output until it is done).
5. ``step()`` at the start of every engine step that runs (not asleep): the connector's own
   bounded work (the KV tier's due probes and checks, its re-publication pass); it must return at
   once, never wait on I/O. While ``has_work()`` says there is more (a pass, or a check of the tier
   that is due) and no request runs, ``LLMEngine.idle_step`` calls ``step()`` at most every
   ``TIER_IDLE_WAIT_S`` (an idle async engine keeps the pass going and probes the tier); otherwise
   an idle async engine sleeps until a command arrives or ``next_work_in()`` seconds passed (None:
   nothing scheduled), so a periodic check (the Redis tier's flush check) runs with no traffic.
6. Sleep mode and weight updates, with no request running: ``release_caches()`` before the KV
   cache is freed, ``bind_caches(kv_caches)`` once it is allocated again, ``set_fingerprint(fp)``
   after new weights were installed (blocks of the old weights are never read as the new ones').
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.sequence import Request


class KVConnector:
    """No external KV store."""

    def num_loadable_blocks(self, request: Request, block_hashes: Sequence[bytes]) -> int:
        return 0

    def load_blocks(self, request: Request, block_ids: Sequence[int], block_hashes: Sequence[bytes]) -> int:
        return 0

    def request_finished(self, request: Request) -> None:
        return None

    def step(self) -> None:
        """Once per engine step, before scheduling: bounded work of the connector's own."""
        return None

    def has_work(self) -> bool:
        """Whether ``step`` has work of its own to do even with no request to step."""
        return False

    def next_work_in(self) -> float | None:
        """Seconds until ``has_work`` may turn true with no request arriving (0: it is), None when
        nothing is scheduled; no I/O."""
        return None

    def count_lookup_misses(self, num_blocks: int) -> None:
        """An admitted request asked the tier for ``num_blocks`` blocks (after those it loads) that
        the tier did not hold: misses in the tier's metrics."""
        return None

    def close(self) -> None:
        return None

    # Sleep mode and weight updates (engine/sleep_mode.py, engine/weight_update.py), between steps:
    def release_caches(self) -> None:
        """Drop every reference to ``model_runner.kv_caches``: they are about to be freed."""
        return None

    def bind_caches(self, kv_caches: Sequence[tuple[Any, ...]]) -> None:
        """``model_runner.kv_caches`` were allocated anew (waking from sleep)."""
        return None

    def set_fingerprint(self, fingerprint: str) -> None:
        """The weights changed: blocks are keyed by the new ``model_runner.model_fingerprint`` from now on."""
        return None


def build_kv_connector(config: EngineConfig, engine: Any) -> KVConnector:
    if not config.kv_tier:
        return KVConnector()
    module = importlib.import_module("kvcache.connector")
    return module.create_connector(config, engine)
