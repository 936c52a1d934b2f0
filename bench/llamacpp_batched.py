"""llama.cpp's batched decoding on the engine benchmark's workload A, next to ferry's own result.

llama.cpp is not a dependency: bring a built ``llama-batched-bench`` (llama.cpp's ``tools/batched-bench``,
e.g. from the ``llama-cpp-python`` sdist's ``vendor/llama.cpp``: ``cmake -B build -DLLAMA_CURL=OFF &&
cmake --build build --target llama-batched-bench``) and the benchmark model converted to GGUF
(``convert_hf_to_gguf.py <bench model dir> --outtype f32``; its tokenizer does not matter, the tool
feeds token ids). The run: ``--num-requests`` sequences at once, each with the workload's mean
prompt length and 128 generated tokens, one prefill pass then lock-step decoding (a static batch,
like the engine bench's ceiling), ``--threads`` threads. "output tok/s" = generated tokens / (prefill
+ decode seconds), the engine bench's measure. With ``--ferry-json`` (an
``engine_throughput.py`` result) it prints the ratios too.

    .venv/bin/python bench/llamacpp_batched.py --binary BIN --gguf bench-f32.gguf [--gguf bench-bf16.gguf] \
        --ferry-json bench/results/engine_throughput.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUTPUT_TOKENS = 128  # workload A


def run(binary: str, gguf: str, num_seqs: int, prompt_len: int, threads: int) -> dict:
    ctx = num_seqs * (prompt_len + OUTPUT_TOKENS) + 64
    cmd = [binary, "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt_len),
           "-ntg", str(OUTPUT_TOKENS), "-npl", str(num_seqs), "-t", str(threads), "-tb", str(threads)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True).stdout
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    rows = [line for line in out.splitlines() if re.match(r"^\|\s*\d", line)]
    cells = [float(c) for c in rows[-1].strip("|").split("|")]
    t_pp, s_pp, t_tg, s_tg = cells[4], cells[5], cells[6], cells[7]
    generated = num_seqs * OUTPUT_TOKENS
    return {
        "gguf": gguf,
        "prefill_tokens_per_s": s_pp,
        "decode_tokens_per_s": s_tg,
        "seconds": t_pp + t_tg,
        "output_tokens": generated,
        "tokens_per_s": generated / (t_pp + t_tg),
        "command": " ".join(cmd),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", required=True, help="path to llama-batched-bench")
    ap.add_argument("--gguf", action="append", required=True, help="GGUF of the bench model (repeatable)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ferry-json", default=None, help="an engine_throughput.py result to compare with")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "llamacpp_batched.json"))
    args = ap.parse_args(argv)
    from bench.engine_throughput import workload

    work = workload(args.num_requests, "A")
    prompt_len = round(sum(len(p) for p, _ in work) / len(work))
    results = {g: run(args.binary, g, args.num_requests, prompt_len, args.threads) for g in args.gguf}
    ferry = {}
    if args.ferry_json:
        a = json.loads(Path(args.ferry_json).read_text())["workloads"]["A"]
        ferry = {k: v["tokens_per_s"] for k, v in a.items() if isinstance(v, dict) and k.startswith("ferry")}
    print(
        f"\nworkload A, {args.num_requests} sequences x ({prompt_len} prompt + {OUTPUT_TOKENS} out), {args.threads} threads"
    )
    print(f"{'system':<34} {'prefill tok/s':>14} {'decode tok/s':>13} {'out tok/s':>10}")
    for g, r in results.items():
        name = "llama.cpp " + Path(g).name
        print(
            f"{name:<34} {r['prefill_tokens_per_s']:>14.1f} {r['decode_tokens_per_s']:>13.1f} {r['tokens_per_s']:>10.1f}"
        )
    for name, tps in ferry.items():
        ratios = ", ".join(f"{tps / r['tokens_per_s']:.2f}x {Path(g).name}" for g, r in results.items())
        print(f"{name:<34} {'':>14} {'':>13} {tps:>10.1f}   ({ratios})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"prompt_len": prompt_len, "llamacpp": results, "ferry": ferry}, indent=2)
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
