"""Compile every Triton kernel for a CUDA GPU without having one (ahead of time, down to a cubin).

The interpreter tests prove the kernels' arithmetic; this proves the real compiler accepts them
(typed loop-carried values, dot shapes, layouts) with the exact launch parameters the wrappers use
(the ``*_launch`` functions), and that each fits the architecture's shared memory, which the
interpreter never checks. It needs triton's bundled ``ptxas`` but no GPU and no CUDA driver.

    python -m engine.kernels.compile_check [--arch 90] [--quick]

Exit status 1 if any kernel fails. Must run without ``TRITON_INTERPRET`` (interpreted kernels
cannot be compiled); it refuses to start otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

# Shared memory one block may use, by compute capability (bytes, opt-in maximum).
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
# Pointer arguments that are not tensors of the model dtype.
INDEX_POINTERS = {
    "positions_ptr": "*i64", "slot_ptr": "*i64", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
    "block_tables_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "cache_ptr": "*fp32",
    "pairs_ptr": "*i32", "block_expert_ptr": "*i32", "weight_ptr": "*fp32",
    "token_seq_ptr": "*i32", "token_pos_ptr": "*i32", "sinks_ptr": "*fp32", "alibi_ptr": "*fp32",
}  # fmt: skip
FLOAT_SCALARS = {"eps", "scale", "softcap", "k_scale", "v_scale"}
TRITON_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class Model:
    """The attention/MLP geometry of a model family."""

    name: str
    hq: int
    hkv: int
    head_dim: int
    hidden: int
    inter: int


MODELS = [
    Model("llama-3-8b", 32, 8, 128, 4096, 14336),
    Model("qwen2-7b", 28, 4, 128, 3584, 18944),  # 7 queries per KV head: padded group
    Model("mha-d64", 16, 16, 64, 1024, 2816),  # one query per KV head: Triton specialises it to 1
    Model("d80", 8, 1, 80, 640, 1728),  # head dim not a power of two
    Model("tiny", 4, 2, 16, 64, 128),  # the test checkpoints
]


@dataclass(frozen=True)
class MoEModel:
    """The routed-expert geometry of a mixture of experts."""

    name: str
    hidden: int
    inter: int  # one expert's intermediate size
    top_k: int


MOE_MODELS = [
    MoEModel("deepseek-v3", 7168, 2048, 8),
    MoEModel("qwen3-30b-a3b", 2048, 768, 8),
    MoEModel("tiny-moe", 64, 32, 2),  # the test checkpoints
]


# Latent attention geometries: (name, latent dims = values, rotary dims).
MLA_MODELS = [("deepseek-v3", 512, 64), ("tiny-mla", 32, 16)]


@dataclass
class Outcome:
    kernel: str
    variant: str
    ok: bool
    seconds: float
    shared: int = 0
    error: str = ""


def _signature(fn, dtype: str, constexprs: dict[str, object]) -> dict[str, str]:  # noqa: ANN001
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in INDEX_POINTERS:
            sig[name] = INDEX_POINTERS[name]
        elif name.endswith("cache_ptr") and constexprs.get("FP8_MAX"):  # the KV write into an fp8 cache
            sig[name] = "*fp8e4nv"
        elif name.endswith("_ptr"):
            sig[name] = "*" + dtype
        else:
            sig[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    return sig


def compile_one(fn, dtype: str, launch, arch: int, ones: tuple[str, ...] = ()) -> int:  # noqa: ANN001
    """Compile ``fn`` for ``sm_{arch}``; ``ones`` are integer arguments whose runtime value is 1
    (Triton turns those into constants, a different program). Returns the shared memory used."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {**launch.constexprs, **dict.fromkeys(ones, 1)}
    src = ASTSource(fn=fn, signature=_signature(fn, dtype, constexprs), constexprs=constexprs)
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    shared = int(kernel.metadata.shared)
    limit = SHARED_LIMIT.get(arch)
    if limit is not None and shared > limit:
        raise RuntimeError(f"needs {shared} bytes of shared memory, sm_{arch} has {limit}")
    return shared


