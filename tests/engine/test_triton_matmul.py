"""The batch-invariant matmul (engine/kernels/triton_matmul.py) against a float64 reference, its
rows' independence of the batch, and deterministic mode through it. Under Triton's interpreter
without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")

import torch.nn.functional as F  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.kernels import triton_matmul  # noqa: E402
from engine.models import decoder  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# K and N not multiples of any block; K spans several BLOCK_K steps.
K, N = 100, 70


def _weights(dtype: torch.dtype, k: int = K, n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype), torch.randn(n, generator=g).to(
        DEVICE, dtype
    )


def _x(m: int, dtype: torch.dtype, k: int = K, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("m", "k", "n"), [(1, K, N), (37, K, N), (5, 16, 16), (3, 300, 130)])
def test_equals_a_float64_reference(dtype: torch.dtype, with_bias: bool, m: int, k: int, n: int) -> None:
    w, b = _weights(dtype, k, n)
    x = _x(m, dtype, k)
    bias = b if with_bias else None
    out = triton_matmul.linear(x, w, bias)
    ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert out.dtype == dtype and out.shape == (m, n)
    # One rounding of an fp32 sum to the output dtype, plus fp32 summation. bf16: within one ulp
    # (2^-7 relative), as Triton's interpreter truncates to bf16 where a GPU rounds to nearest.
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    assert ((out.double() - ref).abs() <= tol * ref.abs() + 1e-5).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    w, b = _weights(dtype)
    big = _x(130, dtype)  # past two row blocks
    target = big[7]
    alone = triton_matmul.linear(target[None], w, b)[0]
    for m in (1, 3, 17, 64, 130):
        for pos in {0, m // 2, m - 1}:
            batch = _x(m, dtype, seed=m + 10)
            batch[pos] = target
            assert torch.equal(triton_matmul.linear(batch, w, b)[pos], alone), (m, pos)


def test_non_contiguous_inputs_and_leading_dims() -> None:
    w, b = _weights(torch.float32)
    wide = _x(6, torch.float32, k=2 * K)
    x = wide[:, ::2]  # a row stride of 2K and an element stride of 2
    wt = w.t().contiguous().t()  # the same values, column-major
    out = triton_matmul.linear(x, wt, b)
    assert torch.equal(out, triton_matmul.linear(x.contiguous(), w, b))
    stacked = triton_matmul.linear(x.contiguous().view(2, 3, K), w, b)
    assert stacked.shape == (2, 3, N) and torch.equal(stacked.reshape(6, N), out)
    assert triton_matmul.linear(x[:0], w, b).shape == (0, N)


def test_invariant_linear_sends_kernel_devices_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    w, b = _weights(torch.float32)
    x = _x(3, torch.float32)
    monkeypatch.setattr(decoder, "KERNEL_DEVICES", frozenset({"cuda", "cpu"}))
    assert torch.equal(decoder.invariant_linear(x, w, b), triton_matmul.linear(x, w, b))


def test_without_triton_a_kernel_device_warns_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.kernels

    monkeypatch.setattr(engine.kernels, "triton_usable", lambda device: False)
    with pytest.warns(UserWarning, match="depend on the batch"):
        assert decoder._kernel_linear.__wrapped__("cuda") is F.linear


@pytest.mark.skipif(DEVICE == "cuda", reason="the MKL path is CPU's; on CUDA the kernel always runs")
def test_cpu_keeps_the_mkl_path() -> None:
    w, b = _weights(torch.float32)
    x = _x(3, torch.float32)
    padded = torch.cat([x, x.new_zeros(decoder.MIN_INVARIANT_ROWS - 3, K)])
    assert torch.equal(decoder.invariant_linear(x, w, b), F.linear(padded, w, b)[:3])


def test_deterministic_logprobs_through_the_kernel_are_batch_invariant(
    tiny_llama, vocab_size, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt's logprobs alone equal its logprobs beside others and with its prompt chunked, with
    every linear layer (the lm_head included) in the Triton matmul."""
    monkeypatch.setattr(decoder, "KERNEL_DEVICES", frozenset({"cuda", "cpu"}))
    calls = []

    def counted(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return triton_matmul.linear(x, w, b)

    monkeypatch.setattr(decoder, "_kernel_linear", lambda device: counted)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (9, 20, 4)]
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, ignore_eos=True)

    def run(batch: list[list[int]], **opts: int) -> tuple[list[int], float | None, object]:
        llm = LLM(str(tiny_llama), num_kv_blocks=64, deterministic=True, **opts)
        out = llm.generate(batch, params)[0].outputs[0]
        return out.token_ids, out.cumulative_logprob, out.logprobs

    alone = run(prompts[:1])
    assert calls and min(calls) == 1  # decode steps of one row went through the kernel
    assert run(prompts) == alone
    assert run(prompts[:1], max_num_batched_tokens=4) == alone  # its prompt in chunks of 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_matmul_equals_bmm_and_a_tokens_result_ignores_the_rest(dtype: torch.dtype) -> None:
    """DeepSeek's absorbed attention multiplies each head by its own matrix: ``x[t, h] @ w[h]``.
    Against a float64 ``bmm``, and each token's bits the same alone or among 33 (3 heads, odd
    a and b)."""
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(3, 40, 24, generator=g) / 40**0.5).to(DEVICE, dtype)
    x = torch.randn(33, 3, 40, generator=g).to(DEVICE, dtype)
    out = triton_matmul.per_head_matmul(x, w)
    want = torch.bmm(x.double().transpose(0, 1), w.double()).transpose(0, 1)
    assert out.shape == (33, 3, 24) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2**-7  # as the reference test above
    assert ((out.double() - want).abs() <= tol * want.abs() + 1e-5).all()
    for lo, hi in ((0, 1), (5, 22), (32, 33)):
        assert torch.equal(triton_matmul.per_head_matmul(x[lo:hi], w), out[lo:hi]), (lo, hi)
    with pytest.raises(ValueError, match=r"x is \[T, 3, 40\], w \[3, 24, 40\]"):
        triton_matmul.per_head_matmul(x, w.transpose(1, 2))


def test_deepseek_deterministic_logprobs_through_the_kernels_are_batch_invariant(
    tiny_deepseek, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Latent attention's per-head matmuls go through the kernel too: a prompt's logprobs alone and
    beside others are the same bits."""
    monkeypatch.setattr(decoder, "KERNEL_DEVICES", frozenset({"cuda", "cpu"}))
    heads = []
    per_head = triton_matmul.per_head_matmul

    def counted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        heads.append(x.shape[0])
        return per_head(x, w)

    monkeypatch.setattr(triton_matmul, "per_head_matmul", counted)
    prompts = [[5, 9, 13, 200, 7, 44], list(range(30, 47)), [11, 12]]
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=2, ignore_eos=True)

    def run(batch: list[list[int]]) -> tuple[list[int], float | None, object]:
        llm = LLM(str(tiny_deepseek), num_kv_blocks=64, deterministic=True)
        out = llm.generate(batch, params)[0].outputs[0]
        return out.token_ids, out.cumulative_logprob, out.logprobs

    alone = run(prompts[:1])
    assert heads and 1 in heads  # a decode step's one token went through the per-head kernel
    assert run(prompts) == alone
