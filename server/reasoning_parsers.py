"""Reasoning parsers: a reasoning model's thinking, split from its answer (``reasoning_content``).

Reasoning models write their chain of thought between ``<think>`` and ``</think>`` before the
answer. With ``--reasoning-parser NAME`` (vLLM's flag and names) a chat answer carries the
thinking in ``message.reasoning_content`` (``delta.reasoning_content`` when streamed) and only the
rest in ``content``, where a tool-call parser then looks for calls:

* ``deepseek_r1`` (DeepSeek-R1 and its distills): the chat template opens ``<think>`` in the
  prompt, so the answer starts inside the thinking (a ``<think>`` the model writes anyway is
  dropped); everything up to ``</think>`` is reasoning, and an answer that never closes it is all
  reasoning.
* ``qwen3`` (Qwen3, QwQ): thinking only when the answer opens with ``<think>`` (up to ``</think>``,
  or to the end if never closed); an answer that does not is all content (thinking switched off).
  ``glm45`` (GLM-4.5/4.6) is the same.
* ``deepseek_v3`` (DeepSeek-V3.1, whose template thinks when ``chat_template_kwargs`` sets
  ``thinking``): the rendered prompt decides. One that ends with ``<think>`` opened the thinking and
  the answer is read as ``deepseek_r1`` reads it; any other (V3.1's non-thinking prompt ends with
  ``</think>``) gets an answer that is all content unless it opens with ``<think>`` itself.

Like the tool streamers, a splitter's result does not depend on how the text was cut into deltas,
so a resumed stream rebuilds it from the text already sent.
"""

from __future__ import annotations

from typing import ClassVar

from server.tool_parser_base import held_prefix

START, END = "<think>", "</think>"


class ReasoningSplitter:
    """One choice's text deltas in, (reasoning, content) deltas out."""

    # Thinking only when the answer opens with <think> (else it is all content).
    requires_start: ClassVar[bool] = False
    # requires_start is read off each request's prompt (``prompt_opens_thinking``).
    prompt_decides: ClassVar[bool] = False

    def __init__(self, requires_start: bool | None = None) -> None:
        if requires_start is not None:
            self.requires_start = requires_start
        self.pending = ""  # held back: the opening, or what may be the start of </think>
        self.thinking = True
        self.started = False  # the opening (leading whitespace, optional <think>) is decided
        self.trim = False  # after </think>: drop the newlines that separate it from the answer

    def feed(self, text: str) -> tuple[str, str]:
        if not self.thinking:
            return "", self._content(text)
        self.pending += text
        if not self.started:
            head = self.pending.lstrip()
            if START.startswith(head):  # "" or part of <think>: not decided yet
                return "", ""
            self.started = True
            if head.startswith(START):
                self.pending = head[len(START) :].lstrip("\n")
            elif self.requires_start:
                content, self.pending, self.thinking = self.pending, "", False
                return "", content
        at = self.pending.find(END)
        if at >= 0:
            reasoning, rest = self.pending[:at], self.pending[at + len(END) :]
            self.pending, self.thinking, self.trim = "", False, True
            return reasoning, self._content(rest)
        cut = len(self.pending) - held_prefix(self.pending, END)
        reasoning, self.pending = self.pending[:cut], self.pending[cut:]
        return reasoning, ""

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

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole answer."""
        reasoning, content = self.feed(text)
        more_r, more_c = self.finish()
        return (reasoning + more_r) or None, content + more_c


class DeepSeekR1Splitter(ReasoningSplitter):
    requires_start = False


class Qwen3Splitter(ReasoningSplitter):
    requires_start = True


class DeepSeekV3Splitter(ReasoningSplitter):
    requires_start = True
    prompt_decides = True


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt (its last few tokens' text, special tokens kept) leaves the model inside its
    thinking."""
    return prompt_tail.rstrip().endswith(START)


REASONING_PARSERS: dict[str, type[ReasoningSplitter]] = {
    "deepseek_r1": DeepSeekR1Splitter,
    "qwen3": Qwen3Splitter,
    "glm45": Qwen3Splitter,
    "deepseek_v3": DeepSeekV3Splitter,
}


def reasoning_splitter(name: str) -> ReasoningSplitter:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}"
        ) from None
