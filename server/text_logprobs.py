"""Which tokens' logprobs go with a streamed choice's content, when a shaper takes reasoning and
tool calls out of its text (``server/chat_shape.py``).

A chat chunk carries the logprobs of its own tokens, whatever their text became (vLLM's and this
server's chat stream). The Responses API promises more: an ``output_text`` part's logprobs are the
tokens of its text, in order, so their strings join to it; a tool call's markup and the reasoning
have none. The shaper holds text back (it may start ``<tool_call>`` or ``</think>``) and later sends
it as content or drops it as markup, so a content delta's tokens are not its chunk's: ``TextLogprobs``
follows every token's characters in the text fed to the shaper and, as the shaper decides them
(``ChoiceShaper.held``: the characters it still holds are the last ones fed), gives each token whose
characters the released content holds to that content, and drops the others.

The content a shaper releases is a run of the characters fed (text held back comes out whole, after
the markup it follows is dropped; whitespace alone between two calls is dropped, not carried past
the second), so each content piece is found in the characters it decided: from their end when it
is the delta's last and no call follows it (what came before it may be held markup, a ``<`` that
was the start of ``</think>``), else from their start when nothing came before it in its delta,
else at its first place after the previous piece and its own thought. That search assumes a marker
is a token of its own (special tokens, in the models that write them): a token that completes a
held marker and writes content and another call may have its content placed in that markup.

A token is given to content when any of its characters is content. So a token part content, part
not (a rare token across the two: ``</tool_call>ok``, or ``\n `` whose newline is one of those
dropped after ``</think>``) goes with the content, whole, and its string holds more than the
content's text: its logprob is what the model paid for that text, which content given no token would
lose, and a token's string is never cut (vLLM's chat chunks likewise carry every token of their
delta). Only then do a part's tokens not join to exactly its text. A token with no text (the first
bytes of a character) goes with the character that completes it.
"""

from __future__ import annotations

from collections import deque

from server.chat_protocol import TokenLogprob
from server.chat_shape import Step


class TextLogprobs:
    """One choice's tokens, given to the content pieces their text became (``step``)."""

    def __init__(self, skipped: str = "", held: int = 0) -> None:
        """``skipped``: text the shaper took in before (a resumed stream's), ``held`` of it held."""
        self.decided = len(skipped) - held  # characters before this are decided
        # The characters after it, in the pieces fed: joined only once some are decided (a long
        # call is held whole until its end).
        self.undecided = [skipped[self.decided :]]
        self.fed = len(skipped)
        # Tokens not yet given or dropped: (start, end) of their text among the characters fed.
        self.tokens: deque[tuple[int, int, list[TokenLogprob]]] = deque()

    def step(
        self, text: str, logprobs: list[TokenLogprob], steps: list[Step], held: int, final: bool
    ) -> list[list[TokenLogprob]]:
        """The logprobs of each of ``steps``' content (a chunk's ``Shaped.steps``), after the shaper
        took in ``text`` (the tokens of ``logprobs``, one token unless the stream could not split a
        delta) and holds back ``held`` characters (none once the answer is ``final``)."""
        start, end = self.fed, self.fed + len(text)
        self.fed = end
        self.undecided.append(text)
        self.tokens.append((start, end, logprobs))
        decided = end if final else max(self.decided, min(end, end - held))
        region = ""
        if decided > self.decided:
            undecided, cut = "".join(self.undecided), decided - self.decided
            region, self.undecided = undecided[:cut], [undecided[cut:]]
        spans = _spans(region, steps)
        out: list[list[TokenLogprob]] = [[] for _ in steps]
        while self.tokens:
            first, last, token_logprobs = self.tokens[0]
            if first >= decided:
                break
            # A token with no text goes with the character after it.
            lo, hi = first - self.decided, max(last, first + 1) - self.decided
            piece = next((i for i, (a, b) in enumerate(spans) if a < b and a < hi and lo < b), None)
            if piece is not None:
                out[piece] += token_logprobs
            elif last > decided:
                break  # part of it is still held: it may yet be content
            self.tokens.popleft()
        self.decided = decided
        return out


def _spans(region: str, steps: list[Step]) -> list[tuple[int, int]]:
    """Where each step's content lies in the characters decided (an empty span where it has none,
    or where it is not a run of them)."""
    spans = []
    cursor = 0
    for i, (thought, content, calls) in enumerate(steps):
        at = -1
        # The step's thought (a run of the characters fed) comes before its content.
        cursor += len(thought)
        if content:
            if i == len(steps) - 1 and not calls and region.endswith(content):
                at = len(region) - len(content)
            elif i == 0 and not thought and region.startswith(content):
                at = 0
            if at < cursor:
                at = region.find(content, cursor)
        if at < 0:
            spans.append((cursor, cursor))
            continue
        spans.append((at, at + len(content)))
        cursor = at + len(content)
    return spans
