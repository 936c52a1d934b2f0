"""Reasoning parsers: a reasoning model's thinking, split from its answer (``reasoning_content``).

Reasoning models write their chain of thought between ``<think>`` and ``</think>`` before the
answer. With ``--reasoning-parser NAME`` (vLLM's flag and names) a chat answer carries the
thinking in ``message.reasoning`` and ``message.reasoning_content`` (the same text under vLLM's new and
old names; ``delta.reasoning`` / ``delta.reasoning_content`` when streamed) and only the
rest in ``content``, where a tool-call parser then looks for calls:

* ``deepseek_r1`` (DeepSeek-R1 and its distills): the chat template opens ``<think>`` in the
  prompt, so the answer starts inside the thinking (a ``<think>`` the model writes anyway is
  dropped); everything up to ``</think>`` is reasoning, and an answer that never closes it is all
  reasoning.
* ``qwen3`` (Qwen3, QwQ): thinking when the answer opens with ``<think>`` (up to ``</think>``, or to
  the end if never closed), or when the rendered prompt opened it (Qwen3-Thinking-2507 and Qwen3.5
  templates end the prompt with ``<think>``: the answer is then read as ``deepseek_r1`` reads it);
  any other answer is all content (thinking switched off). ``glm45`` (GLM-4.5/4.6) and ``glm47``
  (GLM-4.7) are the same.
* ``deepseek_v3`` (DeepSeek-V3.1, whose template thinks when ``chat_template_kwargs`` sets
  ``thinking``): the rendered prompt decides. One that ends with ``<think>`` opened the thinking and
  the answer is read as ``deepseek_r1`` reads it; any other (V3.1's non-thinking prompt ends with
  ``</think>``) gets an answer that is all content unless it opens with ``<think>`` itself.
* ``openai_gptoss`` (gpt-oss): harmony channels (``HarmonySplitter``): ``analysis`` is reasoning,
  ``final`` (and ``commentary``) content, messages to ``functions.*`` tool calls for the ``openai``
  tool parser.
* ``mistral`` (Magistral): ``[THINK]`` … ``[/THINK]`` (control tokens), thinking only after an
  opening ``[THINK]`` (vLLM's also keeps text written before it as content, and drops a lone
  ``[/THINK]``: here such an answer is all content, as ``qwen3`` reads one).
* ``granite`` (Granite 3.2/3.3, ``thinking: true``): ``Here is my thought process:`` … ``Here is my
  response:`` (or ``Here's``), plain text, only when the answer opens with the first.
* ``seed_oss`` (Seed-OSS): ``<seed:think>`` … ``</seed:think>``, read as ``deepseek_r1`` reads
  ``<think>``; ``minimax_m2`` (MiniMax-M2) is ``deepseek_r1`` itself, and ``minimax_m2_append_think``
  leaves the thinking in the content with the ``<think>`` its prompt opened written back in front.
* ``step3`` (Step-3) and ``olmo3`` (Olmo 3 Think, whose markers are plain text) read as ``deepseek_r1``
  (vLLM's ``olmo3`` keeps an unclosed whole answer as content; here it is reasoning, as vLLM streams
  it); ``step3p5`` (Step-3.5) the same, the newline before ``</think>`` dropped; ``mimo`` (MiMo) as
  ``qwen3``; ``holo2`` (Holo2) and ``nemotron_v3`` (Nemotron 3, whose template closes the thinking in
  the prompt with ``enable_thinking: false``) as ``deepseek_v3``.
* ``ernie45`` (ERNIE-4.5 thinking): ``deepseek_r1``'s split, the answer's ``<response>`` …
  ``</response>`` dropped; ``hunyuan_a13b`` (Hunyuan-A13B): thinking only after an opening
  ``<think>``, the answer's ``<answer>`` … ``</answer>`` dropped (``server/reasoning_formats.py``).
* ``kimi_k2`` (Kimi-K2 Thinking, K2.5): ``deepseek_r1``'s split, where a tool-call section also ends
  the thought (and stays in the content for the ``kimi_k2`` tool parser); a prompt that closed the
  thinking (``chat_template_kwargs: {"thinking": false}``) gets an answer that is all content.

``thinking_token_budget`` needs ``<think>`` … ``</think>`` (``think_markers``: the engine forces
``</think>``); ``reasoning_tokens`` counts between each parser's own marker tokens
(``marker_tokens``).

Like the tool streamers, a splitter's result does not depend on how the text was cut into deltas,
so a resumed stream rebuilds it from the text already sent. The splitter itself is in
``server/reasoning_base.py``.
"""

