"""A checkpoint's fp8 KV cache scales (engine/models/kv_scales.py): with ``kv_cache_dtype="fp8"`` a
layer's K/V are stored as ``x / scale`` rounded (saturating) to fp8 and read back times the scale,
in the torch backend and in every Triton kernel that reads the cache; with the model dtype's cache
the scales are ignored; the tier fingerprint separates caches written with scales."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.attention.base import AttentionMetadata, store_rows, to_cache
from engine.attention.torch_backend import TorchAttentionBackend
from engine.models.kv_scales import take_kv_scales
from kvcache.keys import model_fingerprint

# Triton's kernels run in its interpreter on a machine without a GPU; set before triton is imported.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the kernels run
FP8 = torch.float8_e4m3fn
PROMPT = [(11 * i + 5) % 900 + 10 for i in range(40)]
CHUNKED = {"num_threads": 1, "max_num_batched_tokens": 16, "block_size": 16, "num_kv_blocks": 32}
# Per layer (k multiplier, v multiplier): powers of two, so scaling is exact in every float format.
# Keys land far past fp8's 448 in layer 0 and values deep in its subnormals; layer 1 the reverse.
MULTIPLIERS = [(2.0**12, 2.0**-12), (2.0**-11, 2.0**11)]


# --------------------------------------------------------------------------- reading the scales


def test_scales_are_popped_in_every_spelling() -> None:
    a = "model.layers.{}.self_attn."
    weights = {
        a.format(0) + "k_scale": torch.tensor(2.0),
        a.format(0) + "v_scale": torch.tensor([0.5]),
        a.format(0) + "q_scale": torch.tensor(1.0),  # attention-input scales: dropped
        a.format(0) + "prob_scale": torch.tensor(1.0),
        a.format(1) + "kv_scale": torch.tensor(3.0),  # older exports: one scale for both
        a.format(2) + "k_proj.output_scale": torch.tensor(4.0),
        a.format(2) + "v_proj.output_scale": torch.tensor(0.25),
        a.format(2) + "k_proj.weight": torch.zeros(1),
    }
    kept = dict(weights)
    assert take_kv_scales(kept, 4, fp8_cache=True) == ((2.0, 0.5), (3.0, 3.0), (4.0, 0.25), (1.0, 1.0))
    assert list(kept) == [a.format(2) + "k_proj.weight"]  # every scale popped
    ignored = dict(weights)
    assert take_kv_scales(ignored, 4, fp8_cache=False) is None  # a cache in the model dtype
    assert list(ignored) == [a.format(2) + "k_proj.weight"]
    assert take_kv_scales({a.format(0) + "k_scale": torch.tensor(1.0)}, 2, fp8_cache=True) is None
    with pytest.raises(ValueError, match="holds 2 scales .* only per-tensor KV cache scales"):
        take_kv_scales({a.format(0) + "k_scale": torch.ones(2)}, 1, fp8_cache=True)
    with pytest.raises(ValueError, match="must be a positive finite number"):
        take_kv_scales({a.format(0) + "v_scale": torch.tensor(0.0)}, 1, fp8_cache=True)


# --------------------------------------------------------------------------- the backends


def _paged(seed: int = 0):
    """(q, k, v, fp8 caches holding every context row, meta) for chunks that all read the cache:
    decodes, a draft-sized chunk and a prefill tail over a cached prefix."""
    g = torch.Generator().manual_seed(seed)
    chunks, tables = [(9, 1), (5, 12), (13, 3)], [[3, 1, 10], [4, 0, 6, 9, 11], [2, 8, 5, 7]]
    meta = AttentionMetadata.for_chunks(chunks, tables, 4, DEVICE)
    t = meta.num_tokens
    k_cache = (torch.randn(12, 4, 2, 16, generator=g) * 50).to(FP8)
    v_cache = (torch.randn(12, 4, 2, 16, generator=g) * 0.01).to(FP8)
    q = torch.randn(t, 4, 16, generator=g)
    k = torch.randn(t, 2, 16, generator=g) * 1000  # unscaled, most would clip at 448
    v = torch.randn(t, 2, 16, generator=g) * 1e-3  # unscaled, most would fall to subnormals
    return *(x.to(DEVICE) for x in (q, k, v, k_cache, v_cache)), meta


def _backends() -> list:
    pytest.importorskip("triton")
    from engine.attention.triton_backend import TritonAttentionBackend

    # split_size 64: decode-only steps with contexts past 64 take the split-KV kernel.
    return [TorchAttentionBackend(), TritonAttentionBackend(), TritonAttentionBackend(split_size=64)]


@pytest.mark.parametrize("which", ["torch", "triton", "triton-split"])
def test_backends_write_scaled_fp8_and_read_it_back_scaled(which: str) -> None:
    backend = dict(zip(["torch", "triton", "triton-split"], _backends(), strict=True))[which]
    q, k, v, kc, vc, meta = _paged()
    if which == "triton-split":  # decode rows only, long enough for two splits
        tables = [list(range(18)), list(range(25, 48))]
        meta = AttentionMetadata.for_chunks([(70, 1), (90, 1)], tables, 4, DEVICE)
        q, k, v = q[:2], k[:2], v[:2]
        kc = (torch.randn(48, 4, 2, 16) * 50).to(FP8).to(DEVICE)
        vc = (torch.randn(48, 4, 2, 16) * 0.01).to(FP8).to(DEVICE)
    k_scale, v_scale = 8.0, 2.0**-10
    got = backend.forward(q, k, v, kc, vc, meta, 0.25, k_scale=k_scale, v_scale=v_scale)
    slots = meta.slot_mapping
    want_k = (k / k_scale).clamp(-448, 448).to(FP8)
    want_v = (v / v_scale).clamp(-448, 448).to(FP8)
    if which == "torch" or not _interpreting():  # the interpreter's own fp8 rounding: see below
        # Exact: the new rows' bytes are round_to_fp8(x / scale), saturated.
        assert torch.equal(kc.view(-1, 2, 16)[slots].view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(vc.view(-1, 2, 16)[slots].view(torch.uint8), want_v.view(torch.uint8))
    # Read back times the scales: the same as attending over the dequantized caches.
    k_wide, v_wide = kc.float() * k_scale, vc.float() * v_scale
    k_new, v_new = k_wide.view(-1, 2, 16)[slots], v_wide.view(-1, 2, 16)[slots]
    ref = TorchAttentionBackend().forward(q, k_new, v_new, k_wide, v_wide, meta, 0.25)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    # Without the scales the same rows are lost: keys clip at 448, values round to subnormals.
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    store_rows(kc2, slots, k)
    store_rows(vc2, slots, v)
    assert kc2.float().abs().max() == 448 and (k.abs() > 448).float().mean() > 0.5
    unscaled_err = (vc2.view(-1, 2, 16)[slots].float() - v).abs().mean()
    assert unscaled_err > 10 * (want_v.float() * v_scale - v).abs().mean()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def test_triton_kv_write_divides_exactly_and_saturates() -> None:
    """The kernel stores round_to_fp8(x / scale), the division correctly rounded as torch's is:
    the same bytes as writing ``x / scale`` with no scale. On a GPU (hardware round-to-nearest-even)
    those are the torch backend's bytes; Triton's interpreter rounds to fp8 its own way (ties away,
    a carry into the exponent lost), so there only the division is checked exactly."""
    pytest.importorskip("triton")
    from engine.kernels.triton_ops import write_kv_cache

    _, k, v, kc, vc, meta = _paged(1)
    slots = meta.slot_mapping
    for k_scale, v_scale in [(8.0, 2.0**-10), (3.7, 0.013)]:
        got_k, got_v, unit_k, unit_v = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        write_kv_cache(k, v, got_k, got_v, slots, k_scale, v_scale)
        write_kv_cache(k / k_scale, v / v_scale, unit_k, unit_v, slots)
        assert torch.equal(got_k.view(torch.uint8), unit_k.view(torch.uint8))
        assert torch.equal(got_v.view(torch.uint8), unit_v.view(torch.uint8))
        if not _interpreting():
            ref_k, ref_v = kc.clone(), vc.clone()
            store_rows(ref_k, slots, k, k_scale)
            store_rows(ref_v, slots, v, v_scale)
            assert torch.equal(got_k.view(torch.uint8), ref_k.view(torch.uint8))
            assert torch.equal(got_v.view(torch.uint8), ref_v.view(torch.uint8))
    # Unscaled keys past 448 saturate (as vLLM's cache writes do) instead of turning to NaN.
    write_kv_cache(k, v, kc, vc, slots)
    stored = kc.view(-1, 2, 16)[slots].float()
    assert not stored.isnan().any() and stored.abs().max() == 448 and (k.abs() > 448).any()
    assert not to_cache(k, FP8).float().isnan().any() and to_cache(k, FP8).float().abs().max() == 448


def test_mla_latent_cache_takes_the_k_scale() -> None:
    pytest.importorskip("triton")
    from engine.attention.triton_backend import TritonAttentionBackend

    g = torch.Generator().manual_seed(2)
    meta = AttentionMetadata.for_chunks([(9, 1), (5, 12)], [[3, 1, 2], [4, 0, 6, 9, 7]], 4, DEVICE)
    cache = (torch.randn(10, 4, 1, 48, generator=g) * 30).to(FP8).to(DEVICE)
    q = torch.randn(meta.num_tokens, 5, 48, generator=g).to(DEVICE)
    kv = (torch.randn(meta.num_tokens, 1, 48, generator=g) * 2000).to(DEVICE)
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        c = cache.clone()
        got = backend.forward_mla(q, kv, c, meta, 0.2, 32, kv_scale=16.0)
        stored = c.view(-1, 1, 48)[meta.slot_mapping]  # written by torch for both (store_rows)
        assert torch.equal(stored.view(torch.uint8), (kv / 16.0).clamp(-448, 448).to(FP8).view(torch.uint8))
        wide = c.float() * 16.0
        ref = TorchAttentionBackend().forward_mla(
            q, wide.view(-1, 1, 48)[meta.slot_mapping], wide, meta, 0.2, 32
        )
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


# --------------------------------------------------------------------------- a whole checkpoint


@pytest.fixture(scope="module")
def scaled(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny Llama with each layer's K and V multiplied by MULTIPLIERS and its k_scale / v_scale
    set to them, the same without the scale tensors). Queries and the output projection are divided
    by the same powers of two, so the model computes exactly what tiny_llama does."""
    root = tmp_path_factory.mktemp("kv_scales")
    with_scales, without = root / "with", root / "without"
    weights = load_file(str(tiny_llama / "model.safetensors"))
    for i, (mk, mv) in enumerate(MULTIPLIERS):
        a = f"model.layers.{i}.self_attn."
        weights[a + "q_proj.weight"] = weights[a + "q_proj.weight"] / mk
        weights[a + "k_proj.weight"] = weights[a + "k_proj.weight"] * mk
        weights[a + "v_proj.weight"] = weights[a + "v_proj.weight"] * mv
        weights[a + "o_proj.weight"] = weights[a + "o_proj.weight"] / mv
    for d in (with_scales, without):
        shutil.copytree(tiny_llama, d)
    save_file(weights, str(without / "model.safetensors"))
    for i, (mk, mv) in enumerate(MULTIPLIERS):
        a = f"model.layers.{i}.self_attn."
        weights[a + "k_scale"], weights[a + "v_scale"] = torch.tensor(mk), torch.tensor(mv)
    save_file(weights, str(with_scales / "model.safetensors"))
    cfg = json.loads((with_scales / "config.json").read_text())
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    cfg["quantization_config"] = {  # llm-compressor's shape: weights left unquantized here
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}},
        "kv_cache_scheme": scheme,
        "ignore": ["lm_head"],
    }
    (with_scales / "config.json").write_text(json.dumps(cfg))
    return with_scales, without