def plan(quick: bool) -> list[tuple[str, str, object, str, object, tuple[str, ...]]]:
    """(kernel name, variant, kernel, triton dtype, launch, args equal to 1) for every check."""
    import torch

    from engine.kernels import triton_attention as att
    from engine.kernels import triton_decode as dec
    from engine.kernels import triton_matmul as mm
    from engine.kernels import triton_mla as mla
    from engine.kernels import triton_moe as moe
    from engine.kernels import triton_ops as ops

    models = [MODELS[0], MODELS[1], MODELS[4]] if quick else MODELS
    dtypes = ["bfloat16", "float32"] if quick else ["bfloat16", "float16", "float32"]
    jobs = []
    for m in models:
        g = m.hq // m.hkv
        ones = ("queries_per_kv",) if g == 1 else ()
        for dname in dtypes:
            dt, tdt = getattr(torch, dname), TRITON_DTYPES[dname]
            tag = f"{m.name} {dname}"
            uni = att.unified_launch(g, m.head_dim, dt)
            jobs.append(("unified_attention", tag, att._unified_attention_kernel, tdt, uni, ones))
            split = dec.split_launch(
                g, m.head_dim, dt, dec.DEFAULT_SPLIT_SIZE, att.default_block_n(uni["BLOCK_D"])
            )
            jobs.append(("split_kv_decode", tag, dec._decode_split_kernel, tdt, split, ones))
            if dname == dtypes[0]:
                # One sequence in the batch: num_seqs becomes a constant in the binary search.
                jobs.append(("unified_attention", tag + " num_seqs=1", att._unified_attention_kernel, tdt, uni,
                             (*ones, "num_seqs")))  # fmt: skip
            if quick and m is not models[0]:
                continue
            reduce = dec.reduce_launch(m.head_dim, dec.DEFAULT_SPLIT_SIZE)
            jobs.append(("split_kv_reduce", tag, dec._decode_reduce_kernel, tdt, reduce, ()))
            for residual in (False, True):
                name = "rms_norm" + ("+residual" if residual else "")
                jobs.append(
                    (name, tag, ops._rms_norm_kernel, tdt, ops.rms_norm_launch(m.hidden, residual), ())
                )
            rot = ops.rotary_launch(m.hq, m.hkv, m.head_dim // 2)
            jobs.append(("rotary_embedding", tag, ops._rotary_kernel, tdt, rot, ()))
            jobs.append(
                ("silu_and_mul", tag, ops._silu_and_mul_kernel, tdt, ops.silu_and_mul_launch(m.inter), ())
            )
            kv = ops.write_kv_launch(m.hkv, m.head_dim)
            jobs.append(("write_kv_cache", tag, ops._write_kv_kernel, tdt, kv, ()))
            if dname == dtypes[0]:  # an fp8 cache: K/V divided by their scales, saturated, rounded
                fp8 = ops.write_kv_launch(m.hkv, m.head_dim, float(torch.finfo(torch.float8_e4m3fn).max))
                jobs.append(("write_kv_cache", tag + " fp8 cache", ops._write_kv_kernel, tdt, fp8, ()))
    # The deterministic linear: one job per distinct launch (big models share their tiles).
    linears = set()
    for m in models:
        for dname in dtypes:
            dt, tdt = getattr(torch, dname), TRITON_DTYPES[dname]
            qkv = (m.hq + 2 * m.hkv) * m.head_dim
            for proj, n, k, bias in [("qkv+bias", qkv, m.hidden, True), ("down", m.hidden, m.inter, False)]:
                launch = mm.matmul_launch(n, k, dt, bias, False)
                key = (dname, *launch.constexprs.values())
                if key not in linears:
                    linears.add(key)
                    jobs.append(("linear", f"{m.name} {dname} {proj}", mm._matmul_kernel, tdt, launch, ()))
    # gpt-oss's attention sinks (compiled in only for models with them): gpt-oss-20b's geometry.
    sink_model = Model("gpt-oss-20b", 64, 8, 64, 2880, 2880)
    for dname in dtypes[:1] if quick else dtypes:
        dt, tdt = getattr(torch, dname), TRITON_DTYPES[dname]
        tag = f"{sink_model.name} {dname} sinks"
        g = sink_model.hq // sink_model.hkv
        uni = att.unified_launch(g, sink_model.head_dim, dt, sinks=True)
        jobs.append(("unified_attention", tag, att._unified_attention_kernel, tdt, uni, ()))
        reduce = dec.reduce_launch(sink_model.head_dim, dec.DEFAULT_SPLIT_SIZE, sinks=True)
        jobs.append(("split_kv_reduce", tag, dec._decode_reduce_kernel, tdt, reduce, ()))
    # ALiBi (compiled in only for Bloom and MPT): bloom-7b1's geometry, one query per KV head.
    alibi_model = Model("bloom-7b1", 32, 32, 128, 4096, 16384)
    for dname in dtypes[:1] if quick else dtypes:
        dt, tdt = getattr(torch, dname), TRITON_DTYPES[dname]
        tag = f"{alibi_model.name} {dname} alibi"
        uni = att.unified_launch(1, alibi_model.head_dim, dt, alibi=True)
        jobs.append(("unified_attention", tag, att._unified_attention_kernel, tdt, uni, ("queries_per_kv",)))
        split = dec.split_launch(
            1,
            alibi_model.head_dim,
            dt,
            dec.DEFAULT_SPLIT_SIZE,
            att.default_block_n(uni["BLOCK_D"]),
            alibi=True,
        )
        jobs.append(("split_kv_decode", tag, dec._decode_split_kernel, tdt, split, ("queries_per_kv",)))
    for e in [MOE_MODELS[0], MOE_MODELS[2]] if quick else MOE_MODELS:
        for dname in dtypes:
            dt, tdt, tag = getattr(torch, dname), TRITON_DTYPES[dname], f"{e.name} {dname}"
            gate_up = moe.matmul_launch(2 * e.inter, e.hidden, dt, e.top_k, False, False)
            jobs.append(("moe_gate_up", tag, moe._moe_matmul_kernel, tdt, gate_up, ()))
            down = moe.matmul_launch(e.hidden, e.inter, dt, 1, True, False)
            jobs.append(("moe_down", tag, moe._moe_matmul_kernel, tdt, down, ()))
    for name, v_dim, rope in MLA_MODELS:
        for dname in dtypes:
            dt, tdt = getattr(torch, dname), TRITON_DTYPES[dname]
            launch = mla.mla_launch(v_dim, rope, dt, False)
            jobs.append(("mla_attention", f"{name} {dname}", mla._mla_kernel, tdt, launch, ()))
    return jobs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compile ferry's Triton kernels for a CUDA GPU without one.")
    p.add_argument(
        "--arch", type=int, default=90, help="compute capability x10 (80 A100, 89 L4, 90 H100/H200)"
    )
    p.add_argument("--quick", action="store_true", help="fewer model shapes and dtypes")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
        return 2
    outcomes = []
    for kernel, variant, fn, dtype, launch, ones in plan(args.quick):
        started = time.perf_counter()
        try:
            shared = compile_one(fn, dtype, launch, args.arch, ones)
            outcomes.append(Outcome(kernel, variant, True, time.perf_counter() - started, shared))
        except Exception as exc:  # report every kernel, not just the first failure
            err = f"{type(exc).__name__}: {exc}".strip().splitlines()
            outcomes.append(
                Outcome(kernel, variant, False, time.perf_counter() - started, error=err[-1][:200])
            )
        o = outcomes[-1]
        status = f"ok  smem {o.shared:>6} B" if o.ok else f"FAILED {o.error}"
        print(f"sm_{args.arch} {o.kernel:<18} {o.variant:<32} {o.seconds:5.1f}s  {status}", flush=True)
    failed = [o for o in outcomes if not o.ok]
    print(f"{len(outcomes) - len(failed)}/{len(outcomes)} kernels compiled for sm_{args.arch}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
