"""The batch-invariant matmul (engine/kernels/triton_matmul.py), deterministic mode's dense layers
on CUDA: equal to a float64 reference within the dtype's rounding, and each row's bits the same
whatever the batch around it. Under Triton's interpreter without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")

import torch.nn.functional as F  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.kernels.triton_matmul import invariant_matmul, matmul_launch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _weights(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    return w, torch.randn(n, generator=g).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (70, 45), (16, 200)])  # odd N and K: masked tiles
def test_equals_the_reference_with_and_without_bias(dtype, n, k) -> None:
    w, b = _weights(n, k, dtype)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    for bias in (None, b):
        want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        got = invariant_matmul(x, w, bias)
        assert got.dtype == dtype and got.shape == (37, n)
        assert (got.double() - want).abs().max() / want.abs().max() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_its_batch(dtype) -> None:
    n, k = 80, 72
    w, b = _weights(n, k, dtype)
    rows = torch.randn(70, k, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    full = invariant_matmul(rows, w, b)
    for size in (1, 3, 17, 33):
        for start in (0, 5, 70 - size):  # the row lands at another place in another tile
            part = invariant_matmul(rows[start : start + size], w, b)
            assert torch.equal(part, full[start : start + size]), (size, start)
    assert torch.equal(invariant_matmul(rows.flip(0), w, b), full.flip(0))


def test_shapes_views_and_mistakes() -> None:
    w, _ = _weights(32, 48, torch.float32)
    x = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    view = x[..., ::2]  # [2, 5, 48], not contiguous in its last dim
    assert torch.allclose(invariant_matmul(view, w), F.linear(view, w), atol=1e-5)
    assert invariant_matmul(view, w).shape == (2, 5, 32)
    assert invariant_matmul(torch.empty(0, 48, device=DEVICE), w).shape == (0, 32)
    with pytest.raises(ValueError, match="x has 47 features, the weight 48"):
        invariant_matmul(torch.zeros(3, 47, device=DEVICE), w)


def test_tiles_are_chosen_by_the_weight_alone() -> None:
    a = matmul_launch(4096, 4096, torch.bfloat16, False, False)
    assert (a["BLOCK_M"], a["BLOCK_N"], a["BLOCK_K"]) == (64, 128, 64)
    assert matmul_launch(4096, 4096, torch.float32, True, False)["DOT_PRECISION"] == "ieee"


def test_deterministic_engine_on_the_kernel_is_batch_invariant(tiny_llama, monkeypatch) -> None:
    """The engine's deterministic mode with its dense layers on this kernel (forced here; on CUDA
    they take it by themselves): a prompt's logprobs alone and beside others are the same bits."""
    from engine.models import llama

    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
    prompts = [[5, 9, 13, 200, 7], list(range(30, 52)), [11, 12]]
    mkl = LLM(str(tiny_llama), deterministic=True, num_kv_blocks=32).generate([prompts[0]], params)[0]
    calls = []

    def on_the_kernel(x, w, b=None):  # noqa: ANN001, ANN202
        calls.append(x.shape[0])
        return invariant_matmul(x, w, b)

    monkeypatch.setattr(llama, "invariant_linear", on_the_kernel)
    llm = LLM(str(tiny_llama), deterministic=True, num_kv_blocks=32)
    alone = llm.generate([prompts[0]], params)[0].outputs[0]
    assert calls and 5 in calls  # the prompt's prefill went through the kernel
    batched = llm.generate(prompts, params)[0].outputs[0]
    logprobs = [{t: e.logprob for t, e in pos.items()} for pos in alone.logprobs]
    assert alone.token_ids == batched.token_ids == mkl.outputs[0].token_ids
    assert logprobs == [{t: e.logprob for t, e in pos.items()} for pos in batched.logprobs]
    for pos, ref in zip(logprobs, mkl.outputs[0].logprobs, strict=True):
        assert all(abs(lp - ref[t].logprob) < 1e-4 for t, lp in pos.items())
