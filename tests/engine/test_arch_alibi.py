"""Bloom (and its post-LayerNorm residual variant) and MPT against transformers on tiny fp32
checkpoints: greedy tokens equal and logprobs within 1e-4, solo and batched, in small prefill chunks
over small blocks and behind a prefix-cache hit (the new tokens' biases to the cached keys are their
distances to them), on the torch and the Triton path; hub-style tensor names,
dummy weights and the config values ferry refuses; LoRA adapters refused by name;
in deterministic mode batch invariance, chunking invariance and blocks loaded from the KV tier, bit
for bit."""

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
from engine.demo import build_model  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from tests.engine.arch_checks import check_batched_solo_chunked_cached  # noqa: E402

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
ARCHS = {"bloom": 60, "bloom_post": 61, "mpt": 62}  # tiny model -> seed


@pytest.fixture(scope="session")
def alibi_models(models_root: Path) -> dict[str, Path]:
    return {arch: build_model(models_root / f"alibi_{arch}", arch, seed=seed) for arch, seed in ARCHS.items()}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_transformers_solo_batched_chunked_and_after_a_prefix_hit(
    arch: str, alibi_models, prompts, hf_reference
) -> None:
    check_batched_solo_chunked_cached(alibi_models[arch], prompts, hf_reference, MAX_NEW)


@pytest.mark.parametrize("arch", ["bloom", "mpt"])
def test_triton_path_gives_the_torch_path_tokens(arch: str, alibi_models) -> None:
    """Triton attention (ALiBi in the unified kernel) and norm kernels, chunked prefill."""
    pytest.importorskip("triton", reason="triton is not installed")
    prompts = [[7], [11 + (i * 37) % 900 for i in range(17)], [5 + (i * 53) % 950 for i in range(40)]]
    options = dict(block_size=16, num_kv_blocks=48, max_num_batched_tokens=24, max_num_seqs=8)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(alibi_models[arch]), attention_backend=backend, **options)
        outs[backend] = llm.generate(prompts, GREEDY)
    for t, r in zip(outs["triton"], outs["torch"], strict=True):
        assert t.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(t.outputs[0].logprobs, r.outputs[0].logprobs, strict=True):
            assert {k: round(e.logprob, 4) for k, e in a.items()} == {
                k: round(e.logprob, 4) for k, e in b.items()
            }


def _renamed(src: Path, dst: Path, strip: str) -> Path:
    """A copy of ``src`` whose tensor names lose the prefix ``strip`` (the hub's original layout)."""
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(src / "model.safetensors"))
    save_file({k.removeprefix(strip): v for k, v in weights.items()}, str(dst / "model.safetensors"))
    return dst


