"""The fused mixture-of-experts kernels (engine/kernels/triton_moe.py) against the expert loop of
engine/models/moe.py, on the same weights and routing. Under Triton's interpreter without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")

import torch.nn.functional as F  # noqa: E402

from engine import ops  # noqa: E402
from engine.kernels import triton_moe  # noqa: E402
from engine.models.config import MoEConfig  # noqa: E402
from engine.models.moe import MoE  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER, EXPERTS = 64, 48, 8


def _layer(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w13": (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / 8).to(DEVICE, dtype),
        "w2": (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / 8).to(DEVICE, dtype),
    }


def _routing(tokens: int, top_k: int, skew: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(EXPERTS, generator=g)[:top_k] for _ in range(tokens)])
    if skew:  # expert 3 takes every token's first slot (more rows than a block), 0 and 7 none
        experts[:, 0] = 3
        experts[:, 1:] = torch.where(experts[:, 1:] == 3, 5, experts[:, 1:])
        experts = torch.where((experts == 0) | (experts == 7), 6, experts)
    weights = torch.rand(tokens, top_k, generator=g)
    return weights.to(DEVICE), experts.to(DEVICE)


def _moe(top_k: int, fused: bool) -> MoE:
    cfg = MoEConfig(
        num_experts=EXPERTS,
        experts_per_token=top_k,
        num_shared_experts=1,
        intermediate_size=INTER,
        first_dense_layers=0,
        num_groups=1,
        topk_groups=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        scoring="softmax",
        topk_method="greedy",
    )
    return MoE(cfg, F.linear, ops.silu_and_mul, triton_moe.fused_moe if fused else None)


@pytest.mark.parametrize(
    ("tokens", "top_k", "skew"), [(1, 1, False), (5, 2, False), (37, 2, True), (20, 4, True)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_the_expert_loop(tokens: int, top_k: int, skew: bool, dtype: torch.dtype) -> None:
    layer = _layer(dtype)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    weights, experts = _routing(tokens, top_k, skew)
    loop = _moe(top_k, False)._loop(x, layer, weights, experts)
    fused = triton_moe.fused_moe(x, layer["w13"], layer["w2"], weights, experts, ops.silu_and_mul)
    assert fused.dtype == dtype and fused.shape == x.shape
    # The loop rounds each expert's share to the activation dtype before adding; the kernel sums
    # a token's shares in fp32 and rounds once.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (fused.float() - loop.float()).abs().max() <= tol * loop.float().abs().max()


def test_align_groups_pairs_by_expert_in_whole_blocks() -> None:
    experts = torch.tensor([[3, 1], [1, 3], [3, 6]], device=DEVICE)  # pairs 0..5
    pairs, block_expert = triton_moe.align(experts, EXPERTS)
    m, pad = triton_moe.BLOCK_M, 6
    # The worst case without reading the counts back: ceil(6 / m) blocks, plus one partial block
    # for each expert that could have pairs (at most 6 here).
    assert block_expert.numel() == 1 + 6 and pairs.numel() == m * block_expert.numel()
    rows = pairs.view(-1, m).tolist()
    assert rows[0] == [1, 2] + [pad] * (m - 2)  # expert 1: token 0 slot 1, token 1 slot 0
    assert rows[1] == [0, 3, 4] + [pad] * (m - 3)  # expert 3, in token order
    assert rows[2] == [5] + [pad] * (m - 1)  # expert 6
    assert rows[3:] == [[pad] * m] * 4
    assert block_expert.tolist() == [1, 3, 6, -1, -1, -1, -1]


def _host_dot_depends_on_row_position() -> bool:
    """Whether the interpreter's ``tl.dot`` (numpy's matmul, the host BLAS) gives a row another
    result at another row of the tile. A GPU's tensor cores do not; some CPUs' BLAS kernels do
    (seen on an AMD EPYC: the last rows of a 16-row tile take another micro-kernel)."""
    if DEVICE == "cuda":
        return False
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((triton_moe.BLOCK_M, HIDDEN), dtype=np.float32)
    b = rng.standard_normal((HIDDEN, 2 * INTER), dtype=np.float32)
    rolled = np.roll(a, 5, axis=0) @ b
    return not np.array_equal(np.roll(a @ b, 5, axis=0), rolled)


def test_a_tokens_result_does_not_depend_on_its_batch() -> None:
    layer = _layer(torch.float32)
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    weights, experts = _routing(24, 2, True)
    batch = triton_moe.fused_moe(x, layer["w13"], layer["w2"], weights, experts, ops.silu_and_mul)
    # A token's rows sit at other tile rows alone than in the batch: bit for bit wherever the
    # dot itself is row-invariant (GPUs), else to the last bits of fp32.
    atol = 1e-6 if _host_dot_depends_on_row_position() else 0.0
    for i in (0, 11, 23):
        alone = triton_moe.fused_moe(
            x[i : i + 1], layer["w13"], layer["w2"], weights[i : i + 1], experts[i : i + 1], ops.silu_and_mul
        )
        torch.testing.assert_close(alone[0], batch[i], rtol=0.0, atol=atol)


def test_moe_forward_uses_the_fused_experts_with_the_shared_ones() -> None:
    """MoE.forward with the Triton op set: routing, fused experts, plus a gated shared expert."""
    layer = _layer(torch.float32)
    g = torch.Generator().manual_seed(3)
    layer["router"] = torch.randn(EXPERTS, HIDDEN, generator=g).to(DEVICE)
    layer["router_bias"] = torch.zeros(EXPERTS, device=DEVICE)
    layer["gate_up"] = (torch.randn(2 * INTER, HIDDEN, generator=g) / 8).to(DEVICE)
    layer["down"] = (torch.randn(HIDDEN, INTER, generator=g) / 8).to(DEVICE)
    layer["shared_gate"] = torch.randn(1, HIDDEN, generator=g).to(DEVICE)
    x = torch.randn(9, HIDDEN, generator=g).to(DEVICE)
    fused, loop = _moe(2, True).forward(x, layer), _moe(2, False).forward(x, layer)
    assert (fused - loop).abs().max() <= 1e-5 * loop.abs().max()
