"""A request's place in its structured-outputs grammar, and the per-step token mask of a batch.

The engine thread fills every constrained row's token mask each step (xgrammar's
``fill_next_token_bitmask``) and advances each matcher by the sampled token, so what one request's
grammar costs a token, every request in the batch waits. ``engine/grammar_limits.py`` refuses the
constraints known to be costly before they compile; what no static check can tell (an EBNF
grammar is the client's own parser: ``root ::= ([^x]{0,10}){0,100}`` is cheap to compile and
took 150 ms a token with the tests' 1000-token vocabulary) is caught here, as it runs:
``BudgetedGrammar`` charges each token the CPU time its mask fill and advance took on the engine
thread, and once the mean over its last ``BUDGET_WINDOW`` tokens, the costliest left out, is past
the engine's ``structured_outputs_mask_budget_ms`` (or one token alone cost ``BUDGET_WINDOW`` times
the budget: the engine does not wait for more of those), it says so (``error``), and the request is
ended (``finish_reason="abort"`` with that error; the server answers it as a 400, or an error event
in a stream already started). The others in the batch lose nothing: their masks, draws and
tokens are their own.

Why CPU time of the engine thread (``time.thread_time``), not wall-clock time: xgrammar's fill runs
on the calling thread and releases the GIL, so on a loaded machine its wall-clock time also counts
the time the OS gave other processes and the wait to take the GIL back from another thread
(5 ms switch interval per fill, under a busy event loop); a grammar is charged only for what it
burns. Why a window with the costliest token left out: one slow token (a first fill's cold
caches, a page fault) must not end a request; a cost that persists over tokens does.

A grammar may also reach a state that allows no token at all (a constraint with a branch that
matches nothing further: ``b|a[^\\s\\S]`` after "a"); the sampler then draws from an empty mask, the
grammar refuses that token, and ``RequestGrammar.dead_end`` tells it from a token drawn wrongly: the
request is ended the same way, its ``error`` naming the dead end (code
``structured_outputs_dead_end``: ``error_code``).

Never compiles anything; never imported by the router.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from engine.grammar_errors import DEAD_END

# Tokens a request's grammar cost is averaged over, the costliest of them left out; its first
# tokens are judged only one at a time (against BUDGET_WINDOW times the budget).
BUDGET_WINDOW = 8


class RequestGrammar:
    """One sequence's position in its grammar. With ``waiting_for`` set the grammar has not
    started: every token is allowed and taken until that one (a reasoning model's end of
    thinking) has been generated."""

    __slots__ = ("_matcher", "stop_token_ids", "waiting_for", "vocab_size", "_error")

    def __init__(
        self, matcher: Any, stop_token_ids: list[int], waiting_for: int | None = None, *, vocab_size: int
    ) -> None:
        self._matcher = matcher
        self.stop_token_ids = stop_token_ids
        self.waiting_for = waiting_for
        self.vocab_size = vocab_size
        self._error: str | None = None

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) when the grammar does not allow it."""
        if self.waiting_for is not None:
            if token_id == self.waiting_for:
                self.waiting_for = None
            return True
        return bool(self._matcher.accept_token(int(token_id)))

    @property
    def active(self) -> bool:
        """The grammar decides the next token (it has started and is not finished)."""
        return self.waiting_for is None and not self._matcher.is_terminated()

    @property
    def terminated(self) -> bool:
        """A stop token was accepted after a complete sentence: the output is finished."""
        return self.waiting_for is None and bool(self._matcher.is_terminated())

    @property
    def error(self) -> str | None:
        """Why the request must end though it is not finished (a dead end, its cost), or None."""
        return self._error

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def dead_end(self, num_tokens: int, text: str) -> bool:
        """After ``accept`` refused a token: True, with ``error`` set, when the grammar allows no
        token at all where it is (the mask the token was drawn under was empty, so any token was
        refused): a constraint whose every sentence starting with the ``num_tokens`` tokens
        generated, ``text``, needs what the model cannot write (``a[^\\s\\S]``, a rule with no way
        to end, text its vocabulary cannot spell). False when the
        mask allowed some token and another one came (a bug: a NaN row). Fills a mask of its own,
        only on this path: the per-token fill stays as it is."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self._matcher.fill_next_token_bitmask(bitmask)
        if bool(bitmask.any()):
            return False
        tail = text if len(text) <= 40 else "…" + text[-40:]
        self._error = (
            f"{DEAD_END} after the {num_tokens} token(s) generated ({tail!r}): no token this model "
            "has can follow them, so no output that starts this way can satisfy the constraint. A "
            "part of it matches no text this model can write (an empty character class such as "
            "[^\\s\\S], a rule with no way to end): remove that part."
        )
        return True


class BudgetedGrammar(RequestGrammar):
    """A ``RequestGrammar`` that charges each token the engine thread's CPU time of its mask fill
    and advance, and sets ``error`` once the mean over the last ``BUDGET_WINDOW`` tokens (the
    costliest left out) is past ``budget_ms``, or one token cost ``BUDGET_WINDOW`` times that
    (module docstring)."""

    __slots__ = ("_budget_s", "_costs", "_next", "_spent")

    def __init__(
        self,
        matcher: Any,
        stop_token_ids: list[int],
        waiting_for: int | None,
        budget_ms: float,
        *,
        vocab_size: int,
    ) -> None:
        super().__init__(matcher, stop_token_ids, waiting_for, vocab_size=vocab_size)
        self._budget_s = budget_ms / 1000
        self._costs: list[float] = []  # the last BUDGET_WINDOW tokens' seconds, a ring
        self._next = 0
        self._spent = 0.0  # this token's so far (its fill)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        start = time.thread_time()
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self._spent += time.thread_time() - start

    def accept(self, token_id: int) -> bool:
        if self.waiting_for is not None:
            return super().accept(token_id)
        start = time.thread_time()
        accepted = bool(self._matcher.accept_token(int(token_id)))
        self._charge(self._spent + time.thread_time() - start)
        self._spent = 0.0
        return accepted

    def _charge(self, seconds: float) -> None:
        if seconds > self._budget_s * BUDGET_WINDOW:  # a whole window's budget in one token
            self._end(seconds, "its last token")
            return
        costs = self._costs
        if len(costs) < BUDGET_WINDOW:
            costs.append(seconds)
            if len(costs) < BUDGET_WINDOW:
                return
        else:
            costs[self._next] = seconds
            self._next = (self._next + 1) % BUDGET_WINDOW
        mean = (sum(costs) - max(costs)) / (BUDGET_WINDOW - 1)
        if mean > self._budget_s:
            self._end(mean, f"mean of its last {BUDGET_WINDOW} tokens")

    def _end(self, seconds: float, measured: str) -> None:
        if self._error is not None:
            return
        self._error = (
            f"The structured outputs constraint was ended: enforcing it cost {seconds * 1000:.1f} ms "
            f"of the engine's time a token ({measured}), above the {self._budget_s * 1000:g} ms a "
            "token this server allows (--structured-outputs-mask-budget-ms), which would slow every "
            "other request. Write a grammar that matches each text in one way only (no ambiguous "
            "alternatives or nested repetitions), or bound the length with max_tokens instead of "
            "counted repetitions."
        )


# Bit j of a bitmask word, as int32 (bit 31 is the sign bit).
_BITS = torch.tensor([1 << j if j < 31 else -(1 << 31) for j in range(32)], dtype=torch.int32)


def mask_to_grammars(
    logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]
) -> tuple[torch.Tensor, list[int]]:
    """A copy of ``logits`` in which every token a row's grammar does not allow next is -inf, and
    the rows concerned. ``logits`` is ``[rows, vocab]`` (the tokenizer's vocabulary, no padding)
    and is left as it is.

    On CPU the bitmask is expanded with torch (one ``&`` and a ``where``, multithreaded): measured
    6x faster than xgrammar's own CPU kernel for 32 rows x 32k tokens (0.67 vs 4.2 ms). Elsewhere
    xgrammar's kernel runs.
    """
    import xgrammar as xgr

    rows = [i for i, g in enumerate(grammars) if g is not None and g.active]
    if not rows:
        return logits, []
    num_rows, vocab = logits.shape
    bitmask = xgr.allocate_token_bitmask(num_rows, vocab)
    for i in rows:
        grammars[i].fill(bitmask, i)  # type: ignore[union-attr]
    if logits.device.type != "cpu":
        out = logits.clone()
        xgr.apply_token_bitmask_inplace(out, bitmask.to(logits.device), indices=rows)
        return out, rows
    everyone = len(rows) == num_rows
    words = bitmask if everyone else bitmask[rows]
    allowed = (words.unsqueeze(-1) & _BITS).ne(0).view(len(rows), -1)[:, :vocab]
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype)
    if everyone:
        return torch.where(allowed, logits, neg_inf), rows
    out = logits.clone()
    idx = torch.tensor(rows, dtype=torch.long)
    out[idx] = torch.where(allowed, logits[idx], neg_inf)
    return out, rows
