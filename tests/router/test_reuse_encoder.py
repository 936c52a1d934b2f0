"""ReuseEncoder: encoding a prompt by reusing a recent prompt's ids gives the ids of a whole encoding.

Checked on three tokenizer kinds: byte-level BPE with ChatML specials (the tiny Qwen2 checkpoint),
Llama-2-style with a ``Prepend("▁")`` normalizer, and Metaspace ``prepend_scheme="first"`` (only the
piece at offset 0 gets "▁") with extra specials that strip whitespace on both sides. Conversations
are random, with whitespace at the edges of messages, non-ASCII text and special tokens typed inside
message content.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers

from engine.tokenizer import Tokenizer as FerryTokenizer
from kvcache.keys import block_hashes
from router.prompt_keys import TokenKeyer
from router.reuse_encoder import ReuseEncoder
from tests.engine.tokenizer_helpers import build_metaspace_dir

_WORDS = ["the", "model", "cache", "ferry", "über", "naïve", "数据", "🙂", "a", "of", "x1", "  ", "\n", "\t"]


def _text(rng: random.Random, n: int, specials: list[str]) -> str:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.03 and specials:
            out.append(rng.choice(specials))  # a user pasting a special token
        else:
            out.append(rng.choice(_WORDS))
        out.append(rng.choice([" ", " ", " ", "", "\n", "  "]))
    return "".join(out)


def _conversation_texts(rng: random.Random, render, specials: list[str], turns: int) -> list[str]:
    """The rendered prompt of every turn of one conversation."""
    messages = [("system", _text(rng, rng.randint(40, 120), specials))]
    texts = []
    for _ in range(turns):
        messages.append(("user", rng.choice(["", " ", "\n"]) + _text(rng, rng.randint(1, 80), specials)))
        texts.append(render(messages, generation_prompt=True))
        messages.append(("assistant", _text(rng, rng.randint(1, 20), specials) + rng.choice(["", " ", "\n"])))
    return texts


def _chatml(messages, generation_prompt: bool) -> str:
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def _llama2(messages, generation_prompt: bool) -> str:
    text = "".join(f"<s>[{role}] {content}</s>" for role, content in messages)
    return text + ("<s>[assistant]" if generation_prompt else "")


def _stripping(messages, generation_prompt: bool) -> str:
    text = "".join(f"<|turn|> {role}: {content} <|end|>\n" for role, content in messages)
    return text + ("<|turn|> assistant:" if generation_prompt else "")


def _qwen_backend(tiny_qwen2: Path) -> Tokenizer:
    return FerryTokenizer.from_dir(tiny_qwen2).backend


def _metaspace_backend(tmp_path: Path) -> Tokenizer:
    return Tokenizer.from_file(str(build_metaspace_dir(tmp_path / "ms") / "tokenizer.json"))


def _first_scheme_backend(tmp_path: Path) -> Tokenizer:
    tok = _metaspace_backend(tmp_path)
    tok.normalizer = normalizers.Sequence([])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.add_special_tokens(
        [
            AddedToken("<|turn|>", special=True, lstrip=True, rstrip=True),
            AddedToken("<|end|>", special=True, lstrip=True, rstrip=True),
        ]
    )
    return tok


@pytest.mark.parametrize("kind", ["qwen", "metaspace", "first_scheme"])
def test_reuse_gives_the_whole_encoding(kind: str, tiny_qwen2: Path, tmp_path: Path) -> None:
    backend, render, specials = {
        "qwen": lambda: (_qwen_backend(tiny_qwen2), _chatml, ["<|im_start|>", "<|im_end|>"]),
        "metaspace": lambda: (_metaspace_backend(tmp_path), _llama2, ["<s>", "</s>"]),
        "first_scheme": lambda: (
            _first_scheme_backend(tmp_path),
            _stripping,
            ["<|turn|>", "<|end|>", "</s>"],
        ),
    }[kind]()
    rng = random.Random(kind)
    enc = ReuseEncoder(backend, verify_every=10**9)  # no safety net: every reuse is compared here
    conversations = [_conversation_texts(rng, render, specials, turns=5) for _ in range(24)]
    checked = 0
    for turn in range(5):  # conversations interleaved, as a router sees them
        for texts in conversations:
            whole = backend.encode(texts[turn], add_special_tokens=False).ids
            assert enc.encode(texts[turn]) == whole, (kind, turn, texts[turn])
            checked += 1
    assert enc.enabled
    assert enc.reused >= 0.9 * 4 * 24  # (nearly) every later turn reused an earlier prompt
    assert checked == 120


def test_a_disagreeing_reuse_turns_reuse_off(tiny_qwen2: Path) -> None:
    backend = _qwen_backend(tiny_qwen2)
    enc = ReuseEncoder(backend, verify_every=1)
    real = enc._reuse

    def corrupted(base, text):
        entry = real(base, text)
        if entry is not None:
            entry.ids = [*entry.ids, 7]
        return entry

    enc._reuse = corrupted  # what a tokenizer outside the reasoning would do
    texts = _conversation_texts(random.Random(1), _chatml, [], turns=3)
    for text in texts:
        assert enc.encode(text) == backend.encode(text, add_special_tokens=False).ids
    assert not enc.enabled
    assert enc.reused == 1  # the first reuse was caught


def test_memory_is_bounded(tiny_qwen2: Path) -> None:
    backend = _qwen_backend(tiny_qwen2)
    enc = ReuseEncoder(backend, capacity=4, verify_every=10**9)
    rng = random.Random(2)
    for _ in range(12):
        for text in _conversation_texts(rng, _chatml, [], turns=3):
            assert enc.encode(text) == backend.encode(text, add_special_tokens=False).ids
    assert len(enc._recent) == 4
    live = {id(e) for e in enc._recent.values()}
    assert all(id(entry) in live for entry, _ in enc._cuts_by_prefix.values())
    assert len(enc._cuts_by_prefix) <= sum(len(e.cut_end) for e in enc._recent.values())


def test_token_keyer_hashes_every_turn_exactly(tiny_qwen2: Path) -> None:
    tokenizer = FerryTokenizer.from_dir(tiny_qwen2)
    keyer = TokenKeyer(tokenizer, 16)
    rng = random.Random(3)
    messages = [{"role": "system", "content": _text(rng, 150, [])}]
    for _ in range(4):
        messages.append({"role": "user", "content": _text(rng, 60, [])})
        ids = tokenizer.encode_chat(messages)
        assert keyer.keys("/v1/chat/completions", {"messages": messages}) == (block_hashes(ids, 16), len(ids))
        messages.append({"role": "assistant", "content": _text(rng, 10, [])})
    assert keyer.chat_encoder.reused == 3
