"""Tokenize a rendered chat prompt by reusing the tokens of a recent prompt it extends.

A conversation's turn k renders to the text of turn k-1 plus the new messages, and the router
tokenizes every turn whole to hash its blocks: most of that work repeats. ``ReuseEncoder`` keeps
the encodings of recent prompts and, for a prompt that shares a long start with one of them, takes
that one's ids up to a special token inside the shared text and encodes only the rest.

Why that is exact: a Hugging Face ``tokenizers`` pipeline first splits the text at added tokens,
then normalizes, pre-tokenizes and encodes each piece between them on its own; so the ids up to a
special token depend only on the text up to it, and the ids after it only on the text after it and
on that token (its ``rstrip``, and pre-tokenizers such as Metaspace's ``prepend_scheme="first"``
that treat the piece at offset 0 differently: encoding ``special + rest`` puts ``rest`` where the
whole prompt has it, after a special token). The special token used as the cut must end at least
the longest added token's length before the shared text ends, so that no added-token match that
decides the split up to the cut can reach the part where the prompts differ.

Every ``verify_every``-th reuse is checked against a whole encoding; a mismatch (a tokenizer this
reasoning does not cover) turns reuse off for good, with a warning.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from engine.tokenizer import encoding

logger = logging.getLogger("ferry.router")

_MIN_REUSED_CHARS = 256  # below this, encoding the whole prompt costs about what reuse saves


class _Entry:
    __slots__ = ("text", "ids", "cut_index", "cut_end")

    def __init__(self, text: str, ids: list[int], cut_index: list[int], cut_end: list[int]) -> None:
        self.text = text
        self.ids = ids
        self.cut_index = cut_index  # positions in ids of special tokens...
        self.cut_end = cut_end  # ...and where each ends in text (ascending)


class ReuseEncoder:
    def __init__(self, backend: Any, capacity: int = 256, verify_every: int = 64) -> None:
        """``backend``: a ``tokenizers.Tokenizer``. Keeps the ``capacity`` most recent prompts."""
        self._backend = backend
        added = backend.get_added_tokens_decoder()
        self._special = {i: t.content for i, t in added.items() if t.special}
        # each special token's text, and whether its match takes the whitespace after it (rstrip)
        self._contents = sorted({(t.content, bool(t.rstrip)) for t in added.values() if t.special})
        self._margin = max((len(t.content) for t in added.values()), default=0)
        self.enabled = bool(self._special)
        self._capacity = capacity
        self._verify_every = verify_every
        self._recent: OrderedDict[str, _Entry] = OrderedDict()
        # hash of a prompt's text up to one of its special tokens -> (that prompt, which cut)
        self._cuts_by_prefix: dict[int, tuple[_Entry, int]] = {}
        self._lock = threading.Lock()
        self.reused = 0  # prompts encoded by reuse (for tests and logs)

    def encode(self, text: str) -> list[int]:
        """``backend.encode(text, add_special_tokens=False).ids``, reusing a recent prompt's ids."""
        if not self.enabled:
            return encoding(self._backend, text, False).ids
        with self._lock:
            base = self._find_base(text)
        entry = self._reuse(base, text) if base is not None else None
        if entry is None:
            entry = self._encode_whole(text)
        else:
            self.reused += 1
            if self.reused % self._verify_every == 0:
                whole = encoding(self._backend, text, False).ids
                if whole != entry.ids:
                    logger.warning(
                        "prompt token reuse disagrees with a whole encoding for this tokenizer; turned off"
                    )
                    self.enabled = False
                    return whole
        with self._lock:
            self._remember(entry)
        return entry.ids

    # -- internals -------------------------------------------------------------------------------

    def _find_base(self, text: str) -> tuple[_Entry, int] | None:
        """The recent prompt and cut (a special token of it) to reuse up to: the latest place where
        ``text`` has a special token's characters, that prompt's text up to there is ``text``'s, and
        the two agree for at least ``margin`` characters more."""
        ends = []
        for content, rstrip in self._contents:
            at = text.find(content)
            while at >= 0:
                end = at + len(content)
                while rstrip and end < len(text) and text[end].isspace():
                    end += 1
                ends.append(end)
                at = text.find(content, at + 1)
        ends.sort(reverse=True)
        margin = self._margin
        for end in ends:
            if end < _MIN_REUSED_CHARS:
                break
            if end + margin > len(text):
                continue
            hit = self._cuts_by_prefix.get(hash(text[:end]))
            if hit is None:
                continue
            entry, j = hit
            if entry.cut_end[j] == end and entry.text[: end + margin] == text[: end + margin]:
                return hit
        return None

    def _reuse(self, base: tuple[_Entry, int], text: str) -> _Entry | None:
        entry, j = base
        k, end = entry.cut_index[j], entry.cut_end[j]
        special = self._special[entry.ids[k]]
        rest = encoding(self._backend, special + text[end:], False)
        rest_ids = rest.ids
        if not rest_ids or rest_ids[0] != entry.ids[k]:
            return None
        shift = end - len(special)
        cuts = self._cuts(rest_ids, rest, start=1)
        return _Entry(
            text,
            entry.ids[: k + 1] + rest_ids[1:],
            entry.cut_index[: j + 1] + [k + i for i, _ in cuts],
            entry.cut_end[: j + 1] + [e + shift for _, e in cuts],
        )

    def _encode_whole(self, text: str) -> _Entry:
        enc = encoding(self._backend, text, False)
        cuts = self._cuts(enc.ids, enc, start=0)
        return _Entry(text, enc.ids, [i for i, _ in cuts], [e for _, e in cuts])

    def _cuts(self, ids: list[int], enc: Any, start: int) -> list[tuple[int, int]]:
        """(position, end offset) of each special token in ``ids[start:]``."""
        special = self._special
        out = []
        for i in range(start, len(ids)):
            if ids[i] in special:
                span = enc.token_to_chars(i)
                if span is not None:
                    out.append((i, span[1]))
        return out

    def _remember(self, entry: _Entry) -> None:
        text = entry.text
        if text in self._recent:
            self._recent.move_to_end(text)
            return
        self._recent[text] = entry
        for j, end in enumerate(entry.cut_end):
            if end >= _MIN_REUSED_CHARS:
                self._cuts_by_prefix[hash(text[:end])] = (entry, j)
        while len(self._recent) > self._capacity:
            _, old = self._recent.popitem(last=False)
            for end in old.cut_end:
                key = hash(old.text[:end])
                if end >= _MIN_REUSED_CHARS and self._cuts_by_prefix.get(key, (None,))[0] is old:
                    del self._cuts_by_prefix[key]
