"""Prompt logprobs of a long prompt are computed from its logits a bounded number of rows at a
time (``kv_budget.logit_rows``: what the GPU's activation reserve counts), equal to transformers'
and to one unchunked pass."""

from __future__ import annotations

from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.kv_budget import MIN_LOGIT_ROWS

PROMPT = [(13 * i + 7) % 900 + 10 for i in range(200)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)


def _logits_rows(llm: LLM) -> list[int]:
    """The row count of every logits computation from now on (an observer; nothing replaced)."""
    model, rows = llm.engine.model_runner.model, []
    compute = model.compute_logits

    def observe(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return compute(hidden)

    model.compute_logits = observe
    return rows


def _flat(out) -> list[tuple[int, float, int]]:
    return [(tok, e.logprob, e.rank) for pos in out.prompt_logprobs[1:] for tok, e in pos.items()]


def test_long_prompts_logprobs_come_in_chunks_and_match(tiny_llama: Path, hf_model) -> None:
    small = LLM(str(tiny_llama), max_num_seqs=1, num_kv_blocks=64, deterministic=True)
    rows = _logits_rows(small)
    chunked = small.generate([PROMPT], PARAMS)[0]
    assert small.engine.logit_rows == MIN_LOGIT_ROWS == 64
    assert max(rows) == 64 and sum(r for r in rows if r > 1) == 199  # 64 + 64 + 64 + 7 prompt rows
    whole = LLM(str(tiny_llama), max_num_seqs=256, num_kv_blocks=64, deterministic=True)
    rows = _logits_rows(whole)
    unchunked = whole.generate([PROMPT], PARAMS)[0]
    assert 199 in rows
    assert _flat(chunked) == _flat(unchunked)
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(tiny_llama)(torch.tensor([PROMPT])).logits[0].float(), -1)
    assert chunked.prompt_logprobs[0] is None and len(chunked.prompt_logprobs) == len(PROMPT)
    for p in range(1, len(PROMPT)):
        entry = chunked.prompt_logprobs[p][PROMPT[p]]
        assert abs(entry.logprob - ref[p - 1, PROMPT[p]].item()) < 1e-4
