"""The demo checkpoints' tokenizer: a byte-level BPE trained on the Python standard library's own
sources (deterministic for a given Python version, offline), saved with a ChatML chat template.
Used by every builder of ``engine/demo.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _training_files(limit: int = 60) -> list[str]:
    import string as _string  # a module that is always there, to locate the stdlib

    libdir = Path(_string.__file__).parent
    files = sorted(str(p) for p in libdir.glob("*.py"))
    return files[:limit]


def build_tokenizer(
    out_dir: str | os.PathLike, vocab_size: int = 1000, extra_tokens: Sequence[str] = ()
) -> None:
    """Train a byte-level BPE on stdlib sources and save it with a ChatML chat template.

    ``extra_tokens`` are added whole (not special), as reasoning models add ``<think>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_training_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    if extra_tokens:
        fast.add_tokens(list(extra_tokens))
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out_dir))
    # transformers 5 writes the template to chat_template.jinja; keep it in tokenizer_config.json
    # too, where older loaders and DESIGN.md's model format expect it.
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHATML_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
