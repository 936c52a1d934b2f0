"""bench/gpu_kernels.py runs end to end: on a CPU machine it reports that there is no GPU and exits
0, and its --interpret pass checks every kernel (tiny shapes) and writes a complete JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")

ROOT = Path(__file__).resolve().parents[2]
CASES = {
    "rms_norm", "rms_norm+residual", "rotary_embedding", "silu_and_mul", "write_kv_cache", "unified decode",
    "unified prefill", "unified extend", "unified mixed", "unified chunked prefill", "split-KV decode",
    "fused_moe decode", "fused_moe prefill", "mla decode", "mla prefill", "attention, soft-capped",
    "attention, sinks + window", "attention, window", "linear decode", "linear batch", "linear prefill",
}  # fmt: skip


def run_bench(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_kernels", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_without_cuda_it_says_so_and_exits_zero(tmp_path: Path) -> None:
    proc = run_bench("--json", str(tmp_path / "out.json"))
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout
    assert not (tmp_path / "out.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter pass is for machines without a GPU")
def test_interpreter_pass_checks_every_kernel(tmp_path: Path) -> None:
    out = tmp_path / "gpu_kernels.json"
    proc = run_bench("--interpret", "--dtype", "float16", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["interpret"] is True and report["dtype"] == "float16"
    results = {r["kernel"]: r for r in report["results"]}
    assert set(results) == CASES
    for name, r in results.items():
        assert r["ok"] is True and r["error"] is None, name
        assert r["max_rel_err"] < 3e-3, name
    assert results["split-KV decode"]["checks"]["batch_invariant"] is True
    assert results["unified chunked prefill"]["checks"]["chunk_invariant"] is True
    assert results["fused_moe prefill"]["checks"]["batch_invariant"] is True
    assert results["attention, sinks + window"]["checks"]["split_kv_within_tol"] is True
    assert results["linear decode"]["checks"]["batch_invariant"] is True
    assert "21/21 passed" in proc.stdout
