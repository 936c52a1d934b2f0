"""Torch-free errors of the engine that cross into the server (and across processes)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop stopped (crash or shutdown); the request cannot complete."""


class SleepCancelledError(RuntimeError):
    """A ``sleep`` still waiting for running requests to end (``mode="wait"``) was cancelled by a
    ``wake_up`` sent after it: the later call wins, and the engine stays awake."""
