"""GPT-2, OPT (pre- and post-norm), OLMoE and Nemotron against transformers on tiny fp32 checkpoints:
greedy tokens equal and logprobs within 1e-4, solo and batched, in small prefill chunks over small
blocks and behind a prefix-cache hit (learned positions continue where the cached prefix ends), on
the torch and the Triton path; hub-style tensor names, dummy weights, the position limit and the
config values ferry refuses; LoRA on the attention of OPT, OLMoE and Nemotron (GPT-2's refused by
name); batch invariance in deterministic mode."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

from engine import LLM, LoRARequest, SamplingParams  # noqa: E402
from engine.demo import build_lora_adapter, build_model  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from tests.engine.arch_checks import assert_matches, check_batched_solo_chunked_cached  # noqa: E402
from tests.engine.test_lora import merged_checkpoint  # noqa: E402

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
ARCHS = {"gpt2": 50, "opt": 51, "opt_post": 52, "olmoe": 53, "nemotron": 54}  # tiny model -> seed
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="session")
def learned_models(models_root: Path) -> dict[str, Path]:
    return {
        arch: build_model(models_root / f"learned_{arch}", arch, seed=seed) for arch, seed in ARCHS.items()
    }


def _check(out, prompt: list[int], path: Path, hf_reference) -> None:
    assert_matches(out, *hf_reference(path, prompt, MAX_NEW))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_transformers_solo_batched_chunked_and_after_a_prefix_hit(
    arch: str, learned_models, prompts, hf_reference
) -> None:
    check_batched_solo_chunked_cached(learned_models[arch], prompts, hf_reference, MAX_NEW)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_triton_path_gives_the_torch_path_tokens(arch: str, learned_models) -> None:
    """Triton attention (and norm, rotary, MoE kernels where the model has them), chunked prefill."""
    pytest.importorskip("triton", reason="triton is not installed")
    prompts = [[7], [11 + (i * 37) % 900 for i in range(17)], [5 + (i * 53) % 950 for i in range(40)]]
    options = dict(block_size=16, num_kv_blocks=48, max_num_batched_tokens=24, max_num_seqs=8)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(learned_models[arch]), attention_backend=backend, **options)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert tokens["triton"] == tokens["torch"]


def _renamed(src: Path, dst: Path, strip: str) -> Path:
    """A copy of ``src`` whose tensor names lose the prefix ``strip`` (the hub's original layout)."""
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(src / "model.safetensors"))
    save_file({k.removeprefix(strip): v for k, v in weights.items()}, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize(("arch", "strip"), [("gpt2", "transformer."), ("opt_post", "model.")])
def test_hub_tensor_names_and_dummy_weights_load(arch: str, strip: str, learned_models, prompts, tmp_path):
    """GPT-2's original files name ``h.0.attn…`` / ``wte``; OPT's ``decoder.layers…``: the same model.
    ``--load-format dummy`` takes the names from transformers' class: it loads and generates."""
    path = learned_models[arch]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = LLM(str(path), num_kv_blocks=64).generate([prompts[4]], params)[0].outputs[0].token_ids
    hub = LLM(str(_renamed(path, tmp_path / "hub", strip)), num_kv_blocks=64)
    assert hub.generate([prompts[4]], params)[0].outputs[0].token_ids == want
    dummy = LLM(str(path), load_format="dummy", num_kv_blocks=64)
    assert len(dummy.generate([prompts[4]], params)[0].outputs[0].token_ids) == 4


def test_learned_positions_bound_the_context(learned_models) -> None:
    """n_positions (GPT-2) and max_position_embeddings (OPT) are the served context; past them the
    embeddings have no row."""
    for arch in ("gpt2", "opt"):
        assert LLM(str(learned_models[arch]), num_kv_blocks=64).engine.max_model_len == 256
        with pytest.raises(ValueError, match="256 positions"):
            LLM(str(learned_models[arch]), num_kv_blocks=64, max_model_len=257)


def _config(path: Path, **changes: object) -> dict:
    return {**json.loads((path / "config.json").read_text()), **changes}


def test_config_values_not_served_exactly_are_refused(learned_models) -> None:
    gpt2, olmoe, nemotron = (learned_models[a] for a in ("gpt2", "olmoe", "nemotron"))
    with pytest.raises(ValueError, match="add_cross_attention"):
        ModelConfig.from_dict(_config(gpt2, add_cross_attention=True))
    with pytest.raises(ValueError, match="clip_qkv"):
        ModelConfig.from_dict(_config(olmoe, clip_qkv=8.0))
    with pytest.raises(ValueError, match="hidden_act 'gelu_10'"):
        LLM(str(gpt2), num_kv_blocks=64, hf_overrides={"activation_function": "gelu_10"})
    cfg = ModelConfig.from_dict(_config(gpt2))
    assert (cfg.hidden_size, cfg.num_layers, cfg.max_position_embeddings, cfg.hidden_act) == (
        64,
        2,
        256,
        "gelu_new",
    )
    assert cfg.absolute is not None and cfg.absolute.scale_by_inverse_layer
    cfg = ModelConfig.from_dict(_config(nemotron))
    assert (cfg.partial_rotary_factor, cfg.rms_norm_eps, cfg.hidden_act) == (0.5, 1e-5, "relu2")
    assert ModelConfig.from_dict(_config(olmoe)).moe.norm_topk_prob is False  # type: ignore[union-attr]


@pytest.mark.parametrize("arch", ["nemotron", "olmoe"])
def test_attention_adapter_matches_transformers_merged(arch, learned_models, prompts, hf_reference, tmp_path):
    path = learned_models[arch]
    adapter = build_lora_adapter(tmp_path / "adapter", path, seed=7, rank=8, alpha=32, targets=ATTENTION)
    merged = merged_checkpoint(path, adapter, tmp_path / "merged")
    llm = LLM(str(path), enable_lora=True, num_kv_blocks=256, max_num_batched_tokens=512)
    lora = LoRARequest("x", 1, str(adapter))
    chosen = [prompts[i] for i in (2, 5, 7)]
    outs = llm.generate(chosen, GREEDY, lora_request=[lora, None, lora])
    _check(outs[0], chosen[0], merged, hf_reference)
    _check(outs[1], chosen[1], path, hf_reference)
    _check(outs[2], chosen[2], merged, hf_reference)
    assert outs[0].outputs[0].token_ids != hf_reference(path, chosen[0], MAX_NEW)[0]  # the adapter matters


def _adapter(out: Path, modules: list[str], std: float = 0.05, **config: object) -> Path:
    """A PEFT adapter of rank 4 on ``modules`` (full names, 64 by 64), both matrices random."""
    out.mkdir()
    gen = torch.Generator().manual_seed(7)
    lora = {}
    for module in modules:
        lora[f"base_model.model.{module}.lora_A.weight"] = torch.randn(4, 64, generator=gen) * std
        lora[f"base_model.model.{module}.lora_B.weight"] = torch.randn(64, 4, generator=gen) * std
    save_file(lora, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 16, **config})
    )
    return out


