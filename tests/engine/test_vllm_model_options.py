"""vLLM's model-loading options as ``LLM(model, **options)`` takes them: ``tokenizer`` (another
directory's tokenizer), ``hf_overrides`` (merged over config.json), ``quantization`` (checked against
the checkpoint) and ``load_format="dummy"`` (random weights, no weight file read)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models.config import read_hf_config
from engine.models.loader import weights_id

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def split_checkpoint(src: Path, root: Path) -> tuple[Path, Path]:
    """(model directory without tokenizer files, directory with only those) from ``src``."""
    model, tokenizer = root / f"{src.name}-model", root / f"{src.name}-tokenizer"
    shutil.copytree(src, model)
    tokenizer.mkdir()
    for name in TOKENIZER_FILES:
        if (model / name).exists():
            shutil.move(model / name, tokenizer / name)
    assert not (model / "tokenizer.json").exists() and (tokenizer / "tokenizer.json").exists()
    return model, tokenizer


def test_tokenizer_from_another_directory(tiny_llama: Path, tmp_path: Path) -> None:
    model, tokenizer = split_checkpoint(tiny_llama, tmp_path)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json.*--tokenizer DIR"):
        LLM(str(model), num_kv_blocks=32)
    whole = LLM(str(tiny_llama), num_kv_blocks=32)
    split = LLM(str(model), tokenizer=str(tokenizer), num_kv_blocks=32)
    chat = [{"role": "user", "content": "hello there"}]
    assert split.engine.tokenizer.encode_chat(chat) == whole.engine.tokenizer.encode_chat(chat)
    assert split.engine.eos_token_ids == whole.engine.eos_token_ids
    prompts = ["the quick brown fox", "def main():"]
    a, b = whole.generate(prompts, GREEDY), split.generate(prompts, GREEDY)
    assert [o.outputs[0].text for o in a] == [o.outputs[0].text for o in b]
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_tokenizer_modes_other_than_the_fast_one_are_refused_by_name() -> None:
    assert EngineConfig(tokenizer_mode="hf").tokenizer_mode == "hf"
    for mode in ("slow", "mistral"):
        with pytest.raises(ValueError, match=f"tokenizer_mode '{mode}' is not supported.*tokenizer.json"):
            EngineConfig(tokenizer_mode=mode)


def test_hf_overrides_merge_over_config_json(tiny_llama: Path, tiny_gemma3_mm: Path) -> None:
    raw = read_hf_config(
        tiny_llama, {"max_position_embeddings": 64, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    )
    assert raw["max_position_embeddings"] == 64 and raw["rope_scaling"] == {
        "rope_type": "linear",
        "factor": 2.0,
    }
    # A sub-config is updated key by key (vLLM's nested PretrainedConfig); other objects replace.
    text = json.loads((tiny_gemma3_mm / "config.json").read_text())["text_config"]
    merged = read_hf_config(tiny_gemma3_mm, {"text_config": {"max_position_embeddings": 96}})["text_config"]
    assert merged == {**text, "max_position_embeddings": 96}
    # The weights' identity (and so the KV tier's fingerprint) covers the overrides.
    assert weights_id(tiny_llama, {"max_position_embeddings": 64}) != weights_id(tiny_llama)
    assert weights_id(tiny_llama, {}) == weights_id(tiny_llama)


def test_hf_overrides_shrink_the_context(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), hf_overrides={"max_position_embeddings": 64}, num_kv_blocks=32)
    assert llm.engine.max_model_len == 64
    text = LLM(str(tiny_llama), hf_overrides='{"max_position_embeddings": 64}', num_kv_blocks=32)
    assert text.engine.max_model_len == 64
    with pytest.raises(ValueError, match="more than the 64 positions"):
        LLM(str(tiny_llama), hf_overrides={"max_position_embeddings": 64}, max_model_len=128)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{max_position_embeddings: 64}", "hf_overrides is not valid JSON"),
        ("[1, 2]", "hf_overrides must be a JSON object, got list"),
        (7, "hf_overrides must be a JSON object, got int"),
    ],
)
def test_bad_hf_overrides_are_refused(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(hf_overrides=value)


def _with_quant_config(src: Path, dst: Path, quant: dict) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    return dst


def test_quantization_must_name_the_checkpoints_method(tiny_llama: Path, tmp_path: Path) -> None:
    # Its weights are plain, but its config declares GPTQ: the check reads the declaration.
    gptq = _with_quant_config(
        tiny_llama, tmp_path / "gptq", {"quant_method": "gptq", "bits": 4, "group_size": 32}
    )
    for name in ("gptq", "gptq_marlin"):
        assert LLM(str(gptq), quantization=name, num_kv_blocks=8).engine.model_config.quant_method == "gptq"
    with pytest.raises(ValueError, match=r"--quantization awq does not match the checkpoint, quantized with "
                       r"quantization_config.quant_method='gptq'; pass --quantization gptq"):  # fmt: skip
        LLM(str(gptq), quantization="awq")
    with pytest.raises(ValueError, match="--quantization gptq: the checkpoint is not quantized"):
        LLM(str(tiny_llama), quantization="gptq")
    with pytest.raises(
        ValueError, match="--quantization fp8 on an unquantized checkpoint asks for vLLM's online"
    ):
        LLM(str(tiny_llama), quantization="fp8")
    with pytest.raises(ValueError, match="quantization 'bitsandbytes' is not supported"):
        EngineConfig(quantization="bitsandbytes")


def test_dummy_load_format_reads_no_weights(tiny_llama: Path, tiny_qwen3_moe: Path, tmp_path: Path) -> None:
    for src in (tiny_llama, tiny_qwen3_moe):
        bare = tmp_path / src.name
        shutil.copytree(src, bare, ignore=shutil.ignore_patterns("*.safetensors"))
        with pytest.raises(ValueError, match="no \\*.safetensors weights"):
            LLM(str(bare), num_kv_blocks=8)
        one = LLM(str(bare), load_format="dummy", num_kv_blocks=8).generate(["hello"], GREEDY)
        again = LLM(str(bare), load_format="dummy", num_kv_blocks=8).generate(["hello"], GREEDY)
        assert len(one[0].outputs[0].token_ids) == 6
        assert one[0].outputs[0].token_ids == again[0].outputs[0].token_ids  # a fixed seed
        # Not the checkpoint's weights, whatever the directory holds, and never taken for them.
        full = LLM(str(src), load_format="safetensors", num_kv_blocks=8)
        assert full.generate(["hello"], GREEDY)[0].outputs[0].token_ids != one[0].outputs[0].token_ids
        assert weights_id(bare, dummy=True) != full.engine.model_runner.weights_id
    with pytest.raises(ValueError, match="load_format 'pt' is not supported"):
        EngineConfig(load_format="pt")


def test_dummy_load_format_granite_moe(tiny_granitemoe: Path) -> None:
    """Granite-MoE's dummy weights carry transformers' in-memory names (experts.gate_up_proj and
    router.weight, not the checkpoint's input_linear and router.layer): the MoE block is found by them."""
    llm = LLM(str(tiny_granitemoe), load_format="dummy", num_kv_blocks=8)
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids) == 6
