"""Reproducible tiny checkpoints in Hugging Face format, built locally (never downloaded).

Used for the built-in demo model (`ferry serve` with no --model) and by the tests. The
tokenizer is a byte-level BPE trained on the Python standard library's own sources, so
everything here is deterministic for a given Python version and seed, and offline.

This module is where the builders are imported from; each lives with its kind: the tokenizer
(``demo_tokenizer``), the causal LM and classifier checkpoints (``demo_build``; more architectures'
configs in ``demo_archs``), checkpoints derived from another (``demo_derived``: drafts, MTP layers, LoRA adapters) and LLaVA (``demo_llava``).
Importing it imports no torch (``demo_model_path`` is used where torch must not load).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from engine.demo_build import build_model
from engine.demo_derived import LORA_TARGETS, add_mtp_layer, build_layer_draft, build_lora_adapter
from engine.demo_llava import LLAVA_CHAT_TEMPLATE, build_llava
from engine.demo_tokenizer import CHATML_TEMPLATE, SPECIAL_TOKENS, build_tokenizer

__all__ = [
    "CHATML_TEMPLATE",
    "DEMO_SPEC",
    "LLAVA_CHAT_TEMPLATE",
    "LORA_TARGETS",
    "SPECIAL_TOKENS",
    "add_mtp_layer",
    "build_layer_draft",
    "build_llava",
    "build_lora_adapter",
    "build_model",
    "build_tokenizer",
    "demo_model_dir",
    "demo_model_path",
]


DEMO_SPEC = dict(
    arch="llama",
    seed=1234,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tokenizer_vocab_size=2000,
)


def demo_model_path() -> Path:
    """Where the built-in demo model lives (it may not be built yet: see ``demo_model_dir``)."""
    spec_id = hashlib.sha256(json.dumps(DEMO_SPEC, sort_keys=True).encode()).hexdigest()[:12]
    base = Path(os.environ.get("FERRY_CACHE_DIR") or Path.home() / ".cache" / "ferry")
    return base / f"demo-{spec_id}-py{sys.version_info[0]}{sys.version_info[1]}"


def demo_model_dir() -> Path:
    """Path of the built-in demo model, generated on first use into a per-user cache directory."""
    target = demo_model_path()
    base = target.parent
    if (target / "config.json").exists():
        return target
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="demo-", dir=base))
    try:
        build_model(tmp, **DEMO_SPEC)
    except BaseException:  # a failed or interrupted (Ctrl-C) build leaves nothing behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, target)  # atomic: concurrent first starts never see a half-written model
    except OSError:  # another start's model won the rename
        shutil.rmtree(tmp, ignore_errors=True)
    return target
