"""The reasoning formats that add something to ``<think>`` … ``</think>``: an answer wrapped in its own
markers (ERNIE-4.5's ``<response>``, Hunyuan-A13B's ``<answer>``), a newline before ``</think>`` that
is not the thought's (Step-3.5), or a thought that a tool-call section ends (Kimi-K2). Registered in
``server/reasoning_parsers.py``, which lists every format.
"""

from __future__ import annotations

from typing import ClassVar

from server.reasoning_base import END, ReasoningSplitter
from server.tool_parser_base import held_prefix


class WrappedAnswerSplitter(ReasoningSplitter):
    """A splitter whose answer comes wrapped: one of ``OPENS`` at the start of the content and each
    of ``CLOSES`` in it are markers, never shown (the newlines after a close neither); an answer
    written without them is content as it is."""

    OPENS: ClassVar[tuple[str, ...]]  # longest first: the first one the answer starts with is dropped
    CLOSES: ClassVar[tuple[str, ...]]

    def __init__(self, requires_start: bool | None = None) -> None:
        super().__init__(requires_start)
        self.answer = ""  # content held back: the opening marker, or what may start a close
        self.opened = False  # the answer's opening is decided
        self.closed = False  # after a close: drop the newlines that follow it

    @property
    def held(self) -> int:
        return super().held + len(self.answer)

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = super().feed(text)
        return reasoning, self._unwrap(content)

    def finish(self) -> tuple[str, str]:
        reasoning, content = super().finish()
        text, self.answer = self.answer + content, ""
        if not self.opened:
            opening = next((o for o in self.OPENS if text.startswith(o)), "")
            text, self.opened = text[len(opening) :], True
        return reasoning, text.lstrip("\n") if self.closed else text

    def _unwrap(self, text: str) -> str:
        text, self.answer = self.answer + text, ""
        if not self.opened:
            opening = next((o for o in self.OPENS if text.startswith(o)), None)
            # A marker's prefix, or a marker that a longer one (its newline) may still extend.
            if any(o.startswith(text) and o != text for o in self.OPENS):
                self.answer = text
                return ""
            self.opened = True
            if opening is not None:
                text = text[len(opening) :]
        out = []
        while True:
            if self.closed:
                text = text.lstrip("\n")
                if not text:
                    break
                self.closed = False
            ends = [(at, end) for end in self.CLOSES if (at := text.find(end)) >= 0]
            if not ends:
                cut = len(text) - max(held_prefix(text, end) for end in self.CLOSES)
                out.append(text[:cut])
                self.answer = text[cut:]
                break
            at, end = min(ends)
            out.append(text[:at])
            text, self.closed = text[at + len(end) :], True
        return "".join(out)


class Ernie45Splitter(WrappedAnswerSplitter):
    """ERNIE-4.5 thinking models: ``deepseek_r1``'s split, the answer maybe inside ``<response>`` …
    ``</response>``."""

    OPENS, CLOSES = ("<response>",), ("</response>",)


class HunyuanA13BSplitter(WrappedAnswerSplitter):
    """Hunyuan-A13B: ``<think>\\n`` … ``\\n</think>\\n``, then the answer in ``<answer>\\n`` …
    ``\\n</answer>``; thinking only when the answer opens with ``<think>`` (its fast mode writes an
    empty one, or none). The markers are plain text."""

    requires_start = True
    think_markers = False
    marker_tokens = False
    ENDS = (END, "\n" + END)  # the first for the engine (it ends the thinking); the newline not shown
    OPENS, CLOSES = ("<answer>\n", "<answer>"), ("\n</answer>", "</answer>")


class Step3p5Splitter(ReasoningSplitter):
    """Step-3.5: ``deepseek_r1``'s split, without the newline Step-3.5 writes before ``</think>``."""

    ENDS = (END, "\n" + END)


class KimiK2Splitter(ReasoningSplitter):
    """Kimi-K2 (Thinking, K2.5): thinking from the start, as ``deepseek_r1``'s (a ``<think>`` the model
    writes is dropped), up to ``</think>`` or to a tool-call section, which ends the thought and stays
    in the content for the ``kimi_k2`` tool parser. A prompt that closed the thinking (K2.5's
    template with ``chat_template_kwargs: {"thinking": false}`` ends with ``<think></think>``) leaves
    the answer all content unless it opens a ``<think>`` itself."""

    prompt_decides = True
    TOOLS = "<|tool_calls_section_begin|>"
    ENDS = (END, TOOLS)
    KEPT_ENDS = (TOOLS,)

    @classmethod
    def requires_start_after(cls, prompt_tail: str) -> bool:
        return prompt_tail.rstrip().endswith(END)
