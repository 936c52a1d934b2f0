"""Triton elementwise ops (engine/kernels/triton_ops.py) against straightforward PyTorch references.

Without a GPU the kernels run under Triton's interpreter; sizes stay small because the
interpreter's cost grows with the number of program instances.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")

from engine import ops as torch_ops  # noqa: E402
from engine.kernels import triton_ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16: two bf16 ulps (results are rounded to bf16 twice where the eager op rounds twice).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def rounds_to(out: torch.Tensor, exact: torch.Tensor) -> bool:
    """``out`` is ``exact`` (fp32) rounded to ``out``'s dtype. Under Triton's interpreter an
    fp32 -> bf16 conversion truncates instead of rounding to nearest even, so there either
    rounding counts; on a GPU only round-to-nearest can match (it is also what torch does)."""
    nearest = exact.float().to(out.dtype)
    if out.dtype != torch.bfloat16 or torch.cuda.is_available():
        return torch.equal(out, nearest)
    truncated = (exact.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    return bool(((out == nearest) | (out == truncated)).all())


def rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


# --------------------------------------------------------------------------- rms_norm


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.double()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 16), (7, 33), (70, 64), (3, 5120)])
def test_rms_norm_matches_reference(shape: tuple[int, int], dtype: torch.dtype) -> None:
    x = rand(*shape, dtype=dtype, seed=1)
    w = (1 + 0.1 * rand(shape[1], seed=2)).to(dtype)
    out, res = triton_ops.rms_norm(x, w, 1e-6)
    assert res is None and out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, ref_rms_norm(x, w, 1e-6)) < TOL[dtype]
    # Same numerics as the eager op the engine uses on CPU.
    assert rel_err(out, torch_ops.rms_norm(x, w, 1e-6)[0]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_with_residual(dtype: torch.dtype) -> None:
    x, r = rand(9, 48, dtype=dtype, seed=3), rand(9, 48, dtype=dtype, seed=4)
    w = rand(48, seed=5).to(dtype)
    out, res = triton_ops.rms_norm(x, w, 1e-5, residual=r)
    # The residual stream is the sum rounded to the activation dtype.
    assert res.dtype == dtype and rounds_to(res, x.float() + r.float())
    assert rel_err(out, ref_rms_norm(res, w, 1e-5)) < TOL[dtype]
    # Inputs are untouched: both results are new tensors.
    assert torch.equal(x, rand(9, 48, dtype=dtype, seed=3)) and torch.equal(
        r, rand(9, 48, dtype=dtype, seed=4)
    )


def test_rms_norm_strided_rows_and_empty_batch() -> None:
    base = rand(6, 80, seed=6)
    x = base[:, 8:72]  # rows with stride 80, not contiguous as a whole
    w = rand(64, seed=7)
    out, _ = triton_ops.rms_norm(x, w, 1e-6)
    assert rel_err(out, ref_rms_norm(x, w, 1e-6)) < 1e-5
    empty, res = triton_ops.rms_norm(rand(0, 64), w, 1e-6, residual=rand(0, 64))
    assert empty.shape == (0, 64) and res is not None and res.shape == (0, 64)


def test_rms_norm_row_result_is_batch_invariant() -> None:
    x, w = rand(37, 96, seed=8), rand(96, seed=9)
    full, _ = triton_ops.rms_norm(x, w, 1e-6)
    for lo, hi in [(0, 1), (5, 6), (3, 20), (36, 37)]:
        part, _ = triton_ops.rms_norm(x[lo:hi].clone(), w, 1e-6)
        assert torch.equal(part, full[lo:hi])


# --------------------------------------------------------------------------- rotary


def cos_sin_cache(inv_freq: torch.Tensor, max_pos: int) -> torch.Tensor:
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq.float())
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)


def hf_rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """HF's own apply_rotary_pos_emb on [T, H, D], computed in float64."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    freqs = positions.double()[:, None] * inv_freq.to(positions.device, torch.float64)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    out, _ = apply_rotary_pos_emb(x.double(), x.double(), emb.cos(), emb.sin(), unsqueeze_dim=1)
    return out


def default_inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def llama3_inv_freq(head_dim: int) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    )  # fmt: skip
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
    return inv_freq


