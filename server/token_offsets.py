"""vLLM's ``return_token_offsets`` on the render routes: where each prompt token sits in its source text.

The offsets are the fast tokenizer's (character ``[start, end)`` spans; a special token the tokenizer
added, such as a BOS, spans nothing). The source is the prompt string of a completion, or the text
the chat template rendered. A prompt given as token ids has no source text: ``None``, as vLLM answers.
"""

from __future__ import annotations

from engine.tokenizer import Tokenizer


def token_offsets(
    tokenizer: Tokenizer, text: str | None, add_special_tokens: bool, token_ids: list[int], keep_first: bool
) -> list[list[int]] | None:
    """Offsets of ``token_ids`` (the prompt the engine would run) in ``text``. A truncated prompt
    (``truncate_prompt_tokens``) is the tail of the text's tokens, or its head with ``keep_first``
    (``truncation_side: "right"``); ids that are not what the text encodes to get ``None`` rather
    than offsets of other tokens."""
    if text is None:
        return None
    ids, offsets = tokenizer.encode_offsets(text, add_special_tokens)
    n = len(token_ids)
    if n > len(ids):
        return None
    part = slice(0, n) if keep_first else slice(len(ids) - n, len(ids))
    if ids[part] != token_ids:
        return None
    return [[start, end] for start, end in offsets[part]]
