"""Every Triton kernel compiles for an H100/H200 (sm_90) with the launch parameters the wrappers
use, and fits its shared memory: the real compiler's checks, which the interpreter tests skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")

ROOT = Path(__file__).resolve().parents[2]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
KERNELS = ["unified_attention", "split_kv_decode", "split_kv_reduce", "rms_norm", "rms_norm+residual",
           "rotary_embedding", "silu_and_mul", "write_kv_cache", "moe_gate_up", "moe_down", "mla_attention", "linear"]  # fmt: skip


@pytest.mark.skipif(
    not PTXAS.exists(), reason="this triton build ships no ptxas to compile CUDA kernels with"
)
def test_every_kernel_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "engine.kernels.compile_check", "--arch", "90", "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "49/49 kernels compiled for sm_90"
    for kernel in KERNELS:
        assert any(line.split()[1] == kernel and line.rstrip().endswith(" B") for line in lines[:-1]), kernel
    # The GQA, one-sequence and fp32 variants are among them.
    assert any("qwen2-7b bfloat16 num_seqs=1" in line for line in lines)
    assert any("unified_attention" in line and "float32" in line for line in lines)
    # The KV write into an fp8 cache (scaled, saturated).
    assert any("write_kv_cache" in line and "fp8 cache" in line for line in lines)
    # gpt-oss's attention sinks, in the prefill/decode kernel and the split-KV merge.
    assert any("unified_attention" in line and "gpt-oss-20b bfloat16 sinks" in line for line in lines)
    assert any("split_kv_reduce" in line and "gpt-oss-20b bfloat16 sinks" in line for line in lines)
    # ALiBi (Bloom, MPT), in the prefill/decode kernel and the split-KV one.
    assert any("unified_attention" in line and "bloom-7b1 bfloat16 alibi" in line for line in lines)
    assert any("split_kv_decode" in line and "bloom-7b1 bfloat16 alibi" in line for line in lines)


def test_refuses_to_run_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "engine.kernels.compile_check", "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "unset TRITON_INTERPRET" in proc.stdout
