"""gpt-oss (``GptOssForCausalLM``) against transformers: attention sinks in the backends, sliding and
full layers, chunked prefill and long paged decodes, MXFP4 experts dequantized at load.

``tiny_gpt_oss`` has a window of 8 tokens on layer 0 and full attention on layer 1; its sinks are
drawn large (std 1) so they take a visible share of each softmax, and its SwiGLU limit is small
enough that random weights hit the clamps.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

from engine import LLM, SamplingParams  # noqa: E402
from engine.attention import AttentionMetadata, get_attention_backend  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.models.loader import load_weights  # noqa: E402
from engine.models.quantized import FP4_VALUES, MXFP4_GROUP  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
LENGTHS = [1, 7, 8, 9, 20, 45]  # around and past the 8-token window


@pytest.fixture(scope="module")
def oss_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in LENGTHS]


def _assert_matches(out, ref_tokens: list[int], ref_logits: torch.Tensor) -> None:  # noqa: ANN001
    o = out.outputs[0]
    assert o.token_ids == ref_tokens
    ref_lp = torch.log_softmax(ref_logits, dim=-1)
    for step, (tok, entry) in enumerate(zip(ref_tokens, o.logprobs, strict=True)):
        assert abs(entry[tok].logprob - ref_lp[step, tok].item()) < 1e-4


# --------------------------------------------------------------------------- config

# The released gpt-oss-20b config.json's shape keys (transformers 4 spelling: rope_scaling).
RELEASED = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "vocab_size": 201088,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "rope_theta": 150000,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "max_position_embeddings": 131072,
    "swiglu_limit": 7.0,
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "lm_head"],
        "quant_method": "mxfp4",
    },
}


@pytest.mark.parametrize("raw", [RELEASED, {k: v for k, v in RELEASED.items() if k != "layer_types"}])
def test_config_reads_as_transformers_does(raw: dict) -> None:
    from transformers import GptOssConfig

    from engine.models.rope import inv_freq

    cfg = ModelConfig.from_dict(raw)
    hf = GptOssConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    assert list(cfg.layer_windows) == [
        hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types
    ]
    assert cfg.layer_windows[:2] == (128, None)
    assert cfg.attention_bias and cfg.swiglu == (1.702, 7.0) and cfg.rms_norm_eps == 1e-5
    assert cfg.quant_method == "mxfp4"
    assert cfg.moe is not None and (cfg.moe.num_experts, cfg.moe.experts_per_token) == (32, 4)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_freqs, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    assert torch.equal(inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), hf_freqs)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["truncate"] is False


# --------------------------------------------------------------------------- attention sinks


def _reference(q_all, k_all, v_all, ctx, scale, sinks, window):  # noqa: ANN001
    """Dense float64 softmax with a sink column per head, for the last q rows over all keys."""
    hq, hkv = q_all.shape[1], k_all.shape[1]
    n, lq = k_all.shape[0], q_all.shape[0]
    k = k_all.double().repeat_interleave(hq // hkv, dim=1)
    v = v_all.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q_all.double(), k) * scale
    qpos = (torch.arange(lq) + ctx)[:, None]
    kpos = torch.arange(n)[None, :]
    mask = (kpos <= qpos) & (kpos > qpos - (window or n + lq))
    s = s.masked_fill(~mask, float("-inf"))
    sink = sinks.double()[:, None, None].expand(hq, lq, 1)
    probs = torch.cat([s, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v).float()


BACKENDS = [("torch", False), ("torch", True), ("triton", False)]
NO_TRITON = "triton is not installed (pip install 'ferry-serve[triton]')"
MIXED = ([(0, 11), (6, 10), (9, 1), (14, 1)], [[3, 17, 4], [8, 2, 30, 31], [11, 5, 21], [12, 13, 14, 15]])
# Decode rows only, past one 64-key split: the Triton backend's split-KV kernel (split_size 64).
DECODES = ([(70, 1), (90, 1)], [list(range(18)), list(range(18, 41))])


@pytest.mark.parametrize("name,deterministic", BACKENDS)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("batch", ["mixed", "decodes"])
def test_backend_sinks_match_reference(
    name: str, deterministic: bool, window: int | None, batch: str
) -> None:
    """Prefill (fresh and after a cached prefix, long enough for the prefill path) and decode rows
    on a paged cache, with sinks that take most of some rows' mass."""
    torch.manual_seed(0)
    bs, hq, hkv, d = 4, 4, 2, 8
    device = "cpu"  # where the backend runs; the inputs and the reference are built on the CPU
    if name == "triton":
        pytest.importorskip("triton", reason=NO_TRITON)
        from engine.attention.triton_backend import TritonAttentionBackend

        backend = TritonAttentionBackend(split_size=64)
        device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels take CUDA tensors
    else:
        backend = get_attention_backend(name, "cpu", deterministic=deterministic)
    k_cache, v_cache = torch.zeros(48, bs, hkv, d), torch.zeros(48, bs, hkv, d)
    seqs, tables = MIXED if batch == "mixed" else DECODES
    full_k = [torch.randn(c + n, hkv, d) for c, n in seqs]
    full_v = [torch.randn(c + n, hkv, d) for c, n in seqs]
    full_q = [torch.randn(n, hq, d) for _, n in seqs]
    sinks = torch.tensor([3.0, -1.0, 0.5, 8.0])
    for (ctx, _), table, kk, vv in zip(seqs, tables, full_k, full_v, strict=True):
        for p in range(ctx):
            k_cache[table[p // bs], p % bs], v_cache[table[p // bs], p % bs] = kk[p], vv[p]
    meta = AttentionMetadata.for_chunks(seqs, tables, bs, device)
    k = torch.cat([kk[c:] for (c, _), kk in zip(seqs, full_k, strict=True)])
    v = torch.cat([vv[c:] for (c, _), vv in zip(seqs, full_v, strict=True)])
    q, k, v, k_cache, v_cache = (t.to(device) for t in (torch.cat(full_q), k, v, k_cache, v_cache))
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.35, window, None, sinks.to(device)).cpu()
    plain = backend.forward(q, k, v, k_cache, v_cache, meta, 0.35, window).cpu()
    start = 0
    for (ctx, n), qq, kk, vv in zip(seqs, full_q, full_k, full_v, strict=True):
        ref = _reference(qq, kk, vv, ctx, 0.35, sinks, window)
        torch.testing.assert_close(out[start : start + n], ref, atol=1e-5, rtol=1e-5)
        start += n
    # The sinks took mass: head 3's sink dominates, so its output shrinks towards zero.
    assert out[:, 3].abs().max() < 0.1 * plain[:, 3].abs().max()


def test_triton_backend_matches_transformers(tiny_gpt_oss, oss_prompts, hf_reference) -> None:
    """The whole model on the Triton backend and op set (interpreted on CPU: two short prompts)."""
    pytest.importorskip("triton", reason=NO_TRITON)
    llm = LLM(str(tiny_gpt_oss), attention_backend="triton", num_kv_blocks=32, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    for out, prompt in zip(llm.generate(oss_prompts[2:4], params), oss_prompts[2:4], strict=True):
        _assert_matches(out, *hf_reference(tiny_gpt_oss, prompt, 4))


# --------------------------------------------------------------------------- the model


def test_greedy_matches_transformers_with_chunked_prefill(tiny_gpt_oss, oss_prompts, hf_reference) -> None:
    """Prompts around and past the window, prefilled in chunks of at most 16 tokens over 4-token
    blocks, batched; then one long paged decode (60 steps, far past the window)."""
    llm = LLM(str(tiny_gpt_oss), num_kv_blocks=96, block_size=4, max_num_batched_tokens=16)
    for out, prompt in zip(llm.generate(oss_prompts, GREEDY), oss_prompts, strict=True):
        _assert_matches(out, *hf_reference(tiny_gpt_oss, prompt, GREEDY.max_tokens))
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=0)
    out = llm.generate([oss_prompts[2]], long)[0]
    ref_tokens, ref_logits = hf_reference(tiny_gpt_oss, oss_prompts[2], 60)
    _assert_matches(out, ref_tokens, ref_logits)
    assert len(set(ref_tokens)) > 10  # not a degenerate repetition
    llm.engine.block_manager.check_integrity()


def test_sinks_change_the_answer(tiny_gpt_oss, oss_prompts, hf_model) -> None:
    """Without its sinks the model answers otherwise: the tests above would catch sinks ignored."""
    model = hf_model(tiny_gpt_oss)
    ids = torch.tensor([oss_prompts[4]])
    with torch.no_grad():
        with_sinks = model(ids).logits[0, -1]
        saved = [layer.self_attn.sinks.clone() for layer in model.model.layers]
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        without = model(ids).logits[0, -1]
        for layer, s in zip(model.model.layers, saved, strict=True):
            layer.self_attn.sinks.copy_(s)
    assert (with_sinks - without).abs().max() > 0.1


def test_deterministic_mode_matches_transformers(tiny_gpt_oss, oss_prompts, hf_reference) -> None:
    llm = LLM(
        str(tiny_gpt_oss), deterministic=True, num_kv_blocks=96, block_size=4, max_num_batched_tokens=16
    )
    for out, prompt in zip(llm.generate(oss_prompts[3:], GREEDY), oss_prompts[3:], strict=True):
        _assert_matches(out, *hf_reference(tiny_gpt_oss, prompt, GREEDY.max_tokens))


# --------------------------------------------------------------------------- MXFP4


def _quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, in, out]`` fused experts -> (blocks uint8 [E, out, in/32, 16], scales uint8 [E, out,
    in/32]), the layout transformers' ``integrations/mxfp4.py`` dequantizes: per 32 inputs one e8m0
    scale (the smallest power of two that brings the group within ±6), values rounded to the nearest
    e2m1 code, two codes a byte with the even input in the low nibble."""
    rows = w.transpose(1, 2).float()  # [E, out, in]
    groups = rows.reshape(*rows.shape[:2], -1, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0**-120)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exp)[..., None]
    codes = (scaled[..., None] - torch.tensor(FP4_VALUES)).abs().argmin(dim=-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tiny_gpt_oss: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_gpt_oss with its experts stored as MXFP4, as the released checkpoints store them."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path_factory.mktemp("mxfp4") / "gpt_oss"
    shutil.copytree(tiny_gpt_oss, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name + "_blocks"], tensors[name + "_scales"] = _quantize_mxfp4(tensors.pop(name))
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = RELEASED["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def hf_mxfp4(mxfp4_gpt_oss: Path):
    """transformers' own dequantized load of the MXFP4 checkpoint (fp32, CPU)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(
        str(mxfp4_gpt_oss),
        dtype=torch.float32,
        quantization_config=Mxfp4Config(dequantize=True),
        attn_implementation="eager",
    ).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_experts_load_as_transformers_dequantizes_them(
    tiny_gpt_oss, mxfp4_gpt_oss, hf_mxfp4, dtype
) -> None:
    cfg = ModelConfig.from_dir(mxfp4_gpt_oss)
    weights = load_weights(mxfp4_gpt_oss, dtype, torch.device("cpu"), quant=cfg.weight_quant)
    hf = hf_mxfp4.state_dict()
    experts = [n for n in hf if ".experts." in n and not n.endswith("_bias")]
    assert len(experts) == 2 * cfg.num_layers
    for name in experts:
        assert weights[name].dtype == dtype
        assert torch.equal(weights[name], hf[name].to(dtype)), name
    assert not any(n.endswith(("_blocks", "_scales")) for n in weights)
    # The reference really went through MXFP4: its experts are the rounded, not the original, weights.
    original = load_weights(tiny_gpt_oss, dtype, torch.device("cpu"))
    assert not torch.equal(weights[experts[0]], original[experts[0]])


def test_mxfp4_checkpoint_generates_as_transformers(mxfp4_gpt_oss, hf_mxfp4, oss_prompts) -> None:
    llm = LLM(str(mxfp4_gpt_oss), num_kv_blocks=64, block_size=4)
    for out, prompt in zip(llm.generate(oss_prompts[2:5], GREEDY), oss_prompts[2:5], strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf_mxfp4.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                min_new_tokens=12, eos_token_id=None, pad_token_id=0, output_logits=True,
                return_dict_in_generate=True,
            )  # fmt: skip
        _assert_matches(out, ref.sequences[0, len(prompt) :].tolist(), torch.cat(ref.logits).float())