@pytest.mark.parametrize(
    "n_tokens,hq,hkv,head_dim,dtype,scaling",
    [
        (5, 4, 2, 16, torch.float32, "default"),
        (9, 6, 2, 80, torch.float32, "llama3"),  # half = 40: not a power of two
        (4, 3, 3, 64, torch.float16, "llama3"),
        (3, 8, 2, 128, torch.bfloat16, "default"),
    ],
)
def test_rotary_matches_hf(n_tokens, hq, hkv, head_dim, dtype, scaling) -> None:
    inv_freq = llama3_inv_freq(head_dim) if scaling == "llama3" else default_inv_freq(head_dim)
    cache = cos_sin_cache(inv_freq, 1024)
    positions = torch.randint(0, 1024, (n_tokens,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    q, k = (
        rand(n_tokens, hq, head_dim, dtype=dtype, seed=2),
        rand(n_tokens, hkv, head_dim, dtype=dtype, seed=3),
    )
    q_ref, k_ref = hf_rotate(q, positions, inv_freq), hf_rotate(k, positions, inv_freq)
    triton_ops.rotary_embedding(positions, q, k, cache)
    # fp32 positions x inv_freq in the cache vs float64 here: angles up to ~1e3 rad carry ~1e-4 of
    # absolute phase error, so compare the kernel with the engine's eager op tightly and with
    # HF's float64 formula at the cache's own precision.
    assert rel_err(q, q_ref) < max(TOL[dtype], 2e-4) and rel_err(k, k_ref) < max(TOL[dtype], 2e-4)
    q2, k2 = (
        rand(n_tokens, hq, head_dim, dtype=dtype, seed=2),
        rand(n_tokens, hkv, head_dim, dtype=dtype, seed=3),
    )
    torch_ops.rotary_embedding(positions, q2, k2, cache)
    assert rel_err(q, q2) < TOL[dtype] and rel_err(k, k2) < TOL[dtype]


def test_rotary_on_views_of_a_fused_qkv_projection() -> None:
    """q and k as strided views into one [T, (Hq + 2 Hkv) * D] tensor, as a fused QKV matmul gives."""
    n_tokens, hq, hkv, d = 6, 4, 2, 32
    qkv = rand(n_tokens, (hq + 2 * hkv) * d, seed=4)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    q = qkv[:, : hq * d].view(n_tokens, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(n_tokens, hkv, d)
    inv_freq = default_inv_freq(d)
    positions = torch.tensor([0, 1, 2, 15, 16, 17], device=DEVICE)
    q_ref, k_ref = hf_rotate(q, positions, inv_freq), hf_rotate(k, positions, inv_freq)
    triton_ops.rotary_embedding(positions, q, k, cos_sin_cache(inv_freq, 32))
    assert rel_err(q, q_ref) < 1e-5 and rel_err(k, k_ref) < 1e-5
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)  # V untouched


def test_rotary_position_zero_is_identity() -> None:
    q, k = rand(2, 2, 16, seed=5), rand(2, 1, 16, seed=6)
    q0, k0 = q.clone(), k.clone()
    triton_ops.rotary_embedding(
        torch.zeros(2, dtype=torch.long, device=DEVICE), q, k, cos_sin_cache(default_inv_freq(16), 8)
    )
    assert torch.equal(q, q0) and torch.equal(k, k0)


# --------------------------------------------------------------------------- silu_and_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2), (5, 46), (33, 256), (2, 2 * 5000)])
def test_silu_and_mul(shape: tuple[int, int], dtype: torch.dtype) -> None:
    x = (3 * rand(*shape, seed=7)).to(dtype)
    inter = shape[1] // 2
    out = triton_ops.silu_and_mul(x)
    xd = x.double()
    ref = torch.nn.functional.silu(xd[:, :inter]) * xd[:, inter:]
    assert out.shape == (shape[0], inter) and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


def test_silu_and_mul_empty_and_odd_width() -> None:
    assert triton_ops.silu_and_mul(rand(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match="even"):
        triton_ops.silu_and_mul(rand(2, 7))


# --------------------------------------------------------------------------- KV cache write


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hkv,head_dim,block_size", [(2, 16, 16), (3, 40, 5), (1, 128, 16)])
def test_write_kv_cache_exact_slots(dtype: torch.dtype, hkv: int, head_dim: int, block_size: int) -> None:
    num_blocks = 6
    k_cache = torch.zeros(num_blocks, block_size, hkv, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    # Block-boundary slots, a padding slot (-1) and an unordered batch.
    slots = [
        0,
        block_size - 1,
        block_size,
        5 * block_size - 1,
        -1,
        3 * block_size + 2,
        num_blocks * block_size - 1,
    ]
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=DEVICE)
    k = rand(len(slots), hkv, head_dim, dtype=dtype, seed=8)
    v = rand(len(slots), hkv, head_dim, dtype=dtype, seed=9)
    triton_ops.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    k_expect, v_expect = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for i, slot in enumerate(slots):
        if slot >= 0:
            k_expect[slot // block_size, slot % block_size] = k[i]
            v_expect[slot // block_size, slot % block_size] = v[i]
    assert torch.equal(k_cache, k_expect) and torch.equal(v_cache, v_expect)


def test_write_kv_cache_from_strided_views() -> None:
    n_tokens, hq, hkv, d, bs = 4, 4, 2, 16, 8
    qkv = rand(n_tokens, (hq + 2 * hkv) * d, seed=10)
    k = qkv[:, hq * d : (hq + hkv) * d].view(n_tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(n_tokens, hkv, d)
    k_cache = torch.zeros(3, bs, hkv, d, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([9, 10, 11, 23], device=DEVICE)
    triton_ops.write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, hkv, d)[slots], k) and torch.equal(v_cache.view(-1, hkv, d)[slots], v)
    untouched = torch.ones(3 * bs, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert not k_cache.view(-1, hkv, d)[untouched.to(DEVICE)].any()


def test_write_kv_cache_converts_to_cache_dtype() -> None:
    k, v = rand(3, 2, 16, seed=11), rand(3, 2, 16, seed=12)
    k_cache = torch.zeros(1, 4, 2, 16, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    triton_ops.write_kv_cache(k, v, k_cache, v_cache, torch.tensor([3, 0, 1], device=DEVICE))
    assert torch.equal(k_cache[0, [3, 0, 1]], k.half()) and torch.equal(v_cache[0, [3, 0, 1]], v.half())
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    triton_ops.write_kv_cache(k, v, k_cache, v_cache, torch.tensor([3, 0, 1], device=DEVICE))
    assert rounds_to(k_cache[0, [3, 0, 1]], k) and rounds_to(v_cache[0, [3, 0, 1]], v)
