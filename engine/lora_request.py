"""Which LoRA adapter a request runs with (torch-free: the server and the router use it too).

``LoRARequest(lora_name, lora_int_id, lora_path)`` is vLLM's spelling. The adapter's *name* is its
identity across the deployment: it salts the request's KV block hashes (``kvcache.keys.lora_extra``),
so replicas and routers key an adapter's blocks alike, and it is the ``model`` clients send.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.keys import lora_extra

# In a load's error when the path holds no adapter at all: vLLM's wording, which its server (and so
# ferry's, whose engine's errors reach it as their messages) answers with 404 rather than 400.
NO_ADAPTER = "No adapter found"


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty string")


@dataclass(frozen=True)
class ServedLoRA:
    """An adapter a replica serves under its name (``AsyncEngine.add_lora``): the request that loaded
    it and the digest of its files, which salts its blocks' hashes with the name."""

    request: LoRARequest
    weights_id: str

    @property
    def name(self) -> str:
        return self.request.lora_name

    @property
    def block_extra(self) -> bytes:
        return lora_extra(self.request.lora_name, self.weights_id)
