"""Phi-3's longrope (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini) against transformers 5 on a tiny fp32
``Phi3ForCausalLM`` (partial rotary: 12 of 16 dims, 6 frequencies) whose original context is 32 of
128 positions, with short and long factors that differ per frequency. Below the original length
ferry and transformers agree exactly; from there on ferry's rows take the long factors (vLLM's
per-position choice, see ``engine/models/rope.longrope_cache``), checked against transformers' own
``_compute_longrope_parameters``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

from engine import LLM, SamplingParams  # noqa: E402
from engine.demo import build_model  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from tests.engine.test_arch_llama4 import GREEDY, MAX_NEW, _check, _rewrite  # noqa: E402

ORIGINAL, MAX_POSITIONS = 32, 128
SHORT_FACTOR = [1.0, 1.3, 2.1, 3.4, 5.0, 7.7]
LONG_FACTOR = [1.1, 2.6, 4.2, 9.3, 17.0, 31.5]
LONGROPE = {"rope_type": "longrope", "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR}


@pytest.fixture(scope="module")
def tiny_longrope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers 5's spelling: the factors in ``rope_parameters``, the original length top-level."""
    root = tmp_path_factory.mktemp("longrope")
    base = build_model(root / "base", "phi3", seed=12, max_position_embeddings=MAX_POSITIONS)
    rope = json.loads((base / "config.json").read_text())["rope_parameters"]
    return _rewrite(
        base,
        root / "m",
        original_max_position_embeddings=ORIGINAL,
        rope_parameters={**rope, **LONGROPE},
    )


@pytest.fixture(scope="module")
def lr_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """1, 5, 16 and 17 tokens: with MAX_NEW more, every position stays below the original 32."""
    chosen = [prompts[i] for i in (0, 2, 3, 4)]
    assert max(len(p) for p in chosen) + MAX_NEW <= ORIGINAL
    return chosen


