"""What an embedding's consumer does to the engine's pooled hidden state: keep the first
``dimensions`` values (Matryoshka models) and L2-normalise, vectorised in float64 (the server runs
this on its event loop for up to 2,048 inputs at a time)."""

from __future__ import annotations

import torch


def normalized(vector: list[float], dimensions: int | None = None) -> torch.Tensor:
    """float64 ``vector[:dimensions]`` divided by its L2 norm (a zero vector stays zero)."""
    v = torch.tensor(vector[:dimensions] if dimensions is not None else vector, dtype=torch.float64)
    norm = v.norm()
    return v / norm if norm > 0 else v


def as_float32_le(v: torch.Tensor) -> bytes:
    """Little-endian float32 bytes, the layout OpenAI's base64 embeddings decode from."""
    return v.numpy().astype("<f4").tobytes()
