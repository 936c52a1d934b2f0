"""Vision-language checkpoints served text-only (engine/models/vision_text.py): Mistral 3, Qwen2-VL,
Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE, each a tiny checkpoint with a real vision tower, against
transformers 5's ``*ForConditionalGeneration`` on text-only input ids (fp32): greedy tokens equal and
logprobs within 1e-4, solo and batched, in small chunks over small blocks and behind a prefix-cache
hit, on the Triton path, with LoRA; M-RoPE checked to be ordinary rotary for text against
transformers' own rotary classes; every layout and config spelling these checkpoints come in.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

from engine import LLM, LoRARequest, SamplingParams  # noqa: E402
from engine.demo import build_lora_adapter  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.models.rope import build_cos_sin_cache  # noqa: E402
from tests.engine.arch_checks import (  # noqa: E402
    assert_matches,
    check_solo_batched_chunked_cached,
    check_triton_path,
    tiny_model_fixtures,
)
from tests.engine.test_lora import merged_checkpoint  # noqa: E402

MAX_NEW = 10
# Fixture name -> (engine.demo.build_model architecture, seed); engine/demo_archs_textonly.py says
# what each tiny shape exercises.
TEXT_ONLY = {
    "tiny_mistral3": ("mistral3", 70),
    "tiny_ministral3_vl": ("ministral3_vl", 75),  # Ministral 3 as released: position-scaled queries
    "tiny_qwen2_vl": ("qwen2_vl", 71),
    "tiny_qwen2_5_vl": ("qwen2_5_vl", 72),
    "tiny_qwen3_vl": ("qwen3_vl", 73),
    "tiny_qwen3_vl_moe": ("qwen3_vl_moe", 74),
}


tiny_model_fixtures(TEXT_ONLY, globals())


@functools.lru_cache(maxsize=4)
def _hf_model(path: str):  # noqa: ANN202 - a transformers model
    import transformers

    arch = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    cls = getattr(transformers, arch)
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def reference(path: Path, prompt: list[int], max_new: int = MAX_NEW) -> tuple[list[int], torch.Tensor]:
    """The ConditionalGeneration model's greedy tokens on text-only ids (EOS ignored) and raw logits."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = _hf_model(str(path)).generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


def _logprobs(out) -> list[float]:  # noqa: ANN001
    return [e[t].logprob for t, e in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)


def test_checkpoints_hold_a_vision_tower_that_is_not_read(tiny_mistral3: Path, tiny_qwen3_vl: Path) -> None:
    from safetensors import safe_open

    from engine.models.loader import load_weights
    from engine.models.vision_text import VisionTextForCausalLM

    for path, arch, tower in (
        (tiny_mistral3, "Mistral3ForConditionalGeneration", "vision_tower."),
        (tiny_qwen3_vl, "Qwen3VLForConditionalGeneration", "model.visual."),
    ):
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            stored = list(f.keys())  # noqa: SIM118 (safe_open is not a mapping)
        assert any(k.startswith(tower) for k in stored)
        renames = VisionTextForCausalLM.WEIGHT_RENAMES[arch]
        loaded = load_weights(path, torch.float32, torch.device("cpu"), renames=renames)
        assert all(
            k.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")) for k in loaded
        )
        assert len(loaded) == sum("language_model" in k or k == "lm_head.weight" for k in stored)


@pytest.mark.parametrize("model_fixture", list(TEXT_ONLY))
def test_greedy_matches_transformers_solo_batched_chunked_and_cached(
    model_fixture: str, prompts, request
) -> None:
    check_solo_batched_chunked_cached(request.getfixturevalue(model_fixture), prompts, reference, MAX_NEW)


@pytest.mark.parametrize("model_fixture", ["tiny_qwen2_5_vl", "tiny_qwen3_vl_moe"])
def test_triton_path_matches_transformers(model_fixture: str, prompts, request) -> None:
    """Triton attention (Qwen2.5-VL's window), rotary, q/k norm and the grouped MoE matmuls under the
    interpreter, chunked over blocks of 16."""
    check_triton_path(request.getfixturevalue(model_fixture), prompts, reference)


def test_qwen2_5_vl_window_is_applied(tiny_qwen2_5_vl: Path, prompts) -> None:
    """Layer 1 slides (window 8): without it the 64-token prompt's answer differs, so the match
    above holds the window to transformers'."""
    assert ModelConfig.from_dir(tiny_qwen2_5_vl).layer_windows == (None, 8)
    overrides = {"text_config": {"use_sliding_window": False}}
    windowless = LLM(str(tiny_qwen2_5_vl), num_kv_blocks=64, hf_overrides=overrides)
    assert windowless.engine.model_config.layer_windows == (None, None)
    out = windowless.generate([prompts[6]], GREEDY)[0].outputs[0]
    tokens, logits = reference(tiny_qwen2_5_vl, prompts[6])
    first = torch.log_softmax(logits[0], dim=-1)[out.token_ids[0]].item()
    assert out.token_ids != tokens or abs(out.logprobs[0][out.token_ids[0]].logprob - first) > 1e-3


