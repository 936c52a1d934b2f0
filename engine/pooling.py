"""What an embedding's consumer does to the engine's pooled hidden state: keep the first
``dimensions`` values (Matryoshka models) and L2-normalise, vectorised in float64 (the server runs
this on its event loop for up to 2,048 inputs at a time); and a classifier's consumer to its logits
(``activate``: the activation ``engine/classifier.py`` names). numpy, not torch: API server processes
(``--api-server-count``) import this and never load torch."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def truncated(vector: list[float], dimensions: int | None = None) -> np.ndarray:
    """float64 ``vector[:dimensions]``, not normalised (a request that asked for the raw state)."""
    return np.asarray(vector[:dimensions] if dimensions is not None else vector, dtype=np.float64)


def normalized(vector: list[float], dimensions: int | None = None) -> np.ndarray:
    """float64 ``vector[:dimensions]`` divided by its L2 norm (a zero vector stays zero)."""
    v = truncated(vector, dimensions)
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 else v


def as_float32_le(v: np.ndarray) -> bytes:
    """Little-endian float32 bytes, the layout OpenAI's base64 embeddings decode from."""
    return np.asarray(v).astype("<f4").tobytes()


def float32_values(v: np.ndarray) -> list[float]:
    """``v`` rounded to float32, as Python floats: exactly what ``as_float32_le`` encodes."""
    return np.asarray(v).astype(np.float32).tolist()


def activate(logits: Sequence[float] | np.ndarray, kind: str) -> np.ndarray:
    """float64 ``kind`` of ``logits`` over its last axis (softmax max-shifted; the sigmoid as
    ``(1 + tanh(x / 2)) / 2``, which never overflows)."""
    x = np.asarray(logits, dtype=np.float64)
    if kind == "softmax":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    if kind == "sigmoid":
        return 0.5 * (1.0 + np.tanh(0.5 * x))
    return x