def _prompt_logprobs(model: Path, **opts) -> torch.Tensor:
    with LLM(str(model), **CHUNKED, **opts) as llm:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return torch.tensor([next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_scaled_checkpoint_serves_as_its_unscaled_twin(tiny_llama: Path, scaled, backend: str) -> None:
    """With its scales, the fp8 cache holds exactly the bytes tiny_llama's fp8 cache holds, so the
    results are identical; without them, keys clip at 448 and values fall to subnormals."""
    if backend == "triton":
        pytest.importorskip("triton")
    with_scales, without = scaled
    opts = {"attention_backend": backend}
    full = _prompt_logprobs(tiny_llama, **opts)
    twin = _prompt_logprobs(tiny_llama, kv_cache_dtype="fp8", **opts)
    got = _prompt_logprobs(with_scales, kv_cache_dtype="fp8", **opts)
    lost = _prompt_logprobs(without, kv_cache_dtype="fp8", **opts)
    ignored = _prompt_logprobs(with_scales, **opts)  # auto cache: the scales are not used
    assert torch.equal(got, twin)
    # fp8's rounding (the Triton kernels read even the first chunk from the cache, and the
    # interpreter rounds to fp8 more coarsely than a GPU; test_kv_cache_dtype.py's bounds).
    assert 0 < (got - full).abs().max() < 0.15  # every read rounded, as Triton's kernels read
    assert (lost - full).abs().mean() > 10 * (got - full).abs().mean()
    assert (ignored - full).abs().max() < 1e-4


def test_fingerprint_separates_scaled_caches_and_keeps_the_others(scaled) -> None:
    with_scales, without = scaled
    prints = {}
    for name, model, kv in [
        ("scaled", with_scales, "fp8"),
        ("auto", with_scales, "auto"),
        ("none", without, "fp8"),
    ]:
        with LLM(str(model), num_kv_blocks=8, num_threads=1, kv_cache_dtype=kv) as llm:
            runner = llm.engine.model_runner
            assert (runner.kv_scales is not None) == (name == "scaled")
            old = model_fingerprint(  # the formula before KV scales: what existing tiers hold
                weights_id=runner.weights_id,
                dtype="float32" + ("+kv:float8_e4m3fn" if kv == "fp8" else ""),
                block_size=runner.block_size,
                num_layers=2,
                num_kv_heads=2,
                head_dim=16,
                kv_layout="k,v:[block,token,kv_head,dim]",
            )
            prints[name] = (runner.model_fingerprint, old)
    assert prints["scaled"][0] != prints["scaled"][1]
    assert prints["auto"][0] == prints["auto"][1]  # scales ignored: the fingerprint as before
    assert prints["none"][0] == prints["none"][1]


def test_scaled_fp8_blocks_cross_the_kv_tier(scaled) -> None:
    with_scales, without = scaled
    tier = "memory://fp8-scaled"
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    opts = {"kv_tier": tier, "kv_cache_dtype": "fp8", "num_threads": 1, "num_kv_blocks": 32}
    with LLM(str(with_scales), **opts) as writer:
        cold = writer.generate([PROMPT], params)[0]
        assert writer.engine.connector.flush(10.0)
        with LLM(str(with_scales), **opts) as reader:
            warm = reader.generate([PROMPT], params)[0]
    assert warm.num_cached_tokens == 32 and warm.outputs[0].token_ids == cold.outputs[0].token_ids


def test_a_weight_update_brings_its_kv_scales(scaled, tmp_path: Path) -> None:
    """New weights copied over the serving tensors bring their scales (numbers, not tensors) too;
    the fingerprint follows them, and the model serves as one started on the new checkpoint."""
    with_scales, _ = scaled
    other = tmp_path / "other"
    shutil.copytree(with_scales, other)
    weights = load_file(str(other / "model.safetensors"))
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(MULTIPLIERS[0][0] * 4)
    save_file(weights, str(other / "model.safetensors"))
    with LLM(str(with_scales), **CHUNKED, kv_cache_dtype="fp8") as llm:
        runner = llm.engine.model_runner
        before, serving = runner.model_fingerprint, runner.model
        llm.reload_weights(str(other))
        assert runner.model is serving  # updated in place
        assert runner.kv_scales[0] == runner.model.kv_scales[0] == (MULTIPLIERS[0][0] * 4, MULTIPLIERS[0][1])
        assert runner.model_fingerprint != before
        out = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    got = torch.tensor([next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]])
    assert torch.equal(got, _prompt_logprobs(other, kv_cache_dtype="fp8"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mla_checkpoint_scales_its_latent_cache(tiny_deepseek: Path, tmp_path: Path, backend: str) -> None:
    """A DeepSeek checkpoint's k_scale scales its fp8 latent cache (v_scale has no cache of its own
    there); with every latent stored 8x larger and read back unscaled the model would fall apart."""
    if backend == "triton":
        pytest.importorskip("triton")
    d = tmp_path / "mla"
    shutil.copytree(tiny_deepseek, d)
    weights = load_file(str(d / "model.safetensors"))
    layers = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.125)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(3.0)
    save_file(weights, str(d / "model.safetensors"))
    opts = {"attention_backend": backend}
    full = _prompt_logprobs(tiny_deepseek, **opts)
    with LLM(str(d), **CHUNKED, kv_cache_dtype="fp8", **opts) as llm:
        assert llm.engine.model_runner.model.kv_scales == [0.125] * layers
    got = _prompt_logprobs(d, kv_cache_dtype="fp8", **opts)
    assert 0 < (got - full).abs().max() < 0.15  # every read rounded, as Triton kernels read