@pytest.mark.parametrize(
    ("arch", "rotary", "rope"),
    [
        ("Qwen2VL", "qwen2_vl.modeling_qwen2_vl.Qwen2VLRotaryEmbedding", {"type": "mrope"}),
        ("Qwen2VL", "qwen2_vl.modeling_qwen2_vl.Qwen2VLRotaryEmbedding", {"rope_type": "default"}),
        (
            "Qwen2_5_VL",
            "qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLRotaryEmbedding",
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        ),
        ("Qwen3VL", "qwen3_vl.modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding", {"rope_type": "default"}),
        (
            "Qwen3VLMoe",
            "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeTextRotaryEmbedding",
            {"rope_type": "default", "mrope_interleaved": True},
        ),
    ],
)
def test_mrope_of_text_positions_is_ordinary_rotary(arch: str, rotary: str, rope: dict) -> None:
    """transformers' M-RoPE, given a text token's three equal position ids, yields ferry's ordinary
    rotary table of the config ferry reads (sections [4, 2, 2] of a 16-dim head; YaRN included)."""
    import importlib

    module, cls_name = rotary.rsplit(".", 1)
    rotary_cls = getattr(importlib.import_module(f"transformers.models.{module}"), cls_name)
    sizes = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    rope = {**rope, "rope_theta": 5000.0, "mrope_section": [4, 2, 2]}
    text = {**sizes, "vocab_size": 100, "intermediate_size": 64, "num_hidden_layers": 1}
    text["max_position_embeddings"] = 256  # YaRN's factor 4 over 64 positions
    # The rope under its transformers 4 name when it has the old "type" key, else transformers 5's.
    text["rope_scaling" if "type" in rope else "rope_parameters"] = rope
    hf_config = getattr(importlib.import_module("transformers"), f"{arch}Config")(text_config=dict(text))
    hf_rotary = rotary_cls(hf_config.text_config)
    positions = torch.arange(200).view(1, 1, -1).expand(3, 1, -1)
    cos, sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions)
    ours = ModelConfig.from_dict({"architectures": [f"{arch}ForConditionalGeneration"], "text_config": text})
    if rope.get("rope_type") == "yarn":
        assert ours.rope_scaling is not None and ours.rope_scaling["rope_type"] == "yarn"
        assert not any(k.startswith("mrope") for k in ours.rope_scaling)
    else:  # "mrope" and "default" alike: plain rotary
        assert ours.rope_scaling is None
    assert ours.rope_theta == 5000.0
    table = build_cos_sin_cache(16, 200, ours.rope_theta, ours.rope_scaling, torch.device("cpu"))
    torch.testing.assert_close(cos[0], torch.cat([table[:, :8], table[:, :8]], dim=-1), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0], torch.cat([table[:, 8:], table[:, 8:]], dim=-1), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("model_fixture", "targets"),
    [
        ("tiny_mistral3", None),  # transformers 4's language_model.model. names, attention and MLP
        ("tiny_qwen3_vl", ("q_proj", "k_proj", "v_proj", "o_proj")),  # model.language_model. names
    ],
)
def test_adapter_matches_transformers_merged(model_fixture: str, targets, prompts, request, tmp_path) -> None:
    path = request.getfixturevalue(model_fixture)
    kwargs = {} if targets is None else {"targets": targets}
    adapter = build_lora_adapter(tmp_path / "adapter", path, seed=7, rank=8, alpha=32, **kwargs)
    merged = merged_checkpoint(path, adapter, tmp_path / "merged")
    llm = LLM(str(path), enable_lora=True, num_kv_blocks=128, max_num_batched_tokens=512)
    lora = LoRARequest("x", 1, str(adapter))
    chosen = [prompts[i] for i in (2, 3, 4, 5)]
    loras = [lora, None, lora, None]  # the adapter and the base model in one batch
    outs = llm.generate(chosen, GREEDY, lora_request=loras)
    changed = 0
    for prompt, out, used in zip(chosen, outs, loras, strict=True):
        ref = reference(merged if used else path, prompt)
        assert_matches(out, *ref)
        changed += used is not None and ref[0] != reference(path, prompt)[0]
    assert changed == 2  # the adapter changed what the model says


