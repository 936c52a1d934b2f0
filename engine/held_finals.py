"""Finished requests whose final output waits for the KV connector's report: a PD producer's
prompt blocks are still being written to the tier when it finishes, and its answer must carry
what was written (``kv_transfer``). ``LLMEngine`` holds such outputs (``_held_finals``, filled by
its step) and inherits ``HeldFinals`` to release each once its report is in, and stepping even
asleep while any is held.
"""

from __future__ import annotations

import logging

from engine.outputs import RequestOutput
from engine.sequence import Request

logger = logging.getLogger(__name__)


class HeldFinals:
    """``LLMEngine``'s ``has_held_outputs`` and ``_release_finals``. Uses its ``_held_finals`` and
    ``post``."""

    @property
    def has_held_outputs(self) -> bool:
        """Finished requests whose final output waits for the KV connector (stepped even asleep)."""
        return bool(self._held_finals)

    def _release_finals(self) -> list[RequestOutput]:
        """The final outputs whose connector report (``kv_transfer_future``) came in."""
        outputs: list[RequestOutput] = []
        still: list[tuple[Request, RequestOutput]] = []
        for req, out in self._held_finals:
            future = req.kv_transfer_future
            assert future is not None
            if not future.done():
                still.append((req, out))
                continue
            try:
                req.kv_transfer_result = future.result()
            except Exception:  # the connector reports nothing: the consumer recomputes
                logger.exception("request %s: the KV connector's finish report failed", req.request_id)
            req.kv_transfer_future = None
            outputs.append(self.post.finalize(req, out))
        self._held_finals = still
        return outputs
