"""``usage.output_tokens_details.reasoning_tokens`` of a Responses answer: a function of the
answer's token ids alone (the resumed ones too), so a whole, streamed, stored or resumed answer
counts the same however its tokens came in chunks.

* ``<think>`` parsers (vLLM's ``count_reasoning_tokens`` for its think-marker parsers): the tokens
  inside the thought, the markers themselves not counted (each parser's own: ``[THINK]`` …
  ``[/THINK]`` for ``mistral``, ``<seed:think>`` … ``</seed:think>`` for ``seed_oss``). The thought is
  open from the first token when the prompt opened it (``deepseek_r1``, or a prompt that ends with
  ``<think>``), else from a ``<think>`` the answer writes; it ends at ``</think>`` (an answer that
  never writes it is all thought). Markers nest as vLLM counts them: a further ``<think>`` opens one
  more level.
* harmony (``openai_gptoss``): as vLLM's HarmonyContext counts, the tokens of every ``analysis``
  and ``commentary`` message from its ``<|message|>`` to its body's end (``<|end|>``, ``<|return|>``,
  ``<|call|>`` or the end of the answer), the end not counted: so the preambles and the tool calls'
  arguments (``commentary``) count as well as the thoughts; the headers and ``final`` bodies do not.
* other parsers (``granite``'s plain-text markers, ``minimax_m2_append_think``): 0, as vLLM counts
  for its parsers without marker tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from server.reasoning_parsers import HarmonySplitter

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer
    from server.state import ServerState

Counter = Callable[[Sequence[int]], int]

_MESSAGE = "<|message|>"
_BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>")


def _at(ids: Sequence[int], i: int, marker: list[int]) -> bool:
    return bool(marker) and list(ids[i : i + len(marker)]) == marker


def count_thought(
    ids: Sequence[int], start: list[int], end: list[int], opened: bool, kept: Sequence[list[int]] = ()
) -> int:
    """The tokens inside ``<think>`` (``start``) ... ``</think>`` (``end``) in ``ids``; ``opened``:
    the prompt opened the thought; ``kept``: markers that also end it, as the answer's first text
    (Kimi-K2's tool-call section: the splitter's ``KEPT_ENDS``), not counted either."""
    depth, count, i = int(opened), 0, 0
    while i < len(ids):
        if _at(ids, i, start):
            depth, i = depth + 1, i + len(start)
        elif _at(ids, i, end):
            depth, i = max(0, depth - 1), i + len(end)
        elif depth and (marker := next((k for k in kept if _at(ids, i, k)), None)) is not None:
            depth, i = depth - 1, i + len(marker)
        else:
            count += depth > 0
            i += 1
    return count


# vLLM counts the tokens its harmony parser reads while in a message of these channels.
_REASONING_CHANNELS = ("analysis", "commentary")
# A header's channel: the text after <|channel|> up to whitespace or the next marker (harmony's own
# header parsing).
_CHANNEL = re.compile(r"<\|channel\|>([^\s<]*)")


def reasoning_spans(text: str) -> list[tuple[int, int]]:
    """Where the harmony ``analysis`` and ``commentary`` messages lie in an answer's ``text`` (special
    tokens kept): each from its ``<|message|>`` to its body's end."""
    spans, header = [], 0
    while (at := text.find(_MESSAGE, header)) >= 0:
        channel = _CHANNEL.search(text, header, at)
        start = at + len(_MESSAGE)
        ends = [(i, e) for e in _BODY_ENDS if (i := text.find(e, start)) >= 0]
        end, marker = min(ends) if ends else (len(text), "")
        if channel is not None and channel.group(1) in _REASONING_CHANNELS:
            spans.append((at, end))
        header = end + len(marker)
    return spans


def count_harmony(ids: Sequence[int], tokenizer: Tokenizer) -> int:
    """The tokens of harmony ``analysis`` and ``commentary`` messages in ``ids`` (``reasoning_spans``):
    those whose text starts inside one (a token with no text of its own yet, a partial character,
    where its text will start). The markers need not be single tokens: the answer's text decides,
    each token placed in it as the stream decodes it."""
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=False), [])
    starts = []
    for token in ids:
        starts.append(len(detok.text))
        detok.append([token])
    detok.flush()
    spans = reasoning_spans(detok.text)
    return sum(any(start <= at < end for start, end in spans) for at in starts)


def reasoning_counter(state: ServerState, thinking_open: bool) -> Counter | None:
    """How ``state``'s reasoning parser counts an answer's reasoning tokens (None: no parser, 0);
    ``thinking_open``: the prompt opened the thought (``ChatChunks.thinking_open``)."""
    parser, tokenizer = state.reasoning, state.tokenizer
    if parser is None:
        return None

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    if parser.marker_tokens:
        start, end = encode(parser.STARTS[0]), encode(parser.ENDS[0])
        kept = [encode(marker) for marker in parser.KEPT_ENDS]
        return lambda ids: count_thought(ids, start, end, thinking_open, kept)
    if issubclass(parser, HarmonySplitter):
        return lambda ids: count_harmony(ids, tokenizer)
    return lambda ids: 0
