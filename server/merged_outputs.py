"""``MergedOutputs.merged``: the outputs of a request's sequences as they come (n > 1, several
prompts, beam search), each sequence (or each prompt's beam search) run on its own and one
failure ending all.

``Generation`` (``server/generation.py``) is built on it; split from there so that the door into
the engine (admission, one sequence's stream) reads on its own, and the fan-out of a request over
its sequences here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from engine.outputs import RequestOutput
from server.admission_ticket import Ticket
from server.beam_search import run_beam_search
from server.sequence_request import SequenceRequest

if TYPE_CHECKING:
    from server.generation import Generation


class MergedOutputs:
    """The fan-out of ``Generation`` (its ``stream`` runs one sequence)."""

    stream: Callable[[str, SequenceRequest, float, Ticket], AsyncIterator[RequestOutput]]

    async def merged(
        self, request_id: str, seqs: Sequence[SequenceRequest], arrival: float, ticket: Ticket
    ) -> AsyncIterator[tuple[SequenceRequest, RequestOutput]]:
        """Outputs of several sequences as they come (n > 1, several prompts); one failure ends all.
        Beam search choices come as each prompt's search ends, all its choices at once."""
        if len(seqs) == 1 and seqs[0].beam is None:
            # The usual request (one prompt, one choice): its stream directly, one generator layer
            # fewer per token than through ``_units``' pairing.
            seq = seqs[0]
            async with contextlib.aclosing(self.stream(request_id, seq, arrival, ticket)) as outs:
                async for out in outs:
                    yield seq, out
            return
        units = _units(self, request_id, seqs, arrival, ticket)
        if len(units) == 1:
            async with contextlib.aclosing(units[0]) as unit:
                async for item in unit:
                    yield item
            return
        queue: asyncio.Queue[tuple[SequenceRequest, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(unit: AsyncIterator[tuple[SequenceRequest, RequestOutput]]) -> None:
            try:
                async for item in unit:
                    queue.put_nowait(item)
                queue.put_nowait(None)
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # handed to the consumer, which re-raises it
                queue.put_nowait(e)

        tasks = [asyncio.ensure_future(pump(unit)) for unit in units]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _units(
    generation: Generation, request_id: str, seqs: Sequence[SequenceRequest], arrival: float, ticket: Ticket
) -> list[AsyncIterator[tuple[SequenceRequest, RequestOutput]]]:
    """What runs on its own: each sequence, or each prompt's beam search (all its choices)."""
    if seqs and seqs[0].beam is not None:
        groups: dict[int, list[SequenceRequest]] = {}
        for seq in seqs:
            groups.setdefault(seq.prompt_index, []).append(seq)
        return [run_beam_search(generation, request_id, group, arrival, ticket) for group in groups.values()]
    return [_paired(seq, generation.stream(request_id, seq, arrival, ticket)) for seq in seqs]


async def _paired(
    seq: SequenceRequest, outs: AsyncIterator[RequestOutput]
) -> AsyncIterator[tuple[SequenceRequest, RequestOutput]]:
    async with contextlib.aclosing(outs):  # type: ignore[type-var]
        async for out in outs:
            yield seq, out
