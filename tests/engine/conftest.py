"""Engine test helpers: fixed prompts, transformers references (computed once), engine builders."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch

PROMPT_LENGTHS = [1, 2, 5, 16, 17, 31, 64, 100, 160, 200]


def make_prompts(vocab: int, lengths: list[int] = PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids 3.. skip the special tokens, so no prompt contains an EOS.
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@functools.lru_cache(maxsize=8)
def _hf_model(path: str):
    # Eager attention: the exact reference. Some transformers releases (5.17) pick SDPA for Gemma 2,
    # which drops its attention soft-capping.
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens (EOS ignored) and the raw logits of each step ``[steps, vocab]``."""
    model = _hf_model(str(path))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


@pytest.fixture(scope="session")
def vocab_size(tiny_llama: Path) -> int:
    import json

    return json.loads((tiny_llama / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="session")
def prompts(vocab_size: int) -> list[list[int]]:
    return make_prompts(vocab_size)


@pytest.fixture(scope="session")
def hf_reference():
    """``hf_reference(path, prompt, max_new_tokens) -> (tokens, logits)`` from transformers."""
    return hf_greedy


@pytest.fixture(scope="session")
def hf_model():
    """``hf_model(path)``: transformers' model of a checkpoint, fp32, in eval mode (loaded once)."""
    return lambda path: _hf_model(str(path))
