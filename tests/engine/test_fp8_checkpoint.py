"""Block-wise fp8 checkpoints (DeepSeek-V3/R1's and Qwen3-FP8's format): weights in float8_e4m3fn,
one ``weight_scale_inv`` per block, dequantized at load. A checkpoint quantized here serves exactly
what the same weights dequantized by hand serve; other quantizations are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.models.loader import dequantize_fp8

BLOCK = (16, 16)  # the tiny model's 24-row kv_a_proj_with_mqa ends in a partial block


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale per block) with each block's largest magnitude at fp8's 448."""
    rows, cols = w.shape
    scale = torch.empty(-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rs, cs = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
            s = w[rs, cs].abs().max().clamp(min=1e-12) / 448.0
            q[rs, cs] = (w[rs, cs] / s).to(torch.float8_e4m3fn)
            scale[i, j] = s
    return q, scale


@pytest.fixture(scope="module")
def checkpoints(tiny_deepseek: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the fp8 checkpoint in two shards, the same weights dequantized in fp32)."""
    root = tmp_path_factory.mktemp("fp8")
    fp8_dir, ref_dir = root / "fp8", root / "dequantized"
    for d in (fp8_dir, ref_dir):
        shutil.copytree(tiny_deepseek, d)
        (d / "model.safetensors").unlink()
    weights = load_file(str(tiny_deepseek / "model.safetensors"))
    quantized, scales, reference = {}, {}, {}
    for name, w in weights.items():
        if name.endswith("_proj.weight"):  # every linear but the router and lm_head, as DeepSeek ships
            q, s = _quantize(w)
            quantized[name], scales[name + "_scale_inv"] = q, s
            reference[name] = (
                q.float()
                * s.repeat_interleave(BLOCK[0], 0)[: w.shape[0]].repeat_interleave(BLOCK[1], 1)[
                    :, : w.shape[1]
                ]
            )
        else:
            quantized[name] = reference[name] = w
    assert len(scales) > 20
    save_file(quantized, str(fp8_dir / "model-00001-of-00002.safetensors"))
    save_file(scales, str(fp8_dir / "model-00002-of-00002.safetensors"))  # scales in another shard
    save_file(reference, str(ref_dir / "model.safetensors"))
    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    (fp8_dir / "config.json").write_text(json.dumps(cfg))
    return fp8_dir, ref_dir


def test_fp8_checkpoint_serves_its_dequantized_weights_exactly(checkpoints, prompts) -> None:
    fp8_dir, ref_dir = checkpoints
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    fp8 = LLM(str(fp8_dir), num_kv_blocks=128).generate(prompts[:6], params)
    ref = LLM(str(ref_dir), num_kv_blocks=128).generate(prompts[:6], params)
    for a, b in zip(fp8, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in step.items()} for step in a.outputs[0].logprobs] == [
            {t: lp.logprob for t, lp in step.items()} for step in b.outputs[0].logprobs
        ]


def test_dequantize_covers_partial_edge_blocks() -> None:
    weight = torch.full((24, 20), 2.0).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 3.0], [0.5, 0.25]])
    w = dequantize_fp8(weight, scale, BLOCK)
    assert w[:16, :16].unique().tolist() == [2.0] and w[:16, 16:].unique().tolist() == [6.0]
    assert w[16:, :16].unique().tolist() == [1.0] and w[16:, 16:].unique().tolist() == [0.5]
    with pytest.raises(ValueError, match="do not fit a 24x20 weight"):
        dequantize_fp8(weight, scale[:1], BLOCK)


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True},
            "quantization_config.quant_method='bitsandbytes'",
        ),
        ({"quant_method": "fp8", "weight_block_size": 128}, "fp8 weight_block_size=128"),
    ],
)
def test_other_quantizations_are_refused_by_name(
    tiny_deepseek, tmp_path: Path, quant: dict, message: str
) -> None:
    d = tmp_path / "quant"
    shutil.copytree(tiny_deepseek, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    with pytest.raises(ValueError, match=f"quantized checkpoints are not supported \\({message}"):
        LLM(str(d))
