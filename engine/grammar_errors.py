"""The errors a request's structured-outputs grammar ends it with, and their API codes: torch-free,
as the API server processes (``--api-server-count``), which never load torch, read them."""

from __future__ import annotations

# The start of the error a request gets when its grammar reached a state that allows no token at
# all (``RequestGrammar.dead_end``); the server tells it from the cost error by it (``error_code``).
DEAD_END = "The structured outputs constraint admits no continuation"


def error_code(error: str) -> str:
    """The API error code of a grammar's ``error``: a dead end, or a grammar past its cost budget."""
    return "structured_outputs_dead_end" if error.startswith(DEAD_END) else "structured_outputs_too_costly"
