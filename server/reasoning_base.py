"""The reasoning splitter every ``--reasoning-parser`` is built from (``ReasoningSplitter``): one
choice's text in, its thinking and its answer out, between each format's own markers. The formats and
their registry are in ``server/reasoning_parsers.py`` (and ``server/reasoning_formats.py``).

A splitter's result never depends on how the text was cut into deltas: what may still be the start of
a marker is held back until it is decided.
"""

from __future__ import annotations

from typing import ClassVar

from server.tool_parser_base import held_prefix

START, END = "<think>", "</think>"


class ReasoningSplitter:
    """One choice's text deltas in, (reasoning, content) deltas out."""

    # Thinking only when the answer opens with <think> (else it is all content).
    requires_start: ClassVar[bool] = False
    # requires_start is read off each request's prompt (``requires_start_after``).
    prompt_decides: ClassVar[bool] = False
    # Its markers are special tokens (dropped from text unless requests keep them).
    needs_special_tokens: ClassVar[bool] = False
    # The thinking sits between <think> and </think> (what ``thinking_token_budget`` counts and forces).
    think_markers: ClassVar[bool] = True
    # What opens the thinking (any of them), and what ends it.
    STARTS: ClassVar[tuple[str, ...]] = (START,)
    ENDS: ClassVar[tuple[str, ...]] = (END,)
    # Ends that are the answer's first text, not a marker: they stay in the content (Kimi-K2 ends its
    # thinking by opening a tool-call section, which the tool parser then reads).
    KEPT_ENDS: ClassVar[tuple[str, ...]] = ()
    # The markers are tokens: ``reasoning_tokens`` counts the tokens between them (else 0, as vLLM's
    # parsers without them count).
    marker_tokens: ClassVar[bool] = True

    def __init__(self, requires_start: bool | None = None) -> None:
        if requires_start is not None:
            self.requires_start = requires_start
        self.pending = ""  # held back: the opening, or what may be the start of </think>
        self.thinking = True
        self.started = False  # the opening (leading whitespace, optional <think>) is decided
        self.trim = False  # after </think>: drop the newlines that separate it from the answer
        self.lead = False  # after the opening <think>: drop the newlines that follow it

    @property
    def held(self) -> int:
        """How many of the last characters fed are held back (the opening, or what may start
        ``</think>`` or a harmony marker): the rest are decided."""
        return len(self.pending)

    def feed(self, text: str) -> tuple[str, str]:
        if not self.thinking:
            return "", self._content(text)
        self.pending += text
        if not self.started:
            head = self.pending.lstrip()
            opened = next((s for s in self.STARTS if head.startswith(s)), None)
            if opened is None and any(s.startswith(head) for s in self.STARTS):
                return "", ""  # "" or part of an opening marker: not decided yet
            self.started = True
            if opened is not None:
                self.pending, self.lead = head[len(opened) :], True
            elif self.requires_start:
                content, self.pending, self.thinking = self.pending, "", False
                return "", content
        if self.lead:  # the newlines after the opening marker, however they come
            self.pending = self.pending.lstrip("\n")
            self.lead = not self.pending
        ends = [(at, end) for end in self.ENDS if (at := self.pending.find(end)) >= 0]
        if ends:
            at, end = min(ends)
            kept = end in self.KEPT_ENDS
            reasoning, rest = self.pending[:at], self.pending[at if kept else at + len(end) :]
            self.pending, self.thinking, self.trim = "", False, not kept
            return reasoning, self._content(rest)
        cut = len(self.pending) - max(held_prefix(self.pending, end) for end in self.ENDS)
        reasoning, self.pending = self.pending[:cut], self.pending[cut:]
        return reasoning, ""

    def pieces(self, text: str) -> list[tuple[str, str]]:
        """``feed``'s (reasoning, content) as the pieces written, each piece's reasoning before its
        content: more than one where reasoning follows content in ``text`` (only harmony's channels
        can, so here it is ``feed``'s result)."""
        return [self.feed(text)]

    def _content(self, text: str) -> str:
        if self.trim:
            text = text.lstrip("\n")
            self.trim = not text
        return text

    def finish(self) -> tuple[str, str]:
        """What is held at the end: an unclosed thinking is reasoning; an undecided opening (only
        whitespace or part of <think>) is content."""
        text, self.pending = self.pending, ""
        if not self.thinking:
            return "", ""
        if not self.started and not self.requires_start and text.strip():
            return text, ""
        if not self.started:
            return "", text
        return text, ""

    @classmethod
    def requires_start_after(cls, prompt_tail: str) -> bool:
        """``requires_start`` for a ``prompt_decides`` parser, from the prompt's last few tokens' text
        (special tokens kept): thinking only after an opening marker, unless the prompt opened it."""
        return not prompt_opens_thinking(prompt_tail)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole answer."""
        reasoning, content = self.feed(text)
        more_r, more_c = self.finish()
        return (reasoning + more_r) or None, content + more_c


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt (its last few tokens' text, special tokens kept) leaves the model inside its
    thinking."""
    return prompt_tail.rstrip().endswith(START)
