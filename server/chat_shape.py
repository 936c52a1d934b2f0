"""What a chat client sees of a choice's generated text: reasoning (``--reasoning-parser``), then
content, with tool calls taken out of it (``server/tools.py``). Whole answers and streams go
through the same steps in the same order, so they agree."""

from __future__ import annotations

from dataclasses import dataclass, field

from server.chat_protocol import DeltaToolCall, ToolCall
from server.reasoning_parsers import ReasoningSplitter
from server.tools import ChoiceTools, ToolPlan

Piece = tuple[str, list[DeltaToolCall]]  # content, then the calls that follow it
Step = tuple[str, str, list[DeltaToolCall]]  # reasoning, then content, then the calls that follow it


@dataclass
class Shaped:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)
    # The delta in the order written when text follows a call in it, or reasoning follows content
    # (harmony's channels; several tokens at once): ``reasoning``, ``content`` and ``tool_calls``
    # are its steps joined. Empty when it is one step.
    order: list[Step] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    @classmethod
    def of(cls, reasoning: str, pieces: list[Piece]) -> Shaped:
        """Reasoning, then ``pieces``."""
        return cls.of_steps([(reasoning, *pieces[0]), *(("", *piece) for piece in pieces[1:])])

    @classmethod
    def of_steps(cls, steps: list[Step]) -> Shaped:
        reasoning = "".join(thought for thought, _, _ in steps)
        content = "".join(text for _, text, _ in steps)
        calls = [call for _, _, calls in steps for call in calls]
        return cls(reasoning, content, calls, steps if len(steps) > 1 else [])

    def steps(self) -> list[Step]:
        return self.order or [(self.reasoning, self.content, self.tool_calls)]

    def pieces(self) -> list[Piece]:
        """Content and calls in the order written (the reasoning left out)."""
        return [(text, calls) for _, text, calls in self.steps()]

    def then(self, other: Shaped) -> Shaped:
        """This delta and ``other`` after it, as one."""
        steps, more = self.steps(), other.steps()
        (thought, text, calls), (next_thought, next_text, next_calls) = steps[-1], more[0]
        # One step still while nothing comes after what it may not follow: reasoning after content
        # or a call, text after a call.
        if (not next_thought or not (text or calls)) and (not next_text or not calls):
            joined = (thought + next_thought, text + next_text, calls + next_calls)
            steps, more = [*steps[:-1], joined], more[1:]
        return Shaped.of_steps([*steps, *more])


class ChoiceShaper:
    """One streamed choice: text deltas in, ``Shaped`` deltas out."""

    def __init__(self, tools: ToolPlan | None, splitter: ReasoningSplitter | None) -> None:
        self.tools = ChoiceTools(tools) if tools is not None else None
        self.splitter = splitter

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and self.tools.made_calls

    @property
    def capped(self) -> bool:
        """It has every tool call it may have (``ChoiceTools.capped``): the answer can stop."""
        return self.tools is not None and self.tools.capped

    @property
    def held(self) -> int:
        """How many of the last characters fed are held back: neither sent nor dropped as markup."""
        held = self.splitter.held if self.splitter is not None else 0
        return held + (self.tools.held if self.tools is not None else 0)

    def feed(self, text: str) -> Shaped:
        if self.splitter is None:
            return self._content("", text)
        out = Shaped()
        for reasoning, content in self.splitter.pieces(text):  # reasoning may follow content (harmony)
            out = out.then(self._content(reasoning, content))
        return out

    def finish(self) -> Shaped:
        reasoning, content = self.splitter.finish() if self.splitter is not None else ("", "")
        out = self._content(reasoning, content)
        if self.tools is not None:
            more, calls = self.tools.finish()
            out = out.then(Shaped("", more, calls))
        return out

    def skip(self, text: str) -> None:
        """Take in text the client already has (a resumed stream): state moves, nothing is sent."""
        self.feed(text)

    def _content(self, reasoning: str, content: str) -> Shaped:
        if self.tools is None or not content:
            return Shaped(reasoning, content)
        return Shaped.of(reasoning, self.tools.pieces(content))


def shape_whole(
    text: str, tools: ToolPlan | None, splitter: ReasoningSplitter | None
) -> tuple[str | None, str | None, list[ToolCall]]:
    """(reasoning, content, tool calls) of a whole answer; content None when there is none beside
    reasoning or calls."""
    reasoning = None
    if splitter is not None:
        reasoning, text = splitter.split(text)
    if tools is None:
        return reasoning, (text or None) if reasoning is not None else text, []
    content, calls = tools.read(text)
    if content == "" and (reasoning is not None or calls):
        content = None
    return reasoning, content, calls
