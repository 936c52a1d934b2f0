"""Torch-free errors of the engine that cross into the server (and across processes)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop stopped (crash or shutdown); the request cannot complete."""
