"""``LLM.close()``: queued KV tier writes reach the tier before the LLM lets go of it.

Real tiny Llama and a private Redis. A fresh LLM must then load the prefix from the tier.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams

BLOCK = 16
PROMPT = [(5 * i + 11) % 900 + 10 for i in range(5 * BLOCK)]  # 80 tokens: 5 full blocks
LOADABLE_TOKENS = 4 * BLOCK  # the last prompt token is always computed, so 4 blocks can load
SAVED = (len(PROMPT) + 12 - 1) // BLOCK  # full blocks an 80 + 12 token run registers
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
OPTIONS = {"block_size": BLOCK, "num_kv_blocks": 64}


def _cached_tokens(model: Path, redis_url: str) -> int:
    with LLM(str(model), kv_tier=redis_url, **OPTIONS) as fresh:
        return fresh.generate([PROMPT], GREEDY)[0].num_cached_tokens


def test_close_flushes_queued_writes(tiny_llama: Path, redis_url: str) -> None:
    llm = LLM(str(tiny_llama), kv_tier=redis_url, **OPTIONS)
    assert llm.generate([PROMPT], GREEDY)[0].num_cached_tokens == 0
    llm.close()
    assert llm.closed
    assert llm.engine.connector.stats().blocks_saved == SAVED
    llm.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([PROMPT], GREEDY)
    assert _cached_tokens(tiny_llama, redis_url) == LOADABLE_TOKENS


def test_context_manager_closes(tiny_llama: Path, redis_url: str) -> None:
    with LLM(str(tiny_llama), kv_tier=redis_url, **OPTIONS) as llm:
        llm.generate([PROMPT], GREEDY)
    assert llm.closed and llm.engine.connector.stats().blocks_saved == SAVED
    assert _cached_tokens(tiny_llama, redis_url) == LOADABLE_TOKENS


def test_close_without_tier(tiny_llama: Path) -> None:
    with LLM(str(tiny_llama), **OPTIONS) as llm:
        assert len(llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids) == 12
    assert llm.closed


def test_interpreter_exit_flushes_without_close(tiny_llama: Path, redis_url: str) -> None:
    # The script exits right after generating, never calling close(). atexit handlers run last
    # registered first, so the handler registered before the LLM runs after the LLM's finalizer
    # and sees whether the safety net closed (flushed) the connector. (It is registered before any
    # import, so before weakref.finalize's own atexit hook.)
    script = textwrap.dedent(
        f"""
        import atexit
        def report():
            print("closed", llm.closed, "saved", llm.engine.connector.stats().blocks_saved)
        atexit.register(report)
        from engine.llm import LLM
        from engine.sampling_params import SamplingParams
        llm = LLM({str(tiny_llama)!r}, kv_tier={redis_url!r}, **{OPTIONS!r})
        llm.generate([{PROMPT!r}], SamplingParams(max_tokens=12, temperature=0.0))
        """
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == f"closed True saved {SAVED}"
    assert _cached_tokens(tiny_llama, redis_url) == LOADABLE_TOKENS