from __future__ import annotations

import re

from server.errors import bad_request
from server.reasoning_base import START, ReasoningSplitter
from server.reasoning_formats import Ernie45Splitter, HunyuanA13BSplitter, KimiK2Splitter, Step3p5Splitter
from server.tool_parser_base import held_prefix


class DeepSeekR1Splitter(ReasoningSplitter):
    requires_start = False


class Qwen3Splitter(ReasoningSplitter):
    requires_start = True
    prompt_decides = True


class DeepSeekV3Splitter(ReasoningSplitter):
    requires_start = True
    prompt_decides = True


class MistralSplitter(ReasoningSplitter):
    """Magistral: ``[THINK]`` … ``[/THINK]`` (control tokens), thinking only after an opening
    ``[THINK]``."""

    requires_start = True
    needs_special_tokens = True
    think_markers = False
    STARTS, ENDS = ("[THINK]",), ("[/THINK]",)


class SeedOssSplitter(ReasoningSplitter):
    """Seed-OSS: ``<seed:think>`` … ``</seed:think>``, read as ``deepseek_r1`` reads ``<think>``."""

    think_markers = False
    STARTS, ENDS = ("<seed:think>",), ("</seed:think>",)


class GraniteSplitter(ReasoningSplitter):
    """Granite 3.2/3.3: plain-text markers, ``Here is my thought process:`` (or ``Here's``) up to
    ``Here is my response:`` (or ``Here's``); any other answer is all content."""

    requires_start = True
    think_markers = False
    marker_tokens = False
    STARTS = ("Here is my thought process:", "Here's my thought process:")
    ENDS = ("Here is my response:", "Here's my response:")


class AppendThinkSplitter(ReasoningSplitter):
    """MiniMax-M2 with its thinking left in the content (vLLM's ``minimax_m2_append_think``): the
    whole answer is content, the ``<think>`` its prompt opened written back in front of it."""

    think_markers = False
    marker_tokens = False

    def feed(self, text: str) -> tuple[str, str]:
        if not self.started:
            self.started, text = True, START + text
        return "", text

    def finish(self) -> tuple[str, str]:
        return self.feed("") if not self.started else ("", "")


class HarmonySplitter(ReasoningSplitter):
    """gpt-oss's harmony format (vLLM's ``openai_gptoss``): the answer is a series of messages, each
    a header (``<|channel|>CHANNEL``, maybe `` to=RECIPIENT`` and ``<|constrain|>json``) then
    ``<|message|>`` and a body that ends at ``<|end|>`` (the next one opens with ``<|start|>assistant``)
    or at the end of the answer (``<|return|>`` and ``<|call|>`` end generation and are not text).

    ``analysis`` bodies are reasoning, ``final`` and ``commentary`` ones content; a message to
    ``functions.NAME`` is a tool call, handed on in the content as ``to=functions.NAME<|message|>ARGS
    <|call|>`` for the ``openai`` tool parser (without one the client sees that text). Text that does
    not start as a header (an answer under a structured-outputs constraint) is content as it is.
    The channel markers are special tokens, so requests keep them in the text."""

    needs_special_tokens = True
    think_markers = False
    marker_tokens = False  # reasoning_tokens counts the analysis and commentary bodies

    def __init__(self, requires_start: bool | None = None) -> None:
        super().__init__(requires_start)
        self.in_body = False
        self.plain = False  # no harmony here: all content
        self.destination = "content"  # where the open body goes: reasoning, content or call

    def feed(self, text: str) -> tuple[str, str]:
        pieces = self.pieces(text)
        return "".join(r for r, _ in pieces), "".join(c for _, c in pieces)

    def pieces(self, text: str) -> list[tuple[str, str]]:
        if self.plain:
            return [("", text)]
        self.pending += text
        pieces: list[tuple[list[str], list[str]]] = [([], [])]  # each: reasoning, then content

        def add(reasoning: bool, part: str) -> None:
            if not part:
                return
            if reasoning and pieces[-1][1]:  # a thought after content: a new piece
                pieces.append(([], []))
            pieces[-1][0 if reasoning else 1].append(part)

        while self.pending:
            if not self.in_body:
                at = self.pending.find(_MESSAGE)
                if at < 0:
                    head = self.pending.lstrip()
                    if head and not any(m.startswith(head[: len(m)]) for m in _HEADER_STARTS):
                        self.plain, text, self.pending = True, self.pending, ""
                        add(False, text)
                    break
                header, self.pending = self.pending[:at], self.pending[at + len(_MESSAGE) :]
                self.destination, opening = _route(header)
                add(False, opening)
                self.in_body = True
                continue
            at = self.pending.find(_END)
            body_end = at if at >= 0 else len(self.pending) - held_prefix(self.pending, _END)
            body, self.pending = self.pending[:body_end], self.pending[body_end:]
            add(self.destination == "reasoning", body)
            if at < 0:
                break
            self.pending = self.pending[len(_END) :]
            self.in_body = False
            if self.destination == "call":
                add(False, _CALL)
        return [("".join(reasoning), "".join(content)) for reasoning, content in pieces]

    def finish(self) -> tuple[str, str]:
        text, self.pending = self.pending, ""
        if self.plain or not self.in_body:
            # An unfinished header holds nothing a client should see, unless it was never harmony.
            return "", text if self.plain or not text.lstrip().startswith(_HEADER_STARTS) else ""
        if self.destination == "reasoning":
            return text, ""
        return "", text + (_CALL if self.destination == "call" else "")


