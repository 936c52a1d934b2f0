"""The vocabulary xgrammar compiles constraints against: the model's tokenizer as an
``xgr.TokenizerInfo``, its special tokens kept out of constrained text.

Built once per ``GrammarCompiler`` (``engine/structured_output.py``), on its first compile; never
compiles a grammar.
"""

from __future__ import annotations

from typing import Any


def special_tokens_apart(info: Any, hf: Any, special_ids: set[int], vocab_size: int) -> Any:
    """``info`` with the vocabulary's special tokens (``<|im_start|>``) written as no text, which
    xgrammar then never takes as part of a sentence (its own special tokens; a stop token still
    ends one). As their text, a regex's "." or a JSON string's character took them, and the
    detokenizer, which skips special tokens, wrote text that no longer matched: ``.{3,}`` gave ""."""
    import xgrammar as xgr

    special = [i for i in special_ids if i < vocab_size]
    if not special:
        return info
    vocab = [""] * vocab_size
    for token, i in hf.get_vocab().items():
        if i < vocab_size:
            vocab[i] = token
    for i in special:
        vocab[i] = ""
    return xgr.TokenizerInfo(
        vocab,
        vocab_type=info.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=info.stop_token_ids,
        add_prefix_space=info.add_prefix_space,
    )
