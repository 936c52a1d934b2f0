"""``LLMEngine``'s LoRA adapters: read and checked against the model (on any thread: it touches no
engine state), kept loaded in the engine's ``LoRACache`` by name, and unloaded. ``LLMEngine``
inherits ``LoRALoading``; the adapters' tensors and their device copies are ``engine/lora.py``,
and the names the async engine serves them by are ``engine/async_lora.py``.
"""

from __future__ import annotations

from pathlib import Path

from engine.lora import LoRAAdapter, load_adapter
from engine.lora_request import LoRARequest


class LoRALoading:
    """``LLMEngine``'s ``read_lora``, ``cached_lora``, ``load_lora`` and ``remove_lora``. Uses its
    ``loras`` (None: LoRA off), ``lora_layouts``, ``config`` and ``model_runner``."""

    def read_lora(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter (ValueError if it cannot run on this model); touches no engine
        state, so it may run on any thread."""
        if self.loras is None:
            raise ValueError("LoRA adapters are not enabled on this engine (start it with --enable-lora)")
        return load_adapter(
            request, self.lora_layouts, max_rank=self.config.max_lora_rank, dtype=self.model_runner.dtype
        )

    def cached_lora(self, request: LoRARequest) -> LoRAAdapter | None:
        """The loaded adapter for ``request``, if it is loaded from the same directory."""
        adapter = self.loras.get(request.lora_name) if self.loras is not None else None
        if adapter is not None and adapter.path == str(Path(request.lora_path).expanduser()):
            return adapter
        return None

    def load_lora(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> LoRAAdapter:
        """The adapter for ``request``: ``adapter`` (read elsewhere) if given, else the loaded one,
        else read now; kept loaded."""
        cached = self.cached_lora(request) if adapter is None else None
        if cached is not None:
            return cached
        adapter = adapter or self.read_lora(request)
        self.loras.put(adapter)  # type: ignore[union-attr]
        return adapter

    def remove_lora(self, name: str) -> bool:
        """Unload adapter ``name``; requests running with it keep it until they finish."""
        return self.loras is not None and self.loras.pop(name) is not None
