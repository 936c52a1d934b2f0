"""DeepSeek-V3 shape (MLA + MoE) on the offline engine: ferry vs transformers, and the KV it caches.

Fixed model: hidden 512, 8 layers (layer 0 dense, then MoE: 16 routed experts in 4 groups, 4 per
token from the best 2 groups, 1 shared, expert width 256), 8 heads, q_lora_rank 256, kv_lora_rank 128,
qk_rope_head_dim 32, qk_nope_head_dim 64, v_head_dim 64, vocab 32000; random fp32 weights built
once with transformers into a cache directory. Workloads and the transformers baseline (static
batches of 32, left padding) are ``bench/engine_throughput.py``'s.

Also prints what one token's KV costs: ferry's latent cache (kv_lora_rank + qk_rope_head_dim per
layer) against the per-head K/V an expanded cache would hold (heads x (qk_head_dim + v_head_dim)).
With ``--repeats N`` each system runs N times, interleaved, and the fastest run counts.

    .venv/bin/python bench/deepseek.py                     # 32 requests, workloads A and B
    .venv/bin/python bench/deepseek.py --num-requests 8 --workloads A --skip-hf   # smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.engine_throughput import MODEL_SPEC as LLAMA_SPEC  # noqa: E402
from bench.engine_throughput import cached_model_dir, run_ferry, run_hf, workload  # noqa: E402

SPEC = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=1408,
    moe_intermediate_size=256,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    q_lora_rank=256,
    kv_lora_rank=128,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
    vocab_size=LLAMA_SPEC["vocab_size"],  # the shared workloads draw ids below it
    max_position_embeddings=2048,
)


def model_dir() -> Path:
    def build():  # noqa: ANN202
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        cfg = DeepseekV3Config(**SPEC, rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=None, pad_token_id=0)
        return DeepseekV3ForCausalLM(cfg)

    return cached_model_dir("deepseek", SPEC, build)


def kv_bytes_per_token(dtype_bytes: int = 4) -> dict:
    layers = SPEC["num_hidden_layers"]
    latent = layers * (SPEC["kv_lora_rank"] + SPEC["qk_rope_head_dim"]) * dtype_bytes
    qk = SPEC["qk_nope_head_dim"] + SPEC["qk_rope_head_dim"]
    expanded = layers * SPEC["num_attention_heads"] * (qk + SPEC["v_head_dim"]) * dtype_bytes
    return {"latent": latent, "expanded": expanded, "ratio": expanded / latent}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--workloads", default="A,B")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "deepseek.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = model_dir()
    opts = dict(max_num_seqs=64, max_num_batched_tokens=2048, num_threads=args.threads)
    kv = kv_bytes_per_token()
    results: dict = {
        "machine": {
            "threads": args.threads,
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
        },
        "model": SPEC,
        "kv_bytes_per_token_fp32": kv,
        "num_requests": args.num_requests,
        "workloads": {},
    }
    rows = []
    for kind in args.workloads.split(","):
        work = workload(args.num_requests, kind)
        r: dict = {"prompt_tokens": sum(len(p) for p, _ in work), "output_tokens": sum(o for _, o in work)}
        systems = {"ferry": lambda work=work: run_ferry(path, work, **opts)}
        if not args.skip_hf:
            systems["transformers"] = lambda work=work: run_hf(path, work)
        for _ in range(max(1, args.repeats)):
            for name, fn in systems.items():
                res = fn()
                res.pop("tokens", None)
                if name not in r or res["seconds"] < r[name]["seconds"]:
                    r[name] = res
        results["workloads"][kind] = r
        for name in systems:
            tps = r[name]["tokens_per_s"]
            vs = tps / r["transformers"]["tokens_per_s"] if "transformers" in r else float("nan")
            rows.append((kind, name, r[name]["seconds"], tps, vs))
    print(f"\nDeepSeek-V3 shape, {args.num_requests} requests, {args.threads} threads")
    print(
        f"KV per token (fp32): latent {kv['latent']} B vs expanded per-head {kv['expanded']} B ({kv['ratio']:.1f}x)"
    )
    print(f"{'wl':<3} {'system':<14} {'seconds':>9} {'out tok/s':>10} {'/transformers':>14}")
    for kind, name, s, tps, vs in rows:
        print(f"{kind:<3} {name:<14} {s:>9.2f} {tps:>10.1f} {vs:>13.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