def _rewrite(  # noqa: ANN001 - name, tensor, config: callables
    src: Path, dst: Path, name=lambda k: k, tensor=lambda k, t: t, config=lambda c: c
) -> Path:
    """A copy of checkpoint ``src`` with its tensors renamed / changed and its config.json rewritten."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    save_file(
        {name(k): tensor(k, t).contiguous() for k, t in weights.items()}, str(dst / "model.safetensors")
    )
    (dst / "config.json").write_text(json.dumps(config(json.loads((src / "config.json").read_text()))))
    return dst


def _flat_qwen2_vl(config: dict) -> dict:
    """transformers 4's Qwen2-VL config.json: the text settings at the top, the rope as ``mrope``."""
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**text, **config, "model_type": "qwen2_vl"}
    return {
        **flat,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    }


def _t5_names(k: str) -> str:
    """transformers 5's in-memory names of a checkpoint saved in transformers 4's layout."""
    for old, new in (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
        ("visual.", "model.visual."),
        ("model.", "model.language_model."),
    ):
        if k.startswith(old):
            return new + k[len(old) :]
    return k


def test_every_layout_and_config_spelling_gives_the_same_model(
    tiny_mistral3: Path, tiny_qwen2_vl: Path, tiny_qwen3_vl_moe: Path, prompts, tmp_path: Path
) -> None:
    """transformers 5's in-memory names, transformers 4's flat Qwen2-VL config.json, Qwen3-VL-MoE's
    released expert layout ([E, hidden, 2I] / [E, I, hidden]): each the same answer, bit for bit,
    and transformers' answer on that very checkpoint."""

    def hub_experts(k: str, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2) if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else t

    variants = [
        (tiny_mistral3, _rewrite(tiny_mistral3, tmp_path / "mistral3_t5", name=_t5_names)),
        (tiny_qwen2_vl, _rewrite(tiny_qwen2_vl, tmp_path / "qwen2_vl_t5", name=_t5_names)),
        (tiny_qwen2_vl, _rewrite(tiny_qwen2_vl, tmp_path / "qwen2_vl_flat", config=_flat_qwen2_vl)),
        (tiny_qwen3_vl_moe, _rewrite(tiny_qwen3_vl_moe, tmp_path / "qwen3_vl_moe_hub", tensor=hub_experts)),
    ]
    for original, variant in variants:
        # Deterministic numerics: two engines over the same weights agree to the bit.
        ours = LLM(str(variant), num_kv_blocks=32, deterministic=True).generate([prompts[4]], GREEDY)[0]
        base = LLM(str(original), num_kv_blocks=32, deterministic=True).generate([prompts[4]], GREEDY)[0]
        assert ours.outputs[0].token_ids == base.outputs[0].token_ids
        assert _logprobs(ours) == _logprobs(base)
        assert_matches(ours, *reference(variant, prompts[4]))


def test_tied_head_absent_from_the_checkpoint(tiny_qwen3_vl: Path, prompts, tmp_path: Path) -> None:
    """A tied checkpoint (Qwen2-VL 2B, Qwen3-VL 2B / 4B) stores no lm_head: the embeddings are the head."""
    tied = _rewrite(
        tiny_qwen3_vl,
        tmp_path / "qwen3_vl_tied",
        config=lambda c: {**c, "tie_word_embeddings": True},
    )
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tied / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(tied / "model.safetensors"))
    out = LLM(str(tied), num_kv_blocks=32).generate([prompts[4]], GREEDY)[0]
    assert_matches(out, *reference(tied, prompts[4]))


def test_offline_image_prompt_is_refused(tiny_qwen3_vl_moe: Path) -> None:
    """No vision tower is loaded, so an image prompt is refused (the server answers 400 for it)."""
    from PIL import Image

    llm = LLM(str(tiny_qwen3_vl_moe), num_kv_blocks=8)
    assert llm.engine.model_config.vision is None
    image = Image.new("RGB", (32, 32))
    with pytest.raises(ValueError, match=r"Qwen3VLMoeForConditionalGeneration\) takes text only"):
        llm.generate([{"prompt": "x", "multi_modal_data": {"image": image}}], GREEDY)


@pytest.mark.parametrize("model_fixture", list(TEXT_ONLY))
def test_dummy_weights_take_the_text_model(model_fixture: str, request, tmp_path: Path) -> None:
    """``--load-format dummy`` names transformers' in-memory tensors as the loader renames a checkpoint's."""
    src = request.getfixturevalue(model_fixture)
    bare = tmp_path / src.name
    shutil.copytree(src, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    out = LLM(str(bare), load_format="dummy", num_kv_blocks=8).generate([[5, 6, 7]], GREEDY)
    assert len(out[0].outputs[0].token_ids) == MAX_NEW
