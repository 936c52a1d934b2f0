"""Engine logprobs -> OpenAI wire formats (chat ``logprobs.content`` and legacy completions).

The engine gives, per generated position, ``{token_id: Logprob}`` holding the sampled token
plus the top-N (ranked). Token text comes from the engine when it decoded it, else from the
tokenizer (``token_text`` writes partial UTF-8 as ``bytes:\\x..`` as OpenAI does).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from engine.outputs import Logprob, PositionLogprobs
from engine.tokenizer import Tokenizer
from server.chat_protocol import TokenLogprob, TopLogprob
from server.completion_protocol import CompletionLogprobs
from server.protocol import PromptLogprob, PromptLogprobs


def _text(tokenizer: Tokenizer, token_id: int, lp: Logprob | None, as_ids: bool = False) -> str:
    if as_ids:  # vLLM's return_tokens_as_token_ids: exact ids for clients that re-tokenize nothing
        return f"token_id:{token_id}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.token_text(token_id)


def _bytes(tokenizer: Tokenizer, token_id: int) -> list[int] | None:
    """The token's raw UTF-8 bytes (a partial character's bytes too), as OpenAI's ``bytes`` field."""
    raw = tokenizer.token_bytes(token_id)
    return list(raw) if raw is not None else None


def _top(position: PositionLogprobs, n: int | None) -> list[tuple[int, Logprob]]:
    """The ``n`` best of a position; ``n`` None: all of it in its order (the sampled token, then a
    request's ``logprob_token_ids`` as it listed them, as vLLM renders them)."""
    if n is None:
        return list(position.items())
    if n <= 0:
        return []
    ranked = sorted(
        position.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, -kv[1].logprob)
    )
    return ranked[:n]


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _logprob(value: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number. -9999.0 is what vLLM and OpenAI send.
    return value if value > -9999.0 else -9999.0


def chat_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs] | None,
    top_n: int | None,
    as_ids: bool = False,
) -> list[TokenLogprob]:
    """One ``TokenLogprob`` per generated token (with ``top_n`` alternatives; None: all it has)."""
    if not positions:
        return []
    out = []
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id)
        text = _text(tokenizer, token_id, chosen, as_ids)
        top = [
            TopLogprob(
                token=_text(tokenizer, tid, lp, as_ids),
                logprob=_logprob(lp.logprob),
                bytes=_bytes(tokenizer, tid),
            )
            for tid, lp in _top(position, top_n)
        ]
        out.append(
            TokenLogprob(
                token=text,
                logprob=_logprob(chosen.logprob) if chosen is not None else -9999.0,
                bytes=_bytes(tokenizer, token_id),
                top_logprobs=top,
            )
        )
    return out