def test_opt_attention_adapter_matches_transformers_merged(learned_models, prompts, hf_reference, tmp_path):
    """PEFT names OPT's projections ``model.decoder.layers.N.self_attn.{q,k,v,out}_proj``."""
    path = learned_models["opt"]
    names = ("q_proj", "v_proj", "out_proj")
    modules = [f"model.decoder.layers.{i}.self_attn.{m}" for i in range(2) for m in names]
    adapter = _adapter(tmp_path / "adapter", modules, std=0.2)  # OPT's large embeddings drown less
    merged = merged_checkpoint(path, adapter, tmp_path / "merged")
    llm = LLM(str(path), enable_lora=True, num_kv_blocks=256, max_num_batched_tokens=512)
    lora = LoRARequest("x", 1, str(adapter))
    chosen = [prompts[i] for i in (2, 5, 7)]
    outs = llm.generate(chosen, GREEDY, lora_request=[lora, None, lora])
    _check(outs[0], chosen[0], merged, hf_reference)
    _check(outs[1], chosen[1], path, hf_reference)
    _check(outs[2], chosen[2], merged, hf_reference)
    assert outs[0].outputs[0].token_ids != hf_reference(path, chosen[0], MAX_NEW)[0]  # the adapter matters


def test_gpt2_adapters_are_refused_by_name(learned_models, prompts, tmp_path) -> None:
    """PEFT marks adapters of GPT-2's Conv1D modules ``fan_in_fan_out``; Llama-style names find no
    projection of GPT-2's fused ones: neither is applied (nor applied wrongly)."""
    llm = LLM(str(learned_models["gpt2"]), enable_lora=True, num_kv_blocks=64)
    cases = [
        ("transformer.h.0.attn.c_attn", {"fan_in_fan_out": True}, "fan_in_fan_out"),
        ("model.layers.0.self_attn.q_proj", {}, "no projection 'q_proj' takes LoRA"),
    ]
    for i, (module, config, error) in enumerate(cases):
        adapter = _adapter(tmp_path / str(i), [module], **config)
        with pytest.raises(ValueError, match=error):
            llm.generate([prompts[2]], GREEDY, lora_request=LoRARequest(f"x{i}", i + 1, str(adapter)))


@pytest.mark.parametrize("arch", ["gpt2", "opt_post"])
def test_deterministic_mode_is_batch_invariant(arch: str, learned_models, prompts) -> None:
    llm = LLM(str(learned_models[arch]), deterministic=True, num_kv_blocks=128)
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    chosen = [prompts[i] for i in (1, 4, 6)]
    batched = llm.generate(chosen, params)
    for prompt, out in zip(chosen, batched, strict=True):
        solo = llm.generate([prompt], params)[0].outputs[0]
        assert solo.token_ids == out.outputs[0].token_ids
        assert [{t: e.logprob for t, e in s.items()} for s in solo.logprobs] == [
            {t: e.logprob for t, e in s.items()} for s in out.outputs[0].logprobs
        ]
