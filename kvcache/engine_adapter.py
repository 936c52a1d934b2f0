"""Binds a ``KVConnector`` to ferry's engine hooks (``engine/kv_connector.py``) and block listeners.

``engine.kv_connector.build_kv_connector`` calls ``kvcache.connector.create_connector(config,
engine)`` when ``EngineConfig.kv_tier`` is set; that returns a ``TierConnector``. It matches the
engine's hook methods by name (it does not import ``engine``: parts import downward only, engine
→ kvcache), and reads from the engine only ``model_runner.kv_caches`` (per layer ``(k, v)``,
``[num_blocks, block_size, num_kv_heads, head_dim]``; ``(latent,)`` for MLA models),
``model_runner.model_fingerprint`` and
``block_manager.add_listener``. Sleep mode hands it new cache tensors (``bind_caches``) or takes
them away (``release_caches``); a weight update changes its fingerprint (``set_fingerprint``).

What happens when (all on the engine loop thread):

* arrival: ``num_loadable_blocks_async`` → ``KVConnector.lookup_async`` (a remote tier: batched
  with other arrivals' lookups on the lookup thread, one round trip);
* admission: ``num_loadable_blocks`` → ``KVConnector.lookup`` (one round trip) unless the
  arrival's lookup answered, then
  ``load_blocks`` → ``KVConnector.load`` into the freshly allocated blocks (or
  ``load_blocks_async`` → a ``Future[int]`` for a scheduler that parks the request meanwhile);
* a block becomes full and registered in the device prefix cache (``block_stored``): its KV is
  snapshotted and queued for the tier — unless it was itself just loaded from the tier;
* a cached block is evicted (``block_removed``): only a device event, if events are on;
* every step (``step``): the tier's due background checks start (``Tier.poll``: an open breaker's
  probe after its cool-down, a Redis tier's flush check), then the re-publication pass
  (``kvcache/republish.py``) takes its bounded share: after the tier came back (or writes were
  dropped for a full queue), the prefix cache's blocks it lacks are written again. An idle
  engine sleeps until ``next_work_in`` (the end of an open breaker's cool-down, the next flush
  check; never with neither), then ``has_work`` has its ``idle_step`` start them, so a tier back
  or flushed is noticed and the pass runs with no traffic;
* a lookup also asks for the block holding the request's last token when the blocks asked end
  just before it (``_with_computed_block``): the engine computes that block anyway, and one the
  tier holds already is not written again;
* a ``kv_transfer`` producer request finishes (``request_finished``): on the reporter thread,
  wait (bounded) until its prompt blocks reached the tier, so the consumer that the router calls
  next finds them, and report how many leading prompt blocks the tier holds
  (``kv_transfer.tier_blocks``); the engine holds the request's final output until then
  (``request.kv_transfer_future``) and steps on meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.attention.base import raw
from kvcache.connector import ConnectorStats, KVConnector
from kvcache.log_limit import RateLimitedLog
from kvcache.republish import Republisher
from kvcache.tier import TierURL

logger = logging.getLogger(__name__)

PRODUCER_FLUSH_TIMEOUT_S = 5.0
MAX_UNREGISTERED_LOADS = 65536
# How often an idle engine looks at the writer while writes handed to it wait for their answer
# (``next_work_in``): one the server refuses then gets its retry scheduled with no request.
PENDING_WRITES_POLL_S = 0.1


class TierConnector:
    """The engine's KV connector when a tier is configured (see the module docstring)."""

    def __init__(self, config: Any, engine: Any) -> None:
        runner = engine.model_runner
        # Per layer (k, v), or (latent,) for an MLA model: then there are no V caches.
        # An fp8 cache moves as its bytes (uint8 views: indexed copies of fp8 are not implemented
        # everywhere); its fingerprint already keeps its blocks apart from other dtypes'.
        self.bind_caches(runner.kv_caches)
        k0 = self.k_caches[0]
        block_shape = (len(self.k_caches), len(runner.kv_caches[0]), *k0.shape[1:])
        self.block_size = int(k0.shape[1])
        self.kv = KVConnector(
            config.kv_tier,
            runner.model_fingerprint,
            block_shape,
            k0.dtype,
            config.kv_tier_write_queue,
            events=config.kv_events,
            replica_id=config.kv_events_replica_id,
            # The events name the engine's start, as its /health does: a router tells a restarted
            # replica's blocks from the previous process's by it.
            instance_id=getattr(engine, "instance_id", None),
        )
        # memory:// answers lookups in microseconds: no thread hop for them.
        self._in_process = TierURL(config.kv_tier).scheme == "memory"
        # Hashes loaded from the tier (or found there by a lookup, for the block a request computes
        # anyway: ``_with_computed_block``) and not yet registered by the block manager: a block the
        # tier holds must not be written back to it. Loader and lookup threads add, the engine
        # thread removes.
        self._lock = threading.Lock()
        self._just_loaded: set[bytes] = set()
        self._reporter: ThreadPoolExecutor | None = None  # producers' finish reports, one at a time
        self._shortfall_log = RateLimitedLog(logger)  # written on the reporter thread only
        self.republisher = Republisher(self.kv, engine.block_manager)
        engine.block_manager.add_listener(self)

    # -- engine hooks ------------------------------------------------------------------------------

    def num_loadable_blocks(self, request: Any, block_hashes: Sequence[bytes]) -> int:
        asked = self._with_computed_block(request, block_hashes)
        return self._loadable(asked, len(block_hashes), self.kv.lookup(asked))

    def num_loadable_blocks_async(self, request: Any, block_hashes: Sequence[bytes]) -> Future[int] | None:
        """``num_loadable_blocks`` on the connector's lookup thread (batched with other requests'
        lookups: one round trip); None for an in-process tier, which answers synchronously at once."""
        if self._in_process:
            return None
        asked = self._with_computed_block(request, block_hashes)
        found = self.kv.lookup_async(asked)
        if len(asked) == len(block_hashes):
            return found
        answer: Future[int] = Future()

        def settle(done: Future[int]) -> None:  # on the lookup thread
            try:
                answer.set_result(self._loadable(asked, len(block_hashes), done.result()))
            except Exception as exc:  # a failed lookup is the scheduler's miss, as before
                answer.set_exception(exc)

        found.add_done_callback(settle)
        return answer

    def _with_computed_block(self, request: Any, block_hashes: Sequence[bytes]) -> list[bytes]:
        """``block_hashes`` and, when they end just before it, the request's full block that holds
        its last known token. The engine computes that block even when the tier holds it (its last
        token's logits draw the next token), so it is never loaded; asking for it in the same round
        trip (one more key of the same script) tells whether the tier holds it already, and then
        ``block_stored`` does not write it again (``_loadable``). A prompt that ends on a block
        boundary (a shared prefix sent alone, a chat turn) would otherwise rewrite a block every
        replica that computes it."""
        hashes = list(block_hashes)
        last = (request.num_tokens - 1) // self.block_size  # the block of the last token
        full = request.full_block_hashes()
        if not hashes or last >= len(full) or last < len(hashes) or full[last - len(hashes) : last] != hashes:
            return hashes
        return [*hashes, full[last]]

    def _loadable(self, asked: list[bytes], wanted: int, found: int) -> int:
        """The scheduler's answer (of its ``wanted`` blocks) from a lookup of ``asked``: a found block
        past them is one the tier holds, which the request computes: not written back."""
        if found > wanted:
            self._mark_loaded(asked[wanted:found])
        elif len(asked) > wanted:
            with self._lock:  # not there (any more): a block this replica computes is written
                self._just_loaded.difference_update(asked[wanted:])
        return min(found, wanted)

    def count_lookup_misses(self, num_blocks: int) -> None:
        self.kv.tier.count_blocks(0, num_blocks)

    def step(self) -> None:
        self.kv.tier.poll()
        self.republisher.step(self.k_caches, self.v_caches)

    def has_work(self) -> bool:
        """A pass to advance, or a check of the tier due now (``poll`` starts it): an open breaker's
        probe once its cool-down passed, the Redis tier's flush check. Only a call or ``poll``
        starts them, and an idle replica makes no call: without this it would notice neither a
        tier back nor a flushed one before its next request."""
        return self.next_work_in() == 0.0

    def next_work_in(self) -> float | None:
        """Seconds until ``has_work`` (0: now), None with nothing scheduled (``Tier.poll_due_in``):
        an idle engine sleeps this long, so it makes no wake-up it does not need."""
        if self.republisher.has_work():
            return 0.0
        # Refused writes wait for a tier that answers (an open breaker's recovery pass covers them).
        retry = self.kv.refused_retry_in() if self.kv.tier.available() else None
        # Writes still on the writer thread may yet be refused: look again shortly, so a refusal
        # recorded after the engine went idle schedules its retry (only while writes are pending).
        pending = PENDING_WRITES_POLL_S if self.kv.writes_pending() else None
        due = [d for d in (self.kv.tier.poll_due_in(), retry, pending) if d is not None]
        return min(due, default=None)

    def load_blocks(self, request: Any, block_ids: Sequence[int], block_hashes: Sequence[bytes]) -> int:
        loaded = self.kv.load(block_hashes, block_ids, self.k_caches, self.v_caches)
        self._mark_loaded(block_hashes[:loaded])
        return loaded

    def load_blocks_async(
        self, request: Any, block_ids: Sequence[int], block_hashes: Sequence[bytes]
    ) -> Future[int]:
        """``load_blocks`` on a loader thread, for a scheduler that parks the request meanwhile.

        The engine must neither compute on nor free ``block_ids`` until the future is done; then
        it registers ``block_hashes[:result]`` exactly as after ``load_blocks``.
        """
        hashes = list(block_hashes)
        return self.kv.load_async(
            hashes, block_ids, self.k_caches, self.v_caches, then=lambda n: self._mark_loaded(hashes[:n])
        )

    def _mark_loaded(self, hashes: Sequence[bytes]) -> None:
        with self._lock:
            if len(self._just_loaded) > MAX_UNREGISTERED_LOADS:
                # Entries linger only when the block manager skipped a loaded block (its hash was
                # already cached under another block id); forgetting them costs at most a rewrite.
                self._just_loaded.clear()
            self._just_loaded.update(hashes)

    def request_finished(self, request: Any) -> None:
        """A producer's final output waits (``kv_transfer_future``) until its prompt blocks were
        written, off the engine thread: its blocks' KV was snapshotted when they filled, so they
        are freed at once and the engine steps on meanwhile. An aborted producer reports nothing."""
        spec = request.kv_transfer
        if not spec or spec.get("role") != "producer" or request.finish_reason == "abort":
            return
        prompt_hashes = request.block_hashes[: request.num_prompt_tokens // self.block_size]
        with self._lock:
            if self._reporter is None:
                self._reporter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-producer")
            request.kv_transfer_future = self._reporter.submit(
                self._producer_report, request.request_id, prompt_hashes
            )

    def _producer_report(self, request_id: str, prompt_hashes: list[bytes]) -> dict[str, Any]:
        self.kv.flush(PRODUCER_FLUSH_TIMEOUT_S, hashes=prompt_hashes)
        # Confirm with the tier itself: a write may have been dropped (full queue, Redis down or
        # full), a block written earlier evicted since. What the consumer can read, which is
        # another process: a composite tier's local level also holds what Redis refused or lost.
        in_tier = self.kv.lookup_shared(prompt_hashes)
        if in_tier < len(prompt_hashes):
            # A tier that is down makes every producer request fall short: the breaker's own line
            # says why, these are kept to a rate (the chaos run logged 70 in 4 s per prefill worker).
            self._shortfall_log.warning(
                "request %s: %d of %d prompt blocks reached the tier; the consumer recomputes the rest",
                request_id,
                in_tier,
                len(prompt_hashes),
            )
        return {"tier_blocks": in_tier, "tier_write_complete": in_tier == len(prompt_hashes)}

    def close(self) -> None:
        with self._lock:
            reporter, self._reporter = self._reporter, None
        if reporter is not None:
            reporter.shutdown(wait=True)  # the reports still out, then the writes they wait for
        self.republisher.close()
        self.kv.close()

    # -- sleep mode and weight updates ---------------------------------------------------------------

    def bind_caches(self, kv_caches: Sequence[tuple[Any, ...]]) -> None:
        """Read and write these KV cache tensors (at start, and when sleep mode allocates them anew)."""
        self.k_caches = [raw(parts[0]) for parts in kv_caches]
        self.v_caches = [raw(parts[1]) for parts in kv_caches if len(parts) == 2]

    def release_caches(self) -> None:
        """Let go of the KV cache tensors, so sleep mode can free them (no request runs meanwhile)."""
        self.republisher.cancel("the KV cache is released (sleep mode)")
        self.k_caches, self.v_caches = [], []

    def set_fingerprint(self, fingerprint: str) -> None:
        """The weights changed: tier keys and event streams follow the new fingerprint."""
        self.republisher.cancel("the weights changed")
        self.kv.set_fingerprint(fingerprint)
        with self._lock:
            self._just_loaded.clear()

    # -- block manager listener --------------------------------------------------------------------

    def block_stored(
        self, block_id: int, block_hash: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...]
    ) -> None:
        with self._lock:
            from_tier = block_hash in self._just_loaded
            self._just_loaded.discard(block_hash)
        if not from_tier:
            self.kv.save(block_hash, block_id, self.k_caches, self.v_caches)
        if self.kv.events_enabled:
            self.kv.publish_event("stored", [block_hash], medium="device")

    def block_removed(self, block_id: int, block_hash: bytes) -> None:
        if self.kv.events_enabled:
            self.kv.publish_event("removed", [block_hash], medium="device")

    # -- introspection -----------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        return self.kv.flush(timeout)

    def stats(self) -> ConnectorStats:
        return self.kv.stats()
