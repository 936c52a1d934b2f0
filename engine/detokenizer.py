"""Streaming token ids -> text, with stop strings. Torch-free.

Each request owns one ``IncrementalDetokenizer``. Decoding uses a sliding window of token ids
(a *prefix* offset and a *read* offset, as vLLM's detokenizer does): only the few ids since the
last emitted character are decoded again, so the cost per token stays constant, and text is
released only up to the last whole character (a trailing U+FFFD is an incomplete UTF-8 sequence),
so a multi-byte character split over several byte tokens is never emitted half-done. The window starts with the prompt's last tokens as context, so
decoders that treat the first token of a string specially (SentencePiece's leading space) see the
output as a continuation.

Stop strings are searched in the decoded text as it grows. Text that could still turn out to be
the start of a stop string is held back; a stop ends the text at the match (the stop string is left
out unless ``include_stop_str_in_output``). Among several matches, the one that *ends* first wins,
ties to the longer one: that is where a reader scanning the text would first see a stop string,
so the result does not depend on how the text was split into tokens. As in vLLM, a stop string
only counts once more than ``min_tokens`` ids have been generated: text from before that is kept
even where it contains one.

Invariant: the concatenation of every ``append`` delta and ``flush()`` equals a one-shot decode of
the output ids (in the context of the prompt), cut at the stop string as above. One exception, by
the decoder's design: a SentencePiece ``ByteFallback`` decoder turns a whole run of ``<0xNN>``
tokens into U+FFFDs when the run is not valid UTF-8, so a character emitted from a valid run can be
"re-poisoned" in a one-shot decode by a stray byte token generated after it. The stream keeps the
character (what the model produced up to then); the two texts differ only for invalid UTF-8.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

# Prompt tokens kept as decoding context, and how far the window may slide before it is trimmed.
_CONTEXT_TOKENS = 5
_TRIM_AT = 64


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: Sequence[int]) -> None:
        self._backend = tokenizer.backend
        self._skip_special = params.skip_special_tokens
        self._include_stop = params.include_stop_str_in_output
        self._stops = [s for s in dict.fromkeys(params.stop) if s]
        # As vLLM: a stop string ends the request only once more than min_tokens ids are out.
        self._min_tokens = params.min_tokens or 0
        self._num_out = 0
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        if self._backend.decode(context, skip_special_tokens=self._skip_special).endswith("\ufffd"):
            # The prompt ends inside a character: output bytes would merge with it, and the output
            # text would no longer be the decode of the output ids. Decode without context.
            context = []
        self._ids: list[int] = context
        self._prefix = 0  # window start: decoding begins here so the first token keeps its context
        self._read = len(self._ids)  # ids before this are already in _decoded
        self._window_emitted = 0  # chars decoded past the window's prefix text while it waits on a byte
        self._decoded = ""  # output text decoded so far (emitted + held back)
        self._emitted = 0  # length of the emitted part of _decoded
        self._done = False
        self.stop_hit: str | None = None

    @property
    def text(self) -> str:
        """The output text emitted so far."""
        return self._decoded[: self._emitted]

    @property
    def held_back(self) -> str:
        """Decoded text not emitted yet because it may be the start of a stop string."""
        return "" if self._done else self._decoded[self._emitted :]

    def append(self, token_ids: Sequence[int], stop_terminated: bool = False) -> str:
        """Add newly generated ids; return the text that became safe to show.

        ``stop_terminated``: the last id is the EOS or stop token that ends the request; as in vLLM its
        text is left out unless ``include_stop_str_in_output``.
        """
        if self._done:
            return ""
        self._num_out += len(token_ids)
        if stop_terminated and not self._include_stop:
            token_ids = token_ids[:-1]
        if token_ids:
            self._ids.extend(token_ids)
            self._decode_window(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of the request: decode what is pending (even an incomplete character, as the
        one-shot decode would show it) and release everything held back. Checks stop strings once
        more, so ``stop_hit`` may be set by the flush."""
        if self._done:
            return ""
        self._decode_window(final=True)
        delta = self._release(final=True)
        self._done = True
        return delta

    def _decode_window(self, final: bool) -> None:
        if self._read >= len(self._ids):
            return
        decode = self._backend.decode
        prefix_text = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip_special)
        new_text = decode(self._ids[self._prefix :], skip_special_tokens=self._skip_special)
        done = len(prefix_text) + self._window_emitted  # chars of new_text already in _decoded
        if final or not new_text.endswith("\ufffd"):
            if len(new_text) > done:
                self._decoded += new_text[done:]
            if len(new_text) > len(prefix_text):
                self._prefix, self._read, self._window_emitted = self._read, len(self._ids), 0
                self._trim()
            return
        # A trailing U+FFFD is an incomplete UTF-8 sequence: wait for its next byte token, but
        # release the whole characters before it (the window stays where it is).
        stable = len(new_text.rstrip("\ufffd"))
        if stable > done:
            self._decoded += new_text[done:stable]
            self._window_emitted = stable - len(prefix_text)

    def _trim(self) -> None:
        if self._prefix > _TRIM_AT:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    def _release(self, final: bool) -> str:
        start, text = self._emitted, self._decoded
        end = len(text)
        if self._stops:
            match = self._find_stop(start) if self._num_out > self._min_tokens else None
            if match is not None:
                stop, at = match
                end = at + len(stop) if self._include_stop else at
                self.stop_hit = stop
                self._done = True
                self._decoded = text[:end]
                self._emitted = end
                return text[start:end]
            if not final:
                end -= self._partial_stop_len(text[start:])
        self._emitted = end
        return text[start:end]

    def _find_stop(self, start: int) -> tuple[str, int] | None:
        """The stop string whose first occurrence at or after ``start`` ends first (ties: longest)."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            at = self._decoded.find(stop, start)
            if at >= 0:
                key = (at + len(stop), at, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[2], best[1])

    def _partial_stop_len(self, pending: str) -> int:
        """Length of the longest suffix of ``pending`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:k]):
                    longest = k
                    break
        return longest