def test_hub_tensor_names_and_dummy_weights_load(alibi_models, prompts, tmp_path) -> None:
    """Bloom's hub files name ``h.0.self_attention…`` / ``word_embeddings``: the same model.
    ``--load-format dummy`` takes the names from transformers' class: it loads and generates."""
    path = alibi_models["bloom"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = LLM(str(path), num_kv_blocks=64).generate([prompts[4]], params)[0].outputs[0].token_ids
    hub = LLM(str(_renamed(path, tmp_path / "hub", "transformer.")), num_kv_blocks=64)
    assert hub.generate([prompts[4]], params)[0].outputs[0].token_ids == want
    # MosaicML's hub configs name their own class, MPTForCausalLM: the same model.
    mpt = alibi_models["mpt"]
    want = LLM(str(mpt), num_kv_blocks=64).generate([prompts[4]], params)[0].outputs[0].token_ids
    mosaic = _renamed(mpt, tmp_path / "mosaic", "")
    (mosaic / "config.json").write_text(json.dumps(_config(mpt, architectures=["MPTForCausalLM"])))
    assert LLM(str(mosaic), num_kv_blocks=64).generate([prompts[4]], params)[0].outputs[0].token_ids == want
    for arch in ("bloom", "mpt"):
        dummy = LLM(str(alibi_models[arch]), load_format="dummy", num_kv_blocks=64)
        assert len(dummy.generate([prompts[4]], params)[0].outputs[0].token_ids) == 4


def _config(path: Path, **changes: object) -> dict:
    return {**json.loads((path / "config.json").read_text()), **changes}


def test_config_values_read_and_refused(alibi_models, tmp_path) -> None:
    bloom, mpt = alibi_models["bloom"], alibi_models["mpt"]
    cfg = ModelConfig.from_dict(_config(bloom))
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_layers, cfg.intermediate_size) == (96, 6, 2, 384)
    assert cfg.alibi is not None and cfg.alibi.slopes == "bloom" and not cfg.alibi.residual_post_norm
    assert ModelConfig.from_dict(_config(alibi_models["bloom_post"])).alibi.residual_post_norm  # type: ignore[union-attr]
    old = _config(bloom, n_embed=96)  # the older spelling of the hidden size
    del old["hidden_size"]
    assert ModelConfig.from_dict(old).hidden_size == 96
    cfg = ModelConfig.from_dict(_config(mpt, expansion_ratio=3))
    assert (cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.max_position_embeddings) == (
        96,
        6,
        288,
        256,
    )
    assert cfg.alibi is not None and (cfg.alibi.clip_qkv, cfg.alibi.softmax_scale) == (0.5, 0.3)
    attn = _config(mpt)["attn_config"]
    refused = [
        ({"no_bias": False}, "no_bias=False"),
        ({"logit_scale": "inv_sqrt_d_model"}, "logit_scale='inv_sqrt_d_model'"),
        ({"norm_type": "rmsnorm"}, "norm_type='rmsnorm'"),
        ({"attn_config": {**attn, "qk_ln": True}}, "attn_config.qk_ln=True"),
        ({"attn_config": {**attn, "alibi": False}}, "attn_config.alibi=False"),
        ({"attn_config": {**attn, "prefix_lm": True}}, "attn_config.prefix_lm=True"),
        ({"attn_config": {**attn, "attn_type": "multiquery_attention"}}, "attn_config.attn_type"),
    ]
    for changes, field in refused:
        with pytest.raises(ValueError, match=field.replace("(", r"\(")):
            ModelConfig.from_dict(_config(mpt, **changes))
    # Learned positions' weights beside ALiBi: a model ferry would compute without them.
    with_wpe = _renamed(mpt, tmp_path / "wpe", "")
    weights = load_file(str(with_wpe / "model.safetensors"))
    weights["transformer.wpe.weight"] = torch.zeros(256, 96)
    save_file(weights, str(with_wpe / "model.safetensors"))
    with pytest.raises(ValueError, match="learned_pos_emb"):
        LLM(str(with_wpe), num_kv_blocks=64)


@pytest.mark.parametrize(
    ("arch", "module"),
    [("bloom", "transformer.h.0.self_attention.query_key_value"), ("mpt", "transformer.blocks.0.attn.Wqkv")],
)
def test_adapters_are_refused_not_ignored(arch: str, module: str, alibi_models, prompts, tmp_path) -> None:
    """PEFT's names of Bloom's and MPT's projections: a request with such an adapter is an error."""
    path = alibi_models[arch]
    out = tmp_path / "adapter"
    out.mkdir()
    gen = torch.Generator().manual_seed(7)
    lora = {
        f"base_model.model.{module}.lora_A.weight": torch.randn(4, 96, generator=gen),
        f"base_model.model.{module}.lora_B.weight": torch.randn(288, 4, generator=gen),
    }
    save_file(lora, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 16}))
    llm = LLM(str(path), enable_lora=True, num_kv_blocks=64)
    with pytest.raises(ValueError, match="is not a LoRA weight ferry can apply"):
        llm.generate([prompts[2]], GREEDY, lora_request=LoRARequest("x", 1, str(out)))
    assert len(llm.generate([prompts[2]], GREEDY)[0].outputs[0].token_ids) == MAX_NEW  # still serving


def _exact(outputs) -> list[list[tuple[int, float]]]:
    return [
        [(tok, lp.logprob) for entry in o.outputs[0].logprobs for tok, lp in entry.items()] for o in outputs
    ]


@pytest.mark.parametrize("arch", ["bloom", "mpt"])
def test_deterministic_mode_is_batch_chunk_and_tier_invariant(arch: str, alibi_models, prompts) -> None:
    """Each prompt's tokens and logprobs are the same bits alone, batched, in 9-token chunks, and
    continuing from blocks another engine left in the KV tier."""
    path = alibi_models[arch]
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    chosen = [prompts[i] for i in (1, 4, 6)]
    options = dict(deterministic=True, block_size=4, num_kv_blocks=128)
    llm = LLM(str(path), **options)
    batched = _exact(llm.generate(chosen, params))
    assert [_exact(llm.generate([p], params))[0] for p in chosen] == batched
    tier = f"memory://alibi-{arch}"
    writer = LLM(str(path), kv_tier=tier, max_num_batched_tokens=9, **options)
    assert _exact(writer.generate(chosen, params)) == batched
    assert writer.engine.connector.flush(5.0)
    reader = LLM(str(path), kv_tier=tier, **options)
    assert _exact(reader.generate(chosen, params)) == batched
    assert reader.engine.stats().prefix_cache_hits > 0
