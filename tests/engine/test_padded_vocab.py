"""A checkpoint whose embedding is padded past the tokenizer never yields a padded id.

Real checkpoints pad ``vocab_size`` (e.g. to a multiple of 64); the padded rows are not tokens.
Here the padded lm_head rows are made to win argmax at every step, so a sampler that looked past
the tokenizer would pick them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams

PAD = 8


@pytest.fixture(scope="module")
def padded_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp("padded")
    for f in tiny_llama.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    vocab = cfg["vocab_size"]
    weights = load_file(str(out / "model.safetensors"))
    emb, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    # Padded row k = +-30x a real token's row: for any hidden state one of each +- pair scores
    # 30x |that token's logit|, far above every real token's logit.
    src = head[:4]
    weights["lm_head.weight"] = torch.cat([head, 30.0 * src, -30.0 * src]).contiguous()
    weights["model.embed_tokens.weight"] = torch.cat([emb, emb[:PAD]]).contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg["vocab_size"] = vocab + PAD
    (out / "config.json").write_text(json.dumps(cfg))
    return out, vocab


@pytest.fixture(scope="module")
def llm(padded_model: tuple[Path, int]) -> LLM:
    return LLM(str(padded_model[0]), num_kv_blocks=64)


def test_padded_rows_would_win_argmax(llm: LLM, padded_model: tuple[Path, int]) -> None:
    vocab = padded_model[1]
    assert llm.engine.vocab_size == vocab + PAD and llm.engine.tokenizer.vocab_size == vocab
    seen: list[torch.Tensor] = []
    llm.engine.logits_observers.append(lambda _ids, logits: seen.append(logits.argmax(dim=-1)))
    try:
        out = llm.generate("hello world", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    finally:
        llm.engine.logits_observers.clear()
    assert len(seen) == 6 and all(int(a.min()) >= vocab for a in seen)  # the test is meaningful
    assert all(0 <= t < vocab for t in out[0].outputs[0].token_ids)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5),
        SamplingParams(temperature=1.5, seed=7, max_tokens=12, ignore_eos=True, logprobs=5),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=3, max_tokens=12, ignore_eos=True),
    ],
    ids=["greedy", "sampled", "top_p_top_k"],
)
def test_never_samples_padded_ids(llm: LLM, padded_model: tuple[Path, int], params: SamplingParams) -> None:
    vocab = padded_model[1]
    out = llm.generate(["hello world", "def main():"], params)
    for r in out:
        c = r.outputs[0]
        assert len(c.token_ids) == 12 and all(0 <= t < vocab for t in c.token_ids)
        for entry in c.logprobs or []:
            assert all(0 <= t < vocab for t in entry)


def test_prompt_logprobs_and_prompt_ids_stay_in_tokenizer_vocab(
    llm: LLM, padded_model: tuple[Path, int]
) -> None:
    vocab = padded_model[1]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=vocab + PAD)
    with pytest.raises(ValueError):  # more than max_logprobs
        llm.generate([5, 6, 7], params)
    out = llm.generate([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=20))
    pl = out[0].prompt_logprobs
    assert pl[0] is None and len(pl) == 4
    for entry in pl[1:]:
        assert len(entry) >= 20 and all(0 <= t < vocab for t in entry)
    with pytest.raises(ValueError, match="out of the vocabulary"):
        llm.generate([5, vocab + 1], SamplingParams(max_tokens=1))
