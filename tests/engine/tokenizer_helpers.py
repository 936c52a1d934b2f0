"""A second kind of tokenizer for the text-handling tests, built offline in well under a second.

The tiny checkpoints use a byte-level BPE (GPT-2 / Qwen / Llama-3 style). This one is Llama-2
style: spaces become "▁", characters outside the vocabulary fall back to ``<0xNN>`` byte tokens,
and the decoder strips the leading space of the whole text, so a token's text depends on whether
it comes first.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Tokenizer, models, normalizers, trainers

METASPACE_SPECIALS = ["<unk>", "<s>", "</s>"]


def build_metaspace_dir(out: Path, vocab_size: int = 600) -> Path:
    """Write tokenizer.json + tokenizer_config.json (bos ``<s>`` added, eos ``</s>``) into ``out``."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=METASPACE_SPECIALS, show_progress=False
    )
    stdlib = Path(string.__file__).parent
    tok.train(sorted(str(p) for p in stdlib.glob("*.py"))[:10], trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"].update(byte_fallback=True, unk_token="<unk>")
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out
