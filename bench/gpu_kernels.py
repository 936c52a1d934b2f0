"""GPU check and micro-benchmark of ferry's Triton kernels (one prepared run, a few minutes on an H200).

For each kernel: checks it against a float32 PyTorch reference on fresh random inputs, checks the
determinism promises on real hardware (split-KV decode run to run and batch-independent; unified
attention rows independent of the batch and of prompt chunking), then times it (median of CUDA-event
timings after warm-up) beside PyTorch's own path and beside the memory-bandwidth floor
(bytes the kernel must move / measured device-to-device copy bandwidth). Prints a table, writes JSON.

    python -m bench.gpu_kernels [--dtype bfloat16] [--json gpu_kernels.json] [--quick]
    python -m bench.gpu_kernels --interpret   # no GPU: tiny correctness pass under TRITON_INTERPRET=1

Without CUDA (and without --interpret) it says so and exits 0. A failing kernel is reported in
its table row; it never stops the run. Timings include no L2 flush between repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial


@dataclass(frozen=True)
class Shapes:
    hidden: int = 4096  # Llama-3-8B-like
    inter: int = 14336
    hq: int = 32
    hkv: int = 8
    head_dim: int = 128
    block_size: int = 16
    tokens: int = 8192  # elementwise ops and KV write
    decode: tuple[int, int] = (64, 2048)  # (sequences, context)
    long_decode: tuple[int, int] = (8, 32768)
    prefill: tuple[int, int] = (4, 2048)  # (sequences, new tokens), no prefix
    extend: tuple[int, int, int] = (4, 3584, 512)  # (sequences, cached, new)
    mixed: tuple[int, int, int] = (63, 2048, 1024)  # (decode rows, their context, one prefill chunk)
    split_size: int = 512
    # Mixture of experts (Qwen3-30B-A3B's layer): hidden, expert intermediate, experts, per token;
    # tokens routed in a decode step and in a prefill chunk.
    moe: tuple[int, int, int, int] = (2048, 768, 128, 8)
    moe_tokens: tuple[int, int] = (64, 4096)
    # Latent attention (DeepSeek-V3): heads, latent (= value) dims, rotary dims; decode
    # (sequences, context) and prefill (sequences, new tokens).
    mla: tuple[int, int, int] = (128, 512, 64)
    mla_decode: tuple[int, int] = (64, 2048)
    mla_prefill: tuple[int, int] = (1, 2048)
    # The deterministic linear (hidden -> inter, Llama-3-8B's gate projection): rows of a decode
    # step of one sequence, of a decode batch and of a prefill chunk.
    linear_rows: tuple[int, int, int] = (1, 32, 2048)


QUICK = Shapes(tokens=2048, decode=(32, 1024), long_decode=(4, 8192), prefill=(2, 1024), extend=(2, 1024, 256),
               mixed=(15, 1024, 256), moe_tokens=(32, 1024), mla_decode=(32, 1024), mla_prefill=(1, 1024),
               linear_rows=(1, 32, 1024))  # fmt: skip
TINY = Shapes(hidden=64, inter=96, hq=4, hkv=2, head_dim=16, tokens=19, decode=(3, 40), long_decode=(2, 150),
              prefill=(2, 33), extend=(2, 17, 16), mixed=(3, 20, 17), split_size=64, moe=(64, 32, 8, 2),
              moe_tokens=(5, 37), mla=(20, 32, 16), mla_decode=(3, 40), mla_prefill=(1, 33),
              linear_rows=(1, 5, 37))  # fmt: skip


@dataclass
class Result:
    kernel: str
    shape: str
    ok: bool | None = None  # None: the check did not run (see error)
    max_rel_err: float | None = None
    checks: dict[str, bool] = field(default_factory=dict)
    triton_ms: float | None = None
    torch_ms: float | None = None
    torch_path: str = ""
    bytes: int = 0
    floor_ms: float | None = None
    tflops: float | None = None
    error: str | None = None


def rel_err(out, ref) -> float:  # noqa: ANN001
    out, ref = out.double(), ref.double()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


class Bench:
    def __init__(self, shapes: Shapes, dtype_name: str, iters: int) -> None:
        import torch

        self.torch = torch
        self.s = shapes
        self.dtype = getattr(torch, dtype_name)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.iters = iters
        self.tol = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.6e-2}[self.dtype]
        self.gen = torch.Generator(device=self.device).manual_seed(0)
        self.copy_gbps = self._copy_bandwidth()

    # -- helpers -----------------------------------------------------------------------------------
    def randn(self, *shape: int, dtype=None):  # noqa: ANN001
        return self.torch.randn(*shape, generator=self.gen, device=self.device).to(dtype or self.dtype)

    def time_ms(self, fn: Callable[[], object]) -> float:
        torch = self.torch
        for _ in range(3):
            fn()
        times = []
        for _ in range(self.iters):
            if self.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def time_torch(self, r: Result, build: Callable[[], Callable[[], object]]) -> float | None:
        """Time PyTorch's path; if it cannot run here, say why in the row and keep the Triton result."""
        try:
            return self.time_ms(build())
        except Exception as exc:
            r.torch_path += f" (failed: {type(exc).__name__}: {str(exc)[:80]})"
            return None

    def _copy_bandwidth(self) -> float:
        n = (1 << 30) if self.device == "cuda" else (1 << 24)
        src = self.torch.empty(n, dtype=self.torch.uint8, device=self.device)
        dst = self.torch.empty_like(src)
        ms = self.time_ms(lambda: dst.copy_(src))
        return 2 * n / (ms * 1e-3) / 1e9  # read + write

    def finish(self, r: Result, nbytes: int, flops: float | None = None) -> Result:
        r.bytes = nbytes
        r.floor_ms = nbytes / (self.copy_gbps * 1e9) * 1e3
        if flops and r.triton_ms:
            r.tflops = flops / (r.triton_ms * 1e-3) / 1e12
        return r

    # -- elementwise ops ---------------------------------------------------------------------------
    def rms_norm(self, residual: bool) -> Result:
        from engine import ops
        from engine.kernels import triton_ops

        t, h, e = self.s.tokens, self.s.hidden, self.dtype.itemsize
        r = Result(
            "rms_norm" + ("+residual" if residual else ""), f"T={t} H={h}", torch_path="engine.ops (eager)"
        )
        x, w = self.randn(t, h), 1 + 0.1 * self.randn(h)
        res = self.randn(t, h) if residual else None
        out, res_out = triton_ops.rms_norm(x, w, 1e-6, res)
        ref_in = (x.float() + res.float()) if residual else x.float()
        ref = ref_in * self.torch.rsqrt(ref_in.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
        r.max_rel_err = rel_err(out, ref)
        # A row's bits must not depend on its place in the launch (rows shifted by one, then alone).
        shifted, _ = triton_ops.rms_norm(x[1:], w, 1e-6, None if res is None else res[1:])
        alone, _ = triton_ops.rms_norm(x[3:4], w, 1e-6, None if res is None else res[3:4])
        r.checks["batch_invariant"] = bool(
            self.torch.equal(shifted, out[1:]) and self.torch.equal(alone, out[3:4])
        )
        r.ok = r.max_rel_err < self.tol and (not residual or rel_err(res_out, ref_in) < self.tol)
        r.ok = r.ok and r.checks["batch_invariant"]
        r.triton_ms = self.time_ms(lambda: triton_ops.rms_norm(x, w, 1e-6, res))
        r.torch_ms = self.time_ms(lambda: ops.rms_norm(x, w, 1e-6, res))
        return self.finish(r, (4 if residual else 2) * t * h * e + h * e)

    def rotary(self) -> Result:
        from engine import ops
        from engine.kernels import triton_ops

        s, t = self.s, self.s.tokens
        r = Result(
            "rotary_embedding", f"T={t} Hq={s.hq} Hkv={s.hkv} D={s.head_dim}", torch_path="engine.ops (eager)"
        )
        inv = 1.0 / 500000.0 ** (self.torch.arange(0, s.head_dim, 2, device=self.device).float() / s.head_dim)
        freqs = self.torch.outer(self.torch.arange(8192, device=self.device).float(), inv)
        cache = self.torch.cat((freqs.cos(), freqs.sin()), -1)
        pos = self.torch.randint(0, 8192, (t,), generator=self.gen, device=self.device)
        q, k = self.randn(t, s.hq, s.head_dim), self.randn(t, s.hkv, s.head_dim)
        q_ref, k_ref = q.float(), k.float()
        ops.rotary_embedding(pos, q_ref, k_ref, cache)
        triton_ops.rotary_embedding(pos, q, k, cache)
        r.max_rel_err = max(rel_err(q, q_ref), rel_err(k, k_ref))
        r.ok = r.max_rel_err < self.tol
        r.triton_ms = self.time_ms(lambda: triton_ops.rotary_embedding(pos, q, k, cache))
        r.torch_ms = self.time_ms(lambda: ops.rotary_embedding(pos, q, k, cache))
        return self.finish(
            r, 2 * t * (s.hq + s.hkv) * s.head_dim * self.dtype.itemsize + t * (s.head_dim * 4 + 8)
        )

    def silu_and_mul(self) -> Result:
        from engine import ops
        from engine.kernels import triton_ops

        t, i = self.s.tokens, self.s.inter
        r = Result("silu_and_mul", f"T={t} I={i}", torch_path="engine.ops (eager)")
        x = self.randn(t, 2 * i)
        xf = x.float()
        ref = self.torch.nn.functional.silu(xf[:, :i]) * xf[:, i:]
        out = triton_ops.silu_and_mul(x)
        r.max_rel_err = rel_err(out, ref)
        r.checks["batch_invariant"] = bool(self.torch.equal(triton_ops.silu_and_mul(x[1:]), out[1:]))
        r.ok = r.max_rel_err < self.tol and r.checks["batch_invariant"]
        r.triton_ms = self.time_ms(lambda: triton_ops.silu_and_mul(x))
        r.torch_ms = self.time_ms(lambda: ops.silu_and_mul(x))
        return self.finish(r, 3 * t * i * self.dtype.itemsize)

    def write_kv(self) -> Result:
        from engine.kernels import triton_ops

        s, t = self.s, self.s.tokens
        r = Result(
            "write_kv_cache", f"T={t} Hkv={s.hkv} D={s.head_dim}", torch_path="index_copy_ (torch backend)"
        )
        num_blocks = 2 * t // s.block_size + 1
        kc = self.torch.zeros(
            num_blocks, s.block_size, s.hkv, s.head_dim, dtype=self.dtype, device=self.device
        )
        vc = self.torch.zeros_like(kc)
        slots = self.torch.randperm(num_blocks * s.block_size, generator=self.gen, device=self.device)[:t]
        k, v = self.randn(t, s.hkv, s.head_dim), self.randn(t, s.hkv, s.head_dim)
        triton_ops.write_kv_cache(k, v, kc, vc, slots)
        flat_k, flat_v = kc.view(-1, s.hkv, s.head_dim), vc.view(-1, s.hkv, s.head_dim)
        r.ok = bool(self.torch.equal(flat_k[slots], k) and self.torch.equal(flat_v[slots], v))
        r.max_rel_err = 0.0 if r.ok else float("nan")
        r.triton_ms = self.time_ms(lambda: triton_ops.write_kv_cache(k, v, kc, vc, slots))

        def torch_write() -> None:
            flat_k.index_copy_(0, slots, k)
            flat_v.index_copy_(0, slots, v)

        r.torch_ms = self.time_ms(torch_write)
        return self.finish(r, 4 * t * s.hkv * s.head_dim * self.dtype.itemsize + 8 * t)

    # -- attention ---------------------------------------------------------------------------------
    def paged(self, seqs: list[tuple[int, int]]):  # noqa: ANN201
        """Caches with scattered blocks holding every sequence's K/V, queries for the new tokens,
        and the engine's AttentionMetadata. ``seqs`` = [(cached, new)]."""
        from engine.attention.base import AttentionMetadata

        torch, s = self.torch, self.s
        need = [-(-(c + n) // s.block_size) for c, n in seqs]
        num_blocks = sum(need) + 1
        kc, vc = (self.randn(num_blocks, s.block_size, s.hkv, s.head_dim) for _ in range(2))
        perm = torch.randperm(num_blocks, generator=self.gen, device=self.device).tolist()
        width, used, tables = max(need), 0, []
        for n in need:
            tables.append(perm[used : used + n] + [0] * (width - n))
            used += n
        meta = AttentionMetadata.for_chunks(seqs, tables, s.block_size, self.device)
        q = self.randn(sum(n for _, n in seqs), s.hq, s.head_dim)
        return q, kc, vc, meta

    def gather(self, cache, meta, i: int):  # noqa: ANN001, ANN201
        """Sequence i's K or V as a contiguous [Hkv, L, D] tensor."""
        n = meta.seq_lens_host[i]
        blocks = meta.block_tables[i, : -(-n // self.s.block_size)].long()
        return cache[blocks].flatten(0, 1)[:n].transpose(0, 1)

    def reference(self, q, kc, vc, meta):  # noqa: ANN001, ANN201
        F = self.torch.nn.functional
        outs = []
        for i, n in enumerate(meta.query_lens_host):
            ctx, lo = meta.context_lens_host[i], sum(meta.query_lens_host[:i])
            k, v = self.gather(kc, meta, i).float(), self.gather(vc, meta, i).float()
            mask = self.torch.ones(n, ctx + n, dtype=self.torch.bool, device=self.device).tril_(diagonal=ctx)
            qi = q[lo : lo + n].float().transpose(0, 1)
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
            outs.append(o.transpose(0, 1))
        return self.torch.cat(outs)

    @property
    def scale(self) -> float:
        return self.s.head_dim**-0.5

    def attn_cost(self, meta) -> tuple[int, float]:  # noqa: ANN001
        s, e = self.s, self.dtype.itemsize
        kv = sum(meta.seq_lens_host) * s.hkv * s.head_dim * 2 * e
        qo = 2 * sum(meta.query_lens_host) * s.hq * s.head_dim * e
        visible = sum(
            n * c + n * (n + 1) // 2
            for c, n in zip(meta.context_lens_host, meta.query_lens_host, strict=True)
        )
        return kv + qo, 4.0 * s.hq * s.head_dim * visible

    def unified(self, name: str, seqs: list[tuple[int, int]], sdpa: str | None) -> Result:
        from engine.kernels.triton_attention import unified_attention

        q, kc, vc, meta = self.paged(seqs)
        r = Result(name, _describe(seqs), torch_path=sdpa or "engine torch backend")

        def run(qq=q, m=meta):  # noqa: ANN001, ANN202
            return unified_attention(qq, kc, vc, m.query_start_loc, m.seq_lens, m.block_tables, self.scale)

        out = run()
        r.max_rel_err = rel_err(out, self.reference(q, kc, vc, meta))
        r.checks["run_to_run"] = bool(self.torch.equal(run(), out))
        # Sequence 0 alone (a different grid) must give the same bits as inside the batch.
        alone = self.sub_meta(meta, [0])
        r.checks["batch_invariant"] = bool(self.torch.equal(run(q[: seqs[0][1]], alone), out[: seqs[0][1]]))
        r.ok = r.max_rel_err < self.tol and all(r.checks.values())
        r.triton_ms = self.time_ms(run)
        r.torch_ms = self.time_torch(r, lambda: self.torch_attention(q, kc, vc, meta, sdpa))
        return self.finish(r, *self.attn_cost(meta))

    def chunking(self) -> Result:
        """Rows of a prompt computed in one prefill and as a second chunk over a cached first half."""
        from engine.kernels.triton_attention import unified_attention

        n = self.s.prefill[1]
        q, kc, vc, meta = self.paged([(0, n)])
        r = Result("unified chunked prefill", f"1 x {n} vs {n // 2}+{n - n // 2}", torch_path="-")
        full = unified_attention(
            q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale
        )
        half = n // 2
        qsl = self.torch.tensor([0, n - half], dtype=self.torch.int32, device=self.device)
        second = unified_attention(q[half:], kc, vc, qsl, meta.seq_lens, meta.block_tables, self.scale)
        r.checks["chunk_invariant"] = bool(self.torch.equal(second, full[half:]))
        r.ok, r.max_rel_err = r.checks["chunk_invariant"], rel_err(second, full[half:])
        return r

    def split_decode(self) -> Result:
        from engine.kernels.triton_attention import unified_attention
        from engine.kernels.triton_decode import split_kv_decode_attention

        b, ctx = self.s.long_decode
        seqs = [(ctx - 1 - 97 * i, 1) for i in range(b)]  # unequal lengths: splits end mid-way
        q, kc, vc, meta = self.paged(seqs)
        r = Result("split-KV decode", _describe(seqs), torch_path="sdpa (contiguous KV)")

        def run(qq=q, m=meta):  # noqa: ANN001, ANN202
            return split_kv_decode_attention(qq, kc, vc, m.seq_lens, m.block_tables, self.scale, m.max_seq_len,
                                             split_size=self.s.split_size)  # fmt: skip

        out = run()
        r.max_rel_err = rel_err(out, self.reference(q, kc, vc, meta))
        r.checks["run_to_run"] = bool(self.torch.equal(run(), out))
        order = list(range(b))[::-1][: max(1, b // 2)]
        r.checks["batch_invariant"] = bool(
            self.torch.equal(run(q[order], self.sub_meta(meta, order)), out[order])
        )
        r.ok = r.max_rel_err < self.tol and all(r.checks.values())
        r.triton_ms = self.time_ms(run)
        r.torch_ms = self.time_torch(r, lambda: self.torch_attention(q, kc, vc, meta, "sdpa (contiguous KV)"))
        m = meta
        unified_ms = self.time_ms(
            lambda: unified_attention(q, kc, vc, m.query_start_loc, m.seq_lens, m.block_tables, self.scale)
        )
        r.checks["faster_than_unified"] = r.triton_ms < unified_ms  # informative, not part of ok
        r.torch_path += f"; unified kernel {unified_ms:.3f} ms"
        return self.finish(r, *self.attn_cost(meta))

    def reference_variant(self, q, kc, vc, meta, window=None, softcap=None, sinks=None):  # noqa: ANN001, ANN201
        """Float32 attention with explicit scores: a sliding ``window``, Gemma 2's ``softcap`` on the
        scaled scores, gpt-oss's ``sinks`` (one value-less logit per query head)."""
        torch, outs, group = self.torch, [], self.s.hq // self.s.hkv
        for i, n in enumerate(meta.query_lens_host):
            ctx, lo = meta.context_lens_host[i], sum(meta.query_lens_host[:i])
            k = self.gather(kc, meta, i).float().repeat_interleave(group, 0)  # [Hq, L, D]
            v = self.gather(vc, meta, i).float().repeat_interleave(group, 0)
            qi = q[lo : lo + n].float().transpose(0, 1)  # [Hq, n, D]
            scores = qi @ k.transpose(1, 2) * self.scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            q_pos = torch.arange(ctx, ctx + n, device=self.device)[:, None]
            k_pos = torch.arange(ctx + n, device=self.device)[None, :]
            visible = k_pos <= q_pos
            if window is not None:
                visible &= k_pos > q_pos - window
            scores = scores.masked_fill(~visible, float("-inf"))
            if sinks is not None:
                sink = sinks.float().view(-1, 1, 1).expand(-1, n, 1)
                probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            outs.append((probs @ v).transpose(0, 1))
        return torch.cat(outs)

    def variants(self, name: str, window: int | None, softcap: float | None, sinks: bool) -> Result:
        """Unified attention (a prefill beside decodes) and split-KV decode with a model family's
        extras, against ``reference_variant``: where a compiled kernel and the interpreter could
        part (the CPU tests run only the interpreter)."""
        from engine.kernels.triton_attention import unified_attention
        from engine.kernels.triton_decode import split_kv_decode_attention

        s = self.s
        n_new, ctx = s.mixed[2], s.mixed[1]
        seqs = [(0, n_new)] + [(ctx - 1 - ctx // 4 * i, 1) for i in range(3)]  # unequal decodes
        q, kc, vc, meta = self.paged(seqs)
        sink = self.randn(s.hq, dtype=self.torch.float32) * 2 if sinks else None
        extras = {"window": window, "softcap": softcap, "sinks": sink}
        r = Result(name, _describe(seqs), torch_path="float32 reference (explicit scores)")
        ref = self.reference_variant(q, kc, vc, meta, window, softcap, sink)
        out = unified_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                self.scale, **extras)  # fmt: skip
        r.max_rel_err = rel_err(out, ref)
        decodes = self.sub_meta(meta, [1, 2, 3])
        dq = q[n_new:]
        split = split_kv_decode_attention(dq, kc, vc, decodes.seq_lens, decodes.block_tables, self.scale,
                                          decodes.max_seq_len, split_size=s.split_size, **extras)  # fmt: skip
        split_err = rel_err(split, ref[n_new:])
        r.checks["split_kv_within_tol"] = split_err < self.tol
        r.torch_path += f"; split-KV rel_err {split_err:.1e}"
        r.ok = r.max_rel_err < self.tol and all(r.checks.values())
        r.triton_ms = self.time_ms(
            lambda: unified_attention(
                q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale, **extras
            )  # fmt: skip
        )
        return self.finish(r, *self.attn_cost(meta))

    def sub_meta(self, meta, rows: list[int]):  # noqa: ANN001, ANN201
        from engine.attention.base import AttentionMetadata

        torch, idx = self.torch, self.torch.tensor(rows, device=self.device)
        qlens = [meta.query_lens_host[i] for i in rows]
        qsl = [0]
        for n in qlens:
            qsl.append(qsl[-1] + n)
        return AttentionMetadata(
            slot_mapping=meta.slot_mapping[:0],
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=self.device),
            seq_lens=meta.seq_lens[idx], context_lens=meta.context_lens[idx], block_tables=meta.block_tables[idx],
            max_query_len=max(qlens), max_seq_len=max(meta.seq_lens_host[i] for i in rows),
            query_lens_host=qlens, seq_lens_host=[meta.seq_lens_host[i] for i in rows],
            context_lens_host=[meta.context_lens_host[i] for i in rows],
            block_tables_host=[meta.block_tables_host[i] for i in rows], block_size=meta.block_size,
        )  # fmt: skip

    def torch_attention(self, q, kc, vc, meta, path: str | None) -> Callable[[], object]:  # noqa: ANN001
        """PyTorch's own path for the same work: SDPA over pre-gathered contiguous KV (no paging
        cost) when all sequences share one shape, else the engine's torch backend."""
        torch, F = self.torch, self.torch.nn.functional
        if path is None:
            from engine.attention.torch_backend import TorchAttentionBackend

            backend, s = TorchAttentionBackend(), self.s
            k_new = self.randn(q.shape[0], s.hkv, s.head_dim)

            def engine_torch() -> object:
                meta.backend_state = None  # plan building is part of each step's cost
                return backend.forward(q, k_new, k_new, kc, vc, meta, self.scale)

            return engine_torch
        # Every sequence padded to the longest one: the timing baseline, not a reference.
        b, n, length = len(meta.query_lens_host), meta.query_lens_host[0], meta.max_seq_len
        ctx = length - n
        blocks = meta.block_tables[:, : -(-length // self.s.block_size)].long()
        k = kc[blocks].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()  # [B, Hkv, L, D]
        v = vc[blocks].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()
        qb = q.view(b, n, *q.shape[1:]).transpose(1, 2)
        mask = (
            None
            if n == 1
            else torch.ones(n, ctx + n, dtype=torch.bool, device=self.device).tril_(diagonal=ctx)
        )
        causal = ctx == 0 and n > 1
        mask = None if causal else mask

        def sdpa() -> object:
            return F.scaled_dot_product_attention(
                qb, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True
            )

        try:
            sdpa()
            return sdpa
        except RuntimeError:  # no GQA support in this torch/backend: repeat the KV heads instead
            group = q.shape[1] // k.shape[1]
            k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return lambda: F.scaled_dot_product_attention(
                qb, k_rep, v_rep, attn_mask=mask, is_causal=causal, scale=self.scale
            )


class ModelKernels(Bench):
    """The mixture-of-experts and latent-attention kernels (DeepSeek / Qwen-MoE layers), and the
    deterministic mode's linear."""

    def fused_moe(self, name: str, tokens: int) -> Result:
        from engine import ops
        from engine.kernels import triton_moe
        from engine.models.config import MoEConfig
        from engine.models.moe import MoE

        torch, (hidden, inter, experts, top_k) = self.torch, self.s.moe
        r = Result(
            name, f"T={tokens} H={hidden} I={inter} E={experts} k={top_k}", torch_path="expert loop (torch)"
        )
        x = self.randn(tokens, hidden)
        w13 = self.randn(experts, 2 * inter, hidden) / hidden**0.5
        w2 = self.randn(experts, hidden, inter) / inter**0.5
        chosen = torch.rand(tokens, experts, generator=self.gen, device=self.device).topk(top_k, dim=-1)[1]
        weights = torch.rand(tokens, top_k, generator=self.gen, device=self.device)
        cfg = MoEConfig(
            num_experts=experts, experts_per_token=top_k, num_shared_experts=0, intermediate_size=inter,
            first_dense_layers=0, num_groups=1, topk_groups=1, routed_scaling_factor=1.0, norm_topk_prob=False,
        )  # fmt: skip
        loop = MoE(cfg, torch.nn.functional.linear, ops.silu_and_mul)  # its expert loop is the torch path
        layer = {"w13": w13, "w2": w2}

        def run():  # noqa: ANN202
            return triton_moe.fused_moe(x, w13, w2, weights, chosen, ops.silu_and_mul)

        out = run()
        ref = loop._loop(x.float(), {"w13": w13.float(), "w2": w2.float()}, weights, chosen)
        r.max_rel_err = rel_err(out, ref)
        r.checks["run_to_run"] = bool(torch.equal(run(), out))
        alone = triton_moe.fused_moe(x[:1], w13, w2, weights[:1], chosen[:1], ops.silu_and_mul)
        r.checks["batch_invariant"] = bool(torch.equal(alone, out[:1]))
        r.ok = r.max_rel_err < self.tol and all(r.checks.values())
        r.triton_ms = self.time_ms(run)
        r.torch_ms = self.time_torch(r, lambda: lambda: loop._loop(x, layer, weights, chosen))
        used = int(chosen.unique().numel())
        nbytes = used * 3 * hidden * inter * self.dtype.itemsize + 2 * tokens * hidden * self.dtype.itemsize
        return self.finish(r, nbytes, 6.0 * tokens * top_k * hidden * inter)

    def mla(self, name: str, seqs: list[tuple[int, int]]) -> Result:
        from engine.attention.base import AttentionMetadata
        from engine.attention.torch_backend import TorchAttentionBackend
        from engine.attention.triton_backend import TritonAttentionBackend

        torch, s = self.torch, self.s
        heads, v_dim, rope = s.mla
        width = v_dim + rope
        need = [-(-(c + n) // s.block_size) for c, n in seqs]
        num_blocks = sum(need) + 1
        perm = torch.randperm(num_blocks, generator=self.gen, device=self.device).tolist()
        tables, used = [], 0
        for n in need:
            tables.append(perm[used : used + n])
            used += n
        meta = AttentionMetadata.for_chunks(seqs, tables, s.block_size, self.device)
        cache = self.randn(num_blocks, s.block_size, 1, width)
        new = sum(n for _, n in seqs)
        q, kv = self.randn(new, heads, width), self.randn(new, 1, width)
        scale = width**-0.5
        r = Result(name, f"{_describe(seqs)}, H={heads} D={v_dim}+{rope}", torch_path="engine torch backend")
        triton_backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()

        def run():  # noqa: ANN202
            return triton_backend.forward_mla(q, kv, cache, meta, scale, v_dim)

        out = run()
        ref = torch_backend.forward_mla(q.float(), kv.float(), cache.float(), meta, scale, v_dim)
        r.max_rel_err = rel_err(out, ref)
        r.checks["run_to_run"] = bool(torch.equal(run(), out))
        r.ok = r.max_rel_err < self.tol and all(r.checks.values())
        r.triton_ms = self.time_ms(run)
        r.torch_ms = self.time_torch(
            r, lambda: lambda: torch_backend.forward_mla(q, kv, cache, meta, scale, v_dim)
        )
        visible = sum(n * c + n * (n + 1) // 2 for c, n in seqs)
        nbytes = (sum(c + n for c, n in seqs) * width + new * heads * (width + v_dim)) * self.dtype.itemsize
        return self.finish(r, nbytes, 2.0 * heads * (width + v_dim) * visible)

    def linear(self, name: str, rows: int) -> Result:
        from engine.kernels import triton_matmul

        torch, k, n = self.torch, self.s.hidden, self.s.inter
        r = Result(name, f"M={rows} K={k} N={n}", torch_path="F.linear (cuBLAS)")
        x, w = self.randn(rows, k), self.randn(n, k) / k**0.5

        def run():  # noqa: ANN202
            return triton_matmul.linear(x, w)

        out = run()
        r.max_rel_err = rel_err(out, torch.nn.functional.linear(x.float(), w.float()))
        r.checks["run_to_run"] = bool(torch.equal(run(), out))
        # The same rows at another offset of a bigger batch.
        batch = torch.cat([self.randn(17, k), x, self.randn(23, k)])
        r.checks["batch_invariant"] = bool(torch.equal(triton_matmul.linear(batch, w)[17 : 17 + rows], out))
        r.ok = r.max_rel_err < self.tol and all(r.checks.values())
        cublas = torch.equal(
            torch.nn.functional.linear(batch, w)[17 : 17 + rows], torch.nn.functional.linear(x, w)
        )
        r.torch_path += f", batch_invariant={cublas}"  # why deterministic mode needs the kernel
        r.triton_ms = self.time_ms(run)
        r.torch_ms = self.time_torch(r, lambda: lambda: torch.nn.functional.linear(x, w))
        nbytes = (rows * k + k * n + rows * n) * self.dtype.itemsize
        return self.finish(r, nbytes, 2.0 * rows * k * n)


def _describe(seqs: list[tuple[int, int]]) -> str:
    kinds: dict[tuple[int, int], int] = {}
    for sq in seqs:
        kinds[sq] = kinds.get(sq, 0) + 1
    if len(kinds) > 3:
        lens = [c + n for c, n in seqs]
        return f"{len(seqs)} seqs, ctx {min(lens)}..{max(lens)}, {sum(n for _, n in seqs)} new"
    return " + ".join(f"{k}x(ctx {c}, new {n})" for (c, n), k in kinds.items())


def cases(b: ModelKernels) -> list[tuple[str, Callable[[], Result]]]:
    s = b.s
    (nd, cd), (npf, lp), (ne, ce, le), (nm, cm, lm) = s.decode, s.prefill, s.extend, s.mixed
    window = max(8, cm // 8)  # the variants' sliding window: shorter than their contexts
    return [
        ("rms_norm", lambda: b.rms_norm(False)),
        ("rms_norm+residual", lambda: b.rms_norm(True)),
        ("rotary_embedding", b.rotary),
        ("silu_and_mul", b.silu_and_mul),
        ("write_kv_cache", b.write_kv),
        ("unified decode", lambda: b.unified("unified decode", [(cd - 1, 1)] * nd, "sdpa (contiguous KV)")),
        (
            "unified prefill",
            lambda: b.unified("unified prefill", [(0, lp)] * npf, "sdpa causal (contiguous)"),
        ),
        (
            "unified extend",
            lambda: b.unified("unified extend", [(ce, le)] * ne, "sdpa + mask (contiguous KV)"),
        ),
        ("unified mixed", lambda: b.unified("unified mixed", [(0, lm)] + [(cm - 1, 1)] * nm, None)),
        ("chunked-prefill invariance", b.chunking),
        ("split-KV decode", b.split_decode),
        ("attention, soft-capped", lambda: b.variants("attention, soft-capped", None, 50.0, False)),
        ("attention, sinks + window", lambda: b.variants("attention, sinks + window", window, None, True)),
        ("attention, window", lambda: b.variants("attention, window", window - 3, None, False)),
        ("fused_moe decode", lambda: b.fused_moe("fused_moe decode", s.moe_tokens[0])),
        ("fused_moe prefill", lambda: b.fused_moe("fused_moe prefill", s.moe_tokens[1])),
        ("mla decode", lambda: b.mla("mla decode", [(s.mla_decode[1] - 1, 1)] * s.mla_decode[0])),
        ("mla prefill", lambda: b.mla("mla prefill", [(0, s.mla_prefill[1])] * s.mla_prefill[0])),
        *[
            (f"linear {kind}", partial(b.linear, f"linear {kind}", rows))
            for kind, rows in zip(("decode", "batch", "prefill"), s.linear_rows, strict=True)
        ],
    ]


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(results: list[Result], copy_gbps: float) -> None:
    print(f"\ndevice-to-device copy bandwidth: {copy_gbps:.0f} GB/s (floor = bytes / this)\n")
    head = f"{'kernel':<26} {'shape':<40} {'ok':<5} {'rel_err':>8} {'triton ms':>10} {'torch ms':>9} "
    head += f"{'floor ms':>9} {'%floor':>7} {'TFLOP/s':>8}  torch path / checks / error"
    print(head)
    print("-" * len(head))
    for r in results:
        frac = r.floor_ms / r.triton_ms * 100 if r.floor_ms and r.triton_ms else None
        ok = "-" if r.ok is None else ("yes" if r.ok else "NO")
        notes = r.error or "; ".join([r.torch_path] + [f"{k}={v}" for k, v in r.checks.items()])
        print(f"{r.kernel:<26} {r.shape[:40]:<40} {ok:<5} {_fmt(r.max_rel_err, '.1e'):>8} "
              f"{_fmt(r.triton_ms, '.3f'):>10} {_fmt(r.torch_ms, '.3f'):>9} {_fmt(r.floor_ms, '.3f'):>9} "
              f"{_fmt(frac, '.0f'):>7} {_fmt(r.tflops, '.1f'):>8}  {notes}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--json", default="gpu_kernels.json", help="where to write the results")
    p.add_argument("--quick", action="store_true", help="smaller shapes (about a quarter of the work)")
    p.add_argument("--iters", type=int, default=20, help="timed repetitions per measurement (median)")
    p.add_argument(
        "--interpret", action="store_true", help="no GPU: tiny correctness pass on the interpreter"
    )
    p.add_argument("--only", default=None, help="run only cases whose name contains this text")
    args = p.parse_args(argv)

    import torch

    if args.interpret and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        shapes, iters = TINY, 2
    elif not torch.cuda.is_available():
        print(
            "gpu_kernels: no CUDA device here; nothing to measure (use --interpret for a CPU correctness pass)"
        )
        return 0
    else:
        shapes, iters = (QUICK if args.quick else Shapes()), args.iters
    try:
        import triton
    except ImportError:
        print("gpu_kernels: triton is not installed (pip install 'ferry-serve[triton]')")
        return 0

    started = time.perf_counter()
    bench = ModelKernels(shapes, args.dtype, iters)
    results = []
    for name, run in cases(bench):
        if args.only and args.only not in name:
            continue
        try:
            results.append(run())
        except Exception as exc:  # a failing kernel is a table row, never the end of the run
            results.append(Result(name, "-", error=f"{type(exc).__name__}: {exc}"[:300]))
            traceback.print_exc(file=sys.stderr)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print_table(results, bench.copy_gbps)
    report = {
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"cpu interpreter ({platform.machine()})",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "interpret": bool(args.interpret and not torch.cuda.is_available()),
        "shapes": asdict(shapes),
        "copy_bandwidth_gbps": bench.copy_gbps,
        "seconds": time.perf_counter() - started,
        "results": [asdict(r) for r in results],
    }
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    failed = [r.kernel for r in results if r.ok is False or r.error]
    print(
        f"\n{len(results) - len(failed)}/{len(results)} passed in {report['seconds']:.0f} s; wrote {args.json}"
    )
    if failed:
        print("failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
