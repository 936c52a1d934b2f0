"""What the per-family architecture tests (tests/engine/test_arch_*.py) share: their tiny checkpoints as
session fixtures, and the checks of ferry's greedy tokens and logprobs against a transformers reference
(``reference(path, prompt, max_new) -> (tokens, raw logits)``, conftest's ``hf_reference`` or a
family's own)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams

Reference = Callable[[Path, list[int], int], tuple[list[int], torch.Tensor]]


def tiny_model_fixtures(table: dict[str, tuple[str, int]], namespace: dict[str, Any]) -> None:
    """A session fixture in ``namespace`` (a test module's globals) per ``table`` entry: fixture name ->
    (``engine.demo.build_model`` architecture, seed), built once into the session's models root."""

    def fixture(name: str, arch: str, seed: int):  # noqa: ANN202 - a pytest fixture
        @pytest.fixture(scope="session", name=name)
        def build(models_root: Path) -> Path:
            from engine.demo import build_model

            return build_model(models_root / name.removeprefix("tiny_"), arch, seed=seed)

        return build

    for name, (arch, seed) in table.items():
        namespace[name] = fixture(name, arch, seed)


def greedy(max_new: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=0)


def assert_matches(out, ref_tokens: list[int], ref_logits: torch.Tensor) -> None:  # noqa: ANN001
    """``out`` (a RequestOutput) has the reference's tokens, each logprob within 1e-4 of its logits'."""
    assert out.outputs[0].token_ids == ref_tokens
    ref_lp = torch.log_softmax(ref_logits, dim=-1)
    for step, (tok, entry) in enumerate(zip(ref_tokens, out.outputs[0].logprobs, strict=True)):
        assert abs(entry[tok].logprob - ref_lp[step, tok].item()) < 1e-4


def check_solo_batched_chunked_cached(
    path: Path, prompts: list[list[int]], reference: Reference, max_new: int
) -> None:
    """Prompts of 1, 5, 17 and 64 tokens alone and batched; then in 16-token chunks over 4-token blocks,
    and a prompt sharing 40 tokens with the first, from the prefix cache: all as the reference."""
    params = greedy(max_new)
    chosen = [prompts[i] for i in (0, 2, 4, 6)]
    refs = [reference(path, p, max_new) for p in chosen]
    llm = LLM(str(path), num_kv_blocks=128, max_num_batched_tokens=512)
    solo = [llm.generate([p], params)[0] for p in chosen]
    batched = llm.generate(chosen, params)
    for ref, a, b in zip(refs, solo, batched, strict=True):
        assert_matches(a, *ref)
        assert_matches(b, *ref)
    assert len({t for ref, _ in refs for t in ref}) > 5  # a model repeating one token would hide bugs
    llm.engine.block_manager.check_integrity()
    chunked = LLM(str(path), block_size=4, num_kv_blocks=128, max_num_batched_tokens=16)
    first, second = prompts[6], prompts[6][:40] + prompts[5]
    for prompt, cached in ((first, 0), (second, 40)):
        out = chunked.generate([prompt], params)[0]
        assert out.num_cached_tokens == cached
        assert_matches(out, *reference(path, prompt, max_new))
    chunked.engine.block_manager.check_integrity()


def check_triton_path(path: Path, prompts: list[list[int]], reference: Reference) -> None:
    """The Triton op set and attention (under the interpreter on CPU), chunked over blocks of 16: prompts
    of 1 and 31 tokens, 4 tokens each, as the reference."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")
    chosen = [prompts[0], prompts[5]]
    llm = LLM(
        str(path), attention_backend="triton", block_size=16, num_kv_blocks=32, max_num_batched_tokens=24
    )
    for prompt, out in zip(chosen, llm.generate(chosen, greedy(4)), strict=True):
        assert_matches(out, *reference(path, prompt, 4))


def check_deterministic_solo_equals_batched(
    path: Path, prompts: list[list[int]], reference: Reference, max_new: int
) -> None:
    """``deterministic=True``: prompts of 3, 9 and 31 tokens as the reference, and each request's
    logprobs the same bits alone and beside the others."""
    params = greedy(max_new)
    chosen = [prompts[i] for i in (1, 3, 5)]
    llm = LLM(str(path), deterministic=True, num_kv_blocks=128, max_num_batched_tokens=64)
    solo = [llm.generate([p], params)[0] for p in chosen]
    batched = llm.generate(chosen, params)
    for prompt, a, b in zip(chosen, solo, batched, strict=True):
        assert_matches(a, *reference(path, prompt, max_new))
        assert _chosen_logprobs(a) == _chosen_logprobs(b)


def check_batched_solo_chunked_cached(
    path: Path, prompts: list[list[int]], reference: Reference, max_new: int
) -> None:
    """Prompts of 1, 5, 31, 100 and 200 tokens batched as the reference, one of them alone as in the
    batch; then in 16-token chunks over 4-token blocks and behind a 40-token prefix hit, whose new
    tokens' positions (learned embeddings, ALiBi distances) start at 40."""
    params = greedy(max_new)
    chosen = [prompts[i] for i in (0, 2, 5, 7, 9)]
    llm = LLM(str(path), num_kv_blocks=256, max_num_batched_tokens=512)
    batched = llm.generate(chosen, params)
    for prompt, out in zip(chosen, batched, strict=True):
        assert_matches(out, *reference(path, prompt, max_new))
    assert llm.generate([chosen[3]], params)[0].outputs[0].token_ids == batched[3].outputs[0].token_ids
    assert len({t for out in batched for t in out.outputs[0].token_ids}) > 5  # not one repeated token
    chunked = LLM(str(path), block_size=4, num_kv_blocks=128, max_num_batched_tokens=16)
    first, second = prompts[6], prompts[6][:40] + prompts[5]
    for prompt, cached in ((first, 0), (second, 40)):
        out = chunked.generate([prompt], params)[0]
        assert out.num_cached_tokens == cached
        assert_matches(out, *reference(path, prompt, max_new))
    chunked.engine.block_manager.check_integrity()


def _chosen_logprobs(out) -> list[float]:  # noqa: ANN001
    return [e[t].logprob for t, e in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)]