class CompletionLogprobsBuilder:
    """Accumulates legacy completion logprobs across deltas, keeping ``text_offset`` running.

    ``text_offset`` indexes the choice's text: a token's offset is the length of the text of the
    tokens before it (as ``decode(ids[:i])`` reads). Each token moves it by the characters it adds
    there (``Tokenizer.text_width``), not by the length of its shown form (``bytes:\\xcc``,
    ``token_id:7``, a skipped special token's text); the pieces of a multi-byte character (byte-level
    tokens that are not UTF-8 alone) add the one character they make together, read as UTF-8 is
    (an incomplete or invalid run reads as one U+FFFD, as the decoded text shows it).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        top_n: int | None,
        start_offset: int = 0,
        as_ids: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self.top_n = top_n
        self.offset = start_offset  # the text's length before any unfinished character
        self.skip_special_tokens = skip_special_tokens
        # The bytes of a character whose pieces have not all come (held in the decoder's buffer).
        self._pieces = codecs.getincrementaldecoder("utf-8")("replace")

    def add(
        self,
        token_ids: Sequence[int],
        positions: Sequence[PositionLogprobs | None] | None,
        shown: str | None = None,
    ) -> CompletionLogprobs:
        """Logprobs of ``token_ids``; a ``None`` position (the first prompt token when echoing) has none.
        ``shown``: the whole text these tokens read as, when it is known beforehand (an echoed
        prompt: the client's own string, or the ids decoded): a special token is in it where that
        text has it (typed by the client), not where the tokenizer added it (a BOS); a character
        left unfinished at its end stays its U+FFFD, whatever follows."""
        result = CompletionLogprobs()
        if positions is None:
            return result
        for token_id, position in zip(token_ids, positions, strict=False):
            if position is None:
                text = _text(self.tokenizer, token_id, None, self.as_ids)
                result.tokens.append(text)
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                chosen = position.get(token_id)
                text = _text(self.tokenizer, token_id, chosen, self.as_ids)
                result.tokens.append(text)
                result.token_logprobs.append(_logprob(chosen.logprob) if chosen is not None else -9999.0)
                top = {
                    _text(self.tokenizer, tid, lp, self.as_ids): _logprob(lp.logprob)
                    for tid, lp in _top(position, self.top_n)
                }
                if chosen is not None:
                    top.setdefault(text, _logprob(chosen.logprob))
                result.top_logprobs.append(top)
            result.text_offset.append(self._place(token_id, shown))
        if shown is not None:
            self._finish_pieces()
        return result

    def _place(self, token_id: int, shown: str | None) -> int:
        """The offset of the next token, ``token_id``; moves past it."""
        tokenizer = self.tokenizer
        pending = 1 if self._pieces.getstate()[0] else 0  # an unfinished character reads as one U+FFFD
        if token_id in tokenizer.all_special_ids:
            if shown is not None:
                in_text = shown.startswith(tokenizer.token_text(token_id), self.offset + pending)
            else:
                in_text = not self.skip_special_tokens
            if not in_text:  # no text; the decoder joins the pieces around it
                return self.offset + pending
            self._finish_pieces()
            at = self.offset
            self.offset += tokenizer.text_width(token_id, skip_special_tokens=False)
            return at
        raw = tokenizer.token_bytes(token_id)
        if raw is None or _is_utf8(raw):
            # Whole characters: it cannot continue an unfinished one (which then reads as U+FFFD).
            self._finish_pieces()
            at = self.offset
            self.offset += tokenizer.text_width(token_id, self.skip_special_tokens)
            return at
        at = self.offset + pending
        self.offset += len(self._pieces.decode(raw))  # the characters it completes; keeps a new start
        return at

    def _finish_pieces(self) -> None:
        self.offset += len(self._pieces.decode(b"", final=True))
        self._pieces.reset()

    def fill(
        self, part: CompletionLogprobs, token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None]
    ) -> None:
        """Set the logprob values of entries laid out earlier by ``add(token_ids, [None] * n)``."""
        for i, (token_id, position) in enumerate(zip(token_ids, positions, strict=False)):
            if position is None:
                continue
            chosen = position.get(token_id)
            part.token_logprobs[i] = _logprob(chosen.logprob) if chosen is not None else -9999.0
            top = {
                _text(self.tokenizer, tid, lp, self.as_ids): _logprob(lp.logprob)
                for tid, lp in _top(position, self.top_n)
            }
            if chosen is not None:
                top.setdefault(part.tokens[i], _logprob(chosen.logprob))
            part.top_logprobs[i] = top


def merge_completion_logprobs(parts: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    merged = CompletionLogprobs()
    for part in parts:
        merged.tokens += part.tokens
        merged.token_logprobs += part.token_logprobs
        merged.top_logprobs += part.top_logprobs
        merged.text_offset += part.text_offset
    return merged


def prompt_logprobs_out(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs | None],
    top_n: int,
) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt position the prompt token's entry and the top ``top_n``
    (the engine may have computed more, for an echo that asked more)."""
    out: PromptLogprobs = []
    for token_id, position in zip(token_ids, positions, strict=False):
        if position is None:
            out.append(None)
            continue
        keep = dict(_top(position, top_n))
        if token_id in position:
            keep[token_id] = position[token_id]
        out.append(
            {
                tid: PromptLogprob(
                    logprob=_logprob(lp.logprob), rank=lp.rank, decoded_token=_text(tokenizer, tid, lp)
                )
                for tid, lp in keep.items()
            }
        )
    return out
