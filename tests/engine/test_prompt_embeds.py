"""Prompt embeddings in the engine (``engine/prompt_embeds.py``): greedy tokens equal transformers'
``generate(inputs_embeds=...)`` and ferry's own for the token ids the embeddings are the rows of,
with the prompt split across prefill chunks and under preemption; identical embeddings share
prefix-cache blocks, different ones never do; bad tensors are ValueErrors."""

from __future__ import annotations

import functools
import io
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.demo import build_lora_adapter
from engine.lora_request import LoRARequest

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
IDS = [[5, 99, 230, 17, 64, 301, 12, 7, 450, 3, 88], list(range(40, 80))]  # 11 and 40 tokens


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_embeds(path: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(str(path)).get_input_embeddings()(torch.tensor(ids)).clone()


def hf_generate(path: Path, embeds: torch.Tensor, max_new_tokens: int = 8, **kw) -> list[int]:
    model = hf_model(str(path))
    with torch.no_grad():
        out = model.generate(
            inputs_embeds=embeds[None],
            attention_mask=torch.ones(1, embeds.shape[0], dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
            **kw,
        )
    return out[0].tolist()  # generate with inputs_embeds alone returns only the new tokens


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), enable_prompt_embeds=True, num_kv_blocks=64)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_equal_transformers_and_token_ids(tiny_llama: Path, llm: LLM) -> None:
    embeds = [hf_embeds(tiny_llama, ids) for ids in IDS]
    want = [hf_generate(tiny_llama, e) for e in embeds]
    got = llm.generate([{"prompt_embeds": e} for e in embeds], PARAMS)
    assert tokens(got) == want
    assert tokens(llm.generate([{"prompt_token_ids": ids} for ids in IDS], PARAMS)) == want
    # placeholders stand in the token ids; 3-D of batch 1 and bf16 are taken too
    assert got[1].prompt_token_ids == [0] * 40 and got[1].prompt is None
    assert tokens(llm.generate({"prompt_embeds": embeds[0][None]}, PARAMS)) == want[:1]


def test_repetition_penalty_sees_no_placeholders(tiny_llama: Path, llm: LLM) -> None:
    """transformers penalises only generated tokens when given inputs_embeds; ferry does the same
    (the placeholder ids are no prompt tokens to the sampler)."""
    embeds = hf_embeds(tiny_llama, IDS[1])
    want = hf_generate(tiny_llama, embeds, 12, repetition_penalty=1.8)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8)
    assert tokens(llm.generate({"prompt_embeds": embeds}, params)) == [want]


def test_chunked_prefill_and_preemption(tiny_llama: Path, llm: LLM) -> None:
    """Chunks of 5 split the 40-row prompts; 14 blocks of 4 for three 48-token sequences preempt."""
    prompts = [{"prompt_embeds": hf_embeds(tiny_llama, [i + 7, *IDS[1][1:]])} for i in range(3)]
    want = tokens(llm.generate(prompts, PARAMS))
    small = LLM(
        str(tiny_llama),
        enable_prompt_embeds=True,
        block_size=4,
        num_kv_blocks=14,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=5,
    )
    assert tokens(small.generate(prompts, PARAMS)) == want
    assert small.engine.scheduler.num_preemptions > 0
    small.engine.block_manager.check_integrity()


def test_prefix_cache(tiny_llama: Path, llm: LLM) -> None:
    """Block size 16, 40 rows: the same embeddings reuse both full blocks; embeddings differing in
    their last row share none (the digest keys every block), nor do the token ids they came from."""
    llm.engine.block_manager.reset_prefix_cache()
    embeds = hf_embeds(tiny_llama, IDS[1])
    first = llm.generate({"prompt_embeds": embeds}, PARAMS)[0]
    assert first.num_cached_tokens == 0
    same = llm.generate({"prompt_embeds": embeds.clone()}, PARAMS)[0]
    assert same.num_cached_tokens == 32
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    other = embeds.clone()
    other[-1] += 0.5
    assert llm.generate({"prompt_embeds": other}, PARAMS)[0].num_cached_tokens == 0
    assert llm.generate({"prompt_token_ids": IDS[1]}, PARAMS)[0].num_cached_tokens == 0
    llm.engine.block_manager.check_integrity()


