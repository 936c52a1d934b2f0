"""The LoRA adapters an ``AsyncEngine`` serves by name (``AsyncEngine`` inherits ``LoRAServing``).

``add_lora`` / ``remove_lora`` (vLLM's) change ``served_loras``, what the server resolves a
request's ``model`` against; ``load_lora`` has a request's adapter loaded before the request is
submitted. An adapter's files are read and checked in a worker thread (``LLMEngine.read_lora``), so
neither the API's event loop nor the engine loop waits on the disk; changes to one name take turns
(``_lora_change``). Requests already running with an adapter keep it until they finish: nothing
here ever aborts or holds a request.

A request's read of an adapter does not take turns with the changes (a reload does not wait for
reads): each name's changes that unload or replace its adapter are counted (``_lora_generations``),
and a read that a change overlapped is not kept (see ``load_lora``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from engine.keyed_locks import KeyedLocks
from engine.lora_request import LoRARequest, ServedLoRA

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


class LoRAServing:
    """``AsyncEngine``'s adapter serving. Uses its ``engine`` and the ``served_loras`` and
    ``_lora_locks`` its ``__init__`` sets."""

    engine: LLMEngine
    served_loras: dict[str, ServedLoRA]
    _lora_locks: KeyedLocks
    _lora_generations: dict[str, int]

    async def load_lora(self, lora_request: LoRARequest) -> ServedLoRA:
        """Have the adapter loaded (ValueError if it cannot run on this model): its files are read
        and checked in a worker thread, unless it is loaded from that directory already."""
        engine, name = self.engine, lora_request.lora_name
        while (adapter := engine.cached_lora(lora_request)) is None:
            generation = self._lora_generations.get(name, 0)
            read = await asyncio.to_thread(engine.read_lora, lora_request)
            if self._lora_generations.get(name, 0) == generation:
                # Loaded meanwhile (an ``add_lora`` of a new name): that one is kept.
                adapter = engine.cached_lora(lora_request) or engine.load_lora(lora_request, read)
                break
            # Removed or reloaded during the read: the files may have changed after it began, so
            # what it read must not be kept (a reload's adapter would be undone; after a removal, a
            # later ``add_lora`` would serve it). Next: a reload's adapter, or the files read again.
        return ServedLoRA(lora_request, adapter.weights_id)

    async def add_lora(self, lora_request: LoRARequest, reload: bool = False) -> ServedLoRA | None:
        """Serve an adapter under its name (vLLM's ``add_lora``): loaded now, listed in ``served_loras``.
        None (nothing read) if the name is served already: ``reload`` replaces it, reading its files
        again even from the same directory (new weights); until then, requests naming it run the
        previous ones. Changes to one name take turns (``_lora_change``)."""
        name = lora_request.lora_name
        async with self._lora_change(name):
            if name in self.served_loras and not reload:
                return None
            if reload:
                engine = self.engine
                adapter = engine.load_lora(
                    lora_request, await asyncio.to_thread(engine.read_lora, lora_request)
                )
                self._changed(name)
                served = ServedLoRA(lora_request, adapter.weights_id)
            else:
                served = await self.load_lora(lora_request)
            self.served_loras[name] = served
            return served

    async def remove_lora(self, lora_name: str) -> bool:
        """Stop serving an adapter (False if it was not served). Requests running with it finish
        with it; its weights go when they do."""
        async with self._lora_change(lora_name):
            self.engine.remove_lora(lora_name)
            self._changed(lora_name)
            return self.served_loras.pop(lora_name, None) is not None

    def _changed(self, name: str) -> None:
        """Adapter ``name`` was unloaded or replaced: a read of it in flight is not kept."""
        self._lora_generations[name] = self._lora_generations.get(name, 0) + 1

    @contextlib.asynccontextmanager
    async def _lora_change(self, name: str) -> AsyncIterator[None]:
        """One change of adapter ``name`` at a time, in the order they came: a load's files are read
        in a worker thread, and two overlapping changes of one name would otherwise leave
        ``served_loras`` and the loaded adapter in either order (and both of two loads of a new name
        would find it free)."""
        async with self._lora_locks.hold(name):
            yield