_MESSAGE, _END, _CALL = "<|message|>", "<|end|>", "<|call|>"
_HEADER_STARTS = ("<|start|>", "<|channel|>", "to=", "<|constrain|>")


def _route(header: str) -> tuple[str, str]:
    """(where a message's body goes, the content that opens it) from its header."""
    recipient = re.search(r"to=([^\s<]+)", header)
    if recipient is not None and recipient.group(1).startswith("functions."):
        return "call", f"to={recipient.group(1)}{_MESSAGE}"
    channel = re.search(r"<\|channel\|>\s*(\w+)", header)
    return ("reasoning" if channel is not None and channel.group(1) == "analysis" else "content"), ""


REASONING_PARSERS: dict[str, type[ReasoningSplitter]] = {
    "deepseek_r1": DeepSeekR1Splitter,
    "qwen3": Qwen3Splitter,
    "glm45": Qwen3Splitter,
    "glm47": Qwen3Splitter,
    "deepseek_v3": DeepSeekV3Splitter,
    "openai_gptoss": HarmonySplitter,
    "mistral": MistralSplitter,
    "granite": GraniteSplitter,
    "seed_oss": SeedOssSplitter,
    "minimax_m2": DeepSeekR1Splitter,
    "minimax_m2_append_think": AppendThinkSplitter,
    "step3": DeepSeekR1Splitter,
    "olmo3": DeepSeekR1Splitter,
    "ernie45": Ernie45Splitter,
    "hunyuan_a13b": HunyuanA13BSplitter,
    "kimi_k2": KimiK2Splitter,
    "mimo": Qwen3Splitter,
    "holo2": DeepSeekV3Splitter,
    "nemotron_v3": DeepSeekV3Splitter,
    "step3p5": Step3p5Splitter,
}


def thinking_budget(parser: type[ReasoningSplitter] | None, name: str | None, budget: int) -> int | None:
    """A request's ``thinking_token_budget`` for the engine (-1: none), served by ``--reasoning-parser
    name`` (``parser``; None: no parser). It needs a parser whose model thinks between ``<think>``
    and ``</think>``: vLLM refuses a budget it cannot enforce too, and a cap silently ignored would
    let a model think past what the client asked to pay for."""
    if budget == -1:
        return None
    if parser is None:
        raise bad_request(
            "thinking_token_budget needs a reasoning parser: start the server with --reasoning-parser "
            f"({', '.join(n for n, p in REASONING_PARSERS.items() if p.think_markers)}: the models that "
            "think between <think> and </think>)",
            param="thinking_token_budget",
        )
    if not parser.think_markers:
        raise bad_request(
            f"thinking_token_budget: --reasoning-parser {name} has no <think> ... </think> markers "
            "to count and end the thinking with",
            param="thinking_token_budget",
        )
    return budget


def reasoning_splitter(name: str) -> ReasoningSplitter:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}"
        ) from None
