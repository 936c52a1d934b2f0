"""vLLM's own fp8 format without ``weight_block_size`` (AutoFP8, older llm-compressor exports): each
quantized linear stores ``weight`` in float8_e4m3fn and a ``weight_scale`` per tensor or per output
channel (static activations add an ``input_scale``, dropped). Dequantized at load, a checkpoint
serves exactly what its weights dequantized by hand serve, and that agrees with transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.models.quantized import WeightQuant, dequantize

IGNORED = "model.layers.0.mlp.down_proj"  # listed in ignored_layers: stored unquantized


def _quantize(w: torch.Tensor, strategy: str, shape_variant: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale) with the tensor's (or each row's) largest magnitude at fp8's 448. The
    scale's stored shape varies as exporters' do: [] or [1] per tensor, [out] or [out, 1] per row."""
    if strategy == "tensor":
        scale = w.abs().max() / 448.0
        stored = scale.reshape([] if shape_variant % 2 else [1])
    else:
        scale = w.abs().amax(dim=1, keepdim=True) / 448.0
        stored = scale.reshape(-1) if shape_variant % 2 else scale
    return (w / scale).to(torch.float8_e4m3fn), stored.float()


@pytest.fixture(scope="module", params=["tensor", "channel"])
def checkpoints(request, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the fp8 checkpoint, the same weights dequantized in fp32)."""
    strategy = request.param
    root = tmp_path_factory.mktemp(f"fp8_{strategy}")
    fp8_dir, ref_dir = root / "fp8", root / "dequantized"
    for d in (fp8_dir, ref_dir):
        shutil.copytree(tiny_llama, d)
        (d / "model.safetensors").unlink()
    weights = load_file(str(tiny_llama / "model.safetensors"))
    quantized, reference = {}, {}
    for i, (name, w) in enumerate(sorted(weights.items())):
        prefix = name.removesuffix(".weight")
        if name.endswith("_proj.weight") and prefix != IGNORED:
            q, s = _quantize(w, strategy, i)
            quantized[name], quantized[prefix + ".weight_scale"] = q, s
            quantized[prefix + ".input_scale"] = torch.tensor(0.02)  # static activations: dropped
            reference[name] = q.float() * s.reshape(-1, 1)
        else:
            quantized[name] = reference[name] = w
    save_file(quantized, str(fp8_dir / "model.safetensors"))
    save_file(reference, str(ref_dir / "model.safetensors"))
    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "static",
        "ignored_layers": [IGNORED, "lm_head"],
    }
    (fp8_dir / "config.json").write_text(json.dumps(cfg))
    return fp8_dir, ref_dir


def test_fp8_checkpoint_serves_its_dequantized_weights_exactly(checkpoints, prompts, hf_reference) -> None:
    fp8_dir, ref_dir = checkpoints
    a = "model.layers.1.self_attn."
    stored = load_file(str(fp8_dir / "model.safetensors"))
    # q, k and v each have their own scales: each is dequantized before the model fuses them.
    assert len({float(stored[a + p + "_proj.weight_scale"].flatten()[0]) for p in "qkv"}) == 3
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    with LLM(str(fp8_dir), num_kv_blocks=64, num_threads=1) as llm:
        assert llm.engine.model_runner.model_config.quant_method == "fp8"
        fp8 = llm.generate(prompts[2:5], params)
    with LLM(str(ref_dir), num_kv_blocks=64, num_threads=1) as llm:
        ref = llm.generate(prompts[2:5], params)
    for prompt, x, y in zip(prompts[2:5], fp8, ref, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in s.items()} for s in x.outputs[0].logprobs] == [
            {t: lp.logprob for t, lp in s.items()} for s in y.outputs[0].logprobs
        ]
        hf_tokens, hf_logits = hf_reference(ref_dir, prompt, 6)
        assert x.outputs[0].token_ids == hf_tokens
        hf_lp = torch.log_softmax(hf_logits, dim=-1)
        for step, (tok, entry) in enumerate(zip(hf_tokens, x.outputs[0].logprobs, strict=True)):
            assert abs(entry[tok].logprob - hf_lp[step, tok].item()) < 1e-4


def test_dequantize_per_tensor_and_per_channel() -> None:
    quant = WeightQuant(method="fp8", bits=8)
    weight = torch.tensor([[1.0, -2.0, 0.5], [4.0, 3.0, -1.5]]).to(torch.float8_e4m3fn)
    assert dequantize("m", {"weight": weight, "weight_scale": torch.tensor(0.5)}, quant).tolist() == [
        [0.5, -1.0, 0.25],
        [2.0, 1.5, -0.75],
    ]
    channel = {"weight": weight, "weight_scale": torch.tensor([2.0, 0.25]), "input_scale": torch.tensor(1.0)}
    assert dequantize("m", channel, quant).tolist() == [[2.0, -4.0, 1.0], [1.0, 0.75, -0.375]]
    assert dequantize("m", {"input_scale": torch.tensor(1.0)}, quant) is None  # no weight here
    with pytest.raises(ValueError, match="do not fit a 2x3 weight"):
        dequantize("m", {"weight": weight, "weight_scale": torch.ones(3)}, quant)
    with pytest.raises(ValueError, match="m has no m.weight_scale"):
        dequantize("m", {"weight": weight}, quant)


def test_fp8_in_another_format_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    d = tmp_path / "e5m2"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e5m2", "activation_scheme": "dynamic"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="fp8 checkpoints in format 'e5m2' are not supported"):
        LLM(str(d))