def test_bad_embeddings(tiny_llama: Path, llm: LLM) -> None:
    good = hf_embeds(tiny_llama, IDS[0])
    nan = good.clone()
    nan[2, 3] = float("nan")
    cases = {
        "not enabled": (None, "not enabled"),
        "hidden size": (torch.zeros(3, 7), "hidden size 7"),
        "rank": (torch.zeros(2, 3, 64), r"shape \[seq_len, hidden_size\]"),
        "empty": (torch.zeros(0, 64), "empty"),
        "nan": (nan, "non-finite"),
        "ints": (torch.zeros(3, 64, dtype=torch.long), "floating"),
        "too long": (torch.zeros(4000, 64), "exceeds max_model_len"),
        "fp16 overflow": (torch.full((2, 64), 1e30), "out of the range"),
    }
    plain = LLM(str(tiny_llama), num_kv_blocks=8)
    half = LLM(str(tiny_llama), enable_prompt_embeds=True, num_kv_blocks=8, dtype="float16")
    for name, (value, message) in cases.items():
        target = plain if value is None else half if name == "fp16 overflow" else llm
        with pytest.raises(ValueError, match=message):
            target.generate({"prompt_embeds": good if value is None else value}, PARAMS)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate({"prompt_embeds": good}, SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert llm.engine.requests == {} or all(r.is_finished for r in llm.engine.requests.values())


def test_lora(tiny_llama: Path, tmp_path: Path) -> None:
    """An adapter applies to the layers: embeddings of ids run with it give the ids' tokens."""
    adapter = build_lora_adapter(tmp_path / "a", tiny_llama, seed=1, rank=8, alpha=16)
    llm = LLM(str(tiny_llama), enable_prompt_embeds=True, enable_lora=True, num_kv_blocks=64)
    lora = LoRARequest("a", 1, str(adapter))
    want = tokens(llm.generate({"prompt_token_ids": IDS[1]}, PARAMS, lora_request=lora))
    got = tokens(llm.generate({"prompt_embeds": hf_embeds(tiny_llama, IDS[1])}, PARAMS, lora_request=lora))
    assert got == want
    assert want != tokens(llm.generate({"prompt_token_ids": IDS[1]}, PARAMS))


@pytest.mark.parametrize(
    "name", ["tiny_gemma2", "tiny_gemma3", "tiny_olmo2", "tiny_deepseek", "tiny_gpt_oss"]
)
def test_model_families(name: str, request: pytest.FixtureRequest) -> None:
    """Each family's embeddings are transformers' input embeddings (Gemma's include its
    sqrt(hidden) factor, as transformers' scaled embedding layer does)."""
    path = request.getfixturevalue(name)
    embeds = hf_embeds(path, IDS[0])
    llm = LLM(str(path), enable_prompt_embeds=True, num_kv_blocks=32)
    want = tokens(llm.generate({"prompt_token_ids": IDS[0]}, PARAMS))
    assert tokens(llm.generate({"prompt_embeds": embeds}, PARAMS)) == want
    assert want == [hf_generate(path, embeds)]


def test_saved_tensor_round_trip() -> None:
    from engine.prompt_embeds import load_prompt_embeds

    buf = io.BytesIO()
    torch.save(torch.ones(2, 3), buf)
    assert torch.equal(load_prompt_embeds(buf.getvalue()), torch.ones(2, 3))
    buf = io.BytesIO()
    torch.save({"x": torch.ones(1)}, buf)
    with pytest.raises(ValueError, match="must hold a tensor, not a dict"):
        load_prompt_embeds(buf.getvalue())
    with pytest.raises(ValueError, match="not a torch.save'd tensor"):
        load_prompt_embeds(b"not a zip")


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
        "draft",
    ],
)
def test_speculative_decoding_keeps_the_tokens(tiny_llama: Path, llm: LLM, spec) -> None:
    """Drafts (n-gram lookups over placeholders, or a draft model reading them) are verified
    against the target's embeddings forward: the tokens are those without drafts."""
    if spec == "draft":
        spec = {"model": str(tiny_llama), "num_speculative_tokens": 3}
    prompts = [{"prompt_embeds": hf_embeds(tiny_llama, ids)} for ids in IDS]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    want = tokens(llm.generate(prompts, params))
    spec_llm = LLM(str(tiny_llama), enable_prompt_embeds=True, num_kv_blocks=64, speculative_config=spec)
    assert tokens(spec_llm.generate(prompts, params)) == want
    assert spec_llm.engine.spec_drafts > 0