def _hf_tables(path: Path) -> tuple[torch.Tensor, torch.Tensor, float]:
    """transformers' short and long frequencies and its attention factor for the checkpoint."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(path)
    short, scale = ROPE_INIT_FUNCTIONS["longrope"](config)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=ORIGINAL + 1)
    return short, long, scale


def test_config_resolves_as_transformers_does(tiny_longrope, tmp_path) -> None:
    """The attention factor from max/original (128 / 32), the original length top-level; the released
    checkpoints' spelling (``rope_scaling`` with ``type``, and Phi-3-mini-128k's old "su") alike."""
    expected = math.sqrt(1 + math.log(4) / math.log(32))
    assert _hf_tables(tiny_longrope)[2] == pytest.approx(expected, rel=1e-12)
    cfg = ModelConfig.from_dir(tiny_longrope)
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(expected, rel=1e-12)
    assert cfg.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    keys = (
        "rope_type",
        "short_factor",
        "long_factor",
        "original_max_position_embeddings",
        "attention_factor",
    )
    for kind in ("longrope", "su"):
        released = {"type": kind, "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR}
        other = ModelConfig.from_dir(_rewrite(tiny_longrope, tmp_path / kind, rope_scaling=released))
        assert [other.rope_scaling[k] for k in keys] == [cfg.rope_scaling[k] for k in keys]
    given = {**LONGROPE, "attention_factor": 1.25}
    ours = ModelConfig.from_dir(_rewrite(tiny_longrope, tmp_path / "given", rope_parameters=given))
    assert ours.rope_scaling["attention_factor"] == 1.25


def test_table_switches_to_the_long_factors_at_the_original_length(tiny_longrope) -> None:
    """The engine's table, row by row, against cos/sin of transformers' frequencies: the short ones
    below position 32, the long ones from 32 to the end (which transformers would take for every
    position of a sequence past 32)."""
    short, long, scale = _hf_tables(tiny_longrope)
    llm = LLM(str(tiny_longrope), num_kv_blocks=16)
    table = llm.engine.model_runner.model.cos_sin[0]
    assert table.shape == (MAX_POSITIONS, 12)

    def rows(freqs: torch.Tensor, positions: range) -> torch.Tensor:
        angles = torch.tensor(list(positions), dtype=torch.float32)[:, None] * freqs[None, :]
        return torch.cat((angles.cos() * scale, angles.sin() * scale), dim=-1)

    assert torch.equal(table[:ORIGINAL], rows(short, range(ORIGINAL)))
    assert torch.equal(table[ORIGINAL:], rows(long, range(ORIGINAL, MAX_POSITIONS)))
    assert not torch.allclose(table[ORIGINAL:], rows(short, range(ORIGINAL, MAX_POSITIONS)), atol=1e-3)


def test_bad_factors_are_refused_by_name(tiny_longrope, tmp_path) -> None:
    cases = {
        "short_factor": {**LONGROPE, "short_factor": SHORT_FACTOR[:3]},
        "long_factor": {k: v for k, v in LONGROPE.items() if k != "long_factor"},
    }
    for field, rope in cases.items():
        with pytest.raises(ValueError, match=field):
            LLM(str(_rewrite(tiny_longrope, tmp_path / field, rope_parameters=rope)), num_kv_blocks=16)


def test_the_factors_change_the_transformers_answer(tiny_longrope, lr_prompts, hf_model, tmp_path) -> None:
    """With plain rope the same weights answer otherwise, so the matches below mean ferry computes the
    short factors and the attention factor."""
    prompt = torch.tensor([lr_prompts[-1]])
    plain = _rewrite(tiny_longrope, tmp_path / "plain", rope_parameters={"rope_type": "default"})
    with torch.no_grad():
        ours = hf_model(tiny_longrope)(prompt).logits[0].log_softmax(-1)
        other = hf_model(plain)(prompt).logits[0].log_softmax(-1)
    assert (other - ours).abs().max().item() > 1e-2


def test_greedy_matches_transformers_solo_and_batched(tiny_longrope, lr_prompts, hf_reference) -> None:
    llm = LLM(str(tiny_longrope), num_kv_blocks=64, max_num_batched_tokens=256)
    _check([llm.generate([p], GREEDY)[0] for p in lr_prompts], tiny_longrope, lr_prompts, hf_reference)
    _check(llm.generate(lr_prompts, GREEDY), tiny_longrope, lr_prompts, hf_reference)
    llm.engine.block_manager.check_integrity()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunked_prefill_and_prefix_hits_match_transformers(backend, tiny_longrope, lr_prompts, hf_reference):
    """8-token chunks over 4-token blocks, then a prompt sharing its first 16 tokens with the first,
    served from the prefix cache."""
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")
    opts = dict(attention_backend=backend, block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    llm = LLM(str(tiny_longrope), **opts)
    first, second = lr_prompts[3], lr_prompts[3][:16] + lr_prompts[1]
    for prompt, cached in ((first, 0), (second, 16)):
        out = llm.generate([prompt], GREEDY)[0]
        assert out.num_cached_tokens == cached
        _check([out], tiny_longrope, [prompt], hf_reference)
    llm.engine.block_manager.check_integrity()


def test_past_the_original_length_and_dummy_weights(tiny_longrope, lr_prompts) -> None:
    """A request that runs from below 32 to past it completes, batched or not alike; dummy weights
    (transformers' class on the meta device) load with longrope too."""
    llm = LLM(str(tiny_longrope), num_kv_blocks=64, deterministic=True)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate([lr_prompts[3]], params)[0].outputs[0].token_ids
    batched = llm.generate(lr_prompts[:2] + [lr_prompts[3]], params)[2].outputs[0].token_ids
    assert len(alone) == 24 and batched == alone
    dummy = LLM(str(tiny_longrope), load_format="dummy", num_kv_blocks=16)
    out = dummy.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3
