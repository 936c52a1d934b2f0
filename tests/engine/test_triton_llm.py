"""The whole engine on the Triton path: ``LLM(..., attention_backend="triton")``.

Triton attention, KV writes, rms_norm, rotary and SiLU kernels (under the interpreter on a
machine without a GPU) must give the same greedy tokens as the torch backend, including across
chunked prefill, and in deterministic mode the same logprobs bit for bit after a prefix-cache hit
or beside other requests.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")

from engine import LLM, SamplingParams  # noqa: E402

# Block-boundary lengths (block_size 16): a single token, one past a block, and one long enough
# to be split into chunks by max_num_batched_tokens.
PROMPTS = [[7], [11 + (i * 37) % 900 for i in range(17)], [5 + (i * 53) % 950 for i in range(40)]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
OPTIONS = dict(block_size=16, num_kv_blocks=48, max_num_batched_tokens=24, max_num_seqs=8)


def run(model: Path, backend: str, prompts: list[list[int]], **extra: object) -> list[list[int]]:
    llm = LLM(str(model), attention_backend=backend, **OPTIONS, **extra)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]


# DeepSeek (V3 and V2): the latent attention kernel (engine/kernels/triton_mla.py), the Triton
# norm, rotary (one shared rotary key head) and SiLU kernels around it, and the fused experts
# (engine/kernels/triton_moe.py) with a shared one; Qwen3-MoE: the norm kernel
# on per-head q/k rows, and the fused experts; Mixtral and Qwen2-MoE (a gated shared expert): the
# fused experts; Phi-3: rotary on part of a head;
# Gemma 3: sliding and full layers with two rotary tables; Gemma 2: soft-capped scores (the torch
# attention under the Triton backend).
@pytest.mark.parametrize(
    "fixture",
    [
        "tiny_llama",
        "tiny_qwen2",
        "tiny_deepseek",
        "tiny_deepseek_v2",
        "tiny_qwen3_moe",
        "tiny_mixtral",
        "tiny_qwen2_moe",
        "tiny_phi3",
        "tiny_gemma3",
        "tiny_gemma2",
    ],
)
def test_triton_greedy_tokens_match_torch_backend(fixture: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(fixture)
    expected = run(model, "torch", PROMPTS)
    assert run(model, "triton", PROMPTS) == expected
    assert all(len(t) == 6 for t in expected)


# DeepSeek: the latent attention and fused MoE kernels keep the promise too.
@pytest.mark.parametrize("fixture", ["tiny_llama3_rope", "tiny_deepseek"])
def test_triton_deterministic_mode_is_exact_across_prefix_hits_and_batches(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    model_dir = request.getfixturevalue(fixture)
    llm = LLM(str(model_dir), attention_backend="triton", deterministic=True, **OPTIONS)
    model = llm.engine.model_runner.model
    assert model.attention.name == "triton" and model.ops.name == "triton" and model.attention.deterministic
    prompt = PROMPTS[2]

    def logprobs(outs) -> list[tuple[int, float]]:  # noqa: ANN001
        o = outs.outputs[0]
        return [(t, lp[t].logprob) for t, lp in zip(o.token_ids, o.logprobs, strict=True)]

    alone = logprobs(llm.generate([prompt], GREEDY)[0])
    # Same prompt again: its first two blocks now come from the prefix cache, 8 tokens are new.
    again = logprobs(llm.generate([prompt], GREEDY)[0])
    # Beside other requests (a different batch shape at every step).
    batched = logprobs(llm.generate([PROMPTS[0], prompt, PROMPTS[1]], GREEDY)[1])
    assert again == alone and batched == alone
    assert [t for t, _ in alone] == run(model_dir, "torch", [prompt], deterministic=True)[0]
