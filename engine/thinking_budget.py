"""vLLM's ``thinking_token_budget``: a cap on the tokens a reasoning model spends thinking.

Counting starts after the reasoning start marker (``<think>``'s token ids): in the prompt when the
prompt left the model thinking (its last start marker not closed by an end marker after it; the
prompt's tokens after that marker count), or in the output when the model opens a thought itself.
Once a thought has ``budget`` tokens the end marker's token ids (``</think>``'s) are forced next, one
per position, and the answer goes on freely after them, as vLLM's thinking-budget state does. A
thought the model closes itself ends the count; a new one counts from zero.

``ThinkingTracker`` belongs to one request (``Request.thinking``). Its state follows the request's
own output list, whose tokens are final once appended (never taken back); the tokens after them
that a sampling row shows (a speculative step's drafts) are walked on a copy, so a rejected draft
never moves the state. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

# The markers reasoning models write around their thoughts (DeepSeek-R1, Qwen3, GLM-4.5, ...): the
# server's reasoning parsers split at them, and the engine encodes them for the budget.
THINK_START, THINK_END = "<think>", "</think>"

# (in_think, count, ending, tail): inside a thought, its tokens so far, the index in the end marker
# of the token forced next (-1: none), the last tokens seen (for markers of several tokens).
_State = tuple[bool, int, int, tuple[int, ...]]


def _rfind(ids: Sequence[int], marker: Sequence[int]) -> int:
    """The start of the last occurrence of ``marker`` in ``ids``, or -1."""
    n = len(marker)
    if n == 0:
        return -1
    first = marker[0]
    for i in range(len(ids) - n, -1, -1):
        if ids[i] == first and list(ids[i : i + n]) == list(marker):
            return i
    return -1


class ThinkingTracker:
    def __init__(
        self,
        budget: int,
        start_ids: Sequence[int],
        end_ids: Sequence[int],
        prompt_ids: Sequence[int],
        output_ids: list[int],
    ) -> None:
        if budget < 0:
            raise ValueError(f"thinking_token_budget must be a non-negative integer, got {budget}")
        if not start_ids or not end_ids:
            raise ValueError("thinking_token_budget needs the reasoning start and end markers' token ids")
        self.budget = budget
        self.start = tuple(start_ids)
        self.end = tuple(end_ids)
        self._width = max(len(self.start), len(self.end))
        self.output = output_ids  # the request's own list: appended to, never shortened
        last_start, last_end = _rfind(prompt_ids, self.start), _rfind(prompt_ids, self.end)
        in_think = last_start > last_end
        count = len(prompt_ids) - (last_start + len(self.start)) if in_think else 0
        self._state: _State = self._check(in_think, count, -1, tuple(prompt_ids[-self._width :]))
        self._seen = 0  # output tokens folded into ``_state``

    def _check(self, in_think: bool, count: int, ending: int, tail: tuple[int, ...]) -> _State:
        if in_think and count >= self.budget:
            return False, count, 0, tail  # the budget is spent: the end marker comes next
        return in_think, count, ending, tail

    def _step(self, state: _State, token: int) -> _State:
        in_think, count, ending, tail = state
        tail = (tail + (token,))[-self._width :]
        if ending >= 0:  # a forced end marker token (the only one the row could draw)
            ending += 1
            return (False, 0, -1 if ending == len(self.end) else ending, tail)
        if tail[-len(self.start) :] == self.start:
            return self._check(True, 0, -1, tail)
        if tail[-len(self.end) :] == self.end:
            return False, 0, -1, tail
        return self._check(in_think, count + 1 if in_think else 0, -1, tail)

    def forced_token(self, output_ids: Sequence[int]) -> int | None:
        """The token the next position must be, after ``output_ids`` (the request's output, maybe
        followed by drafts), or None when the model is free."""
        final = self.output
        while self._seen < len(final):
            self._state = self._step(self._state, final[self._seen])
            self._seen += 1
        state = self._state
        for token in output_ids[self._seen :]:
            state = self._step(state, token)
        ending = state[2]
        return self.end[ending] if ending >= 0 else None
