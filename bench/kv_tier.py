"""KV tier benchmark: tier read/write bandwidth against raw redis-py on the same server and bytes.

Run: ``python bench/kv_tier.py [--blocks 256] [--batches 16,64] [--repeats 5] [--engine]``

It starts its own redis-server on a free loopback port (stopped at exit) and measures, for
~256 KiB blocks (an encoded block of shape (8, 2, 16, 2, 128) fp32):

* reads: raw ``MGET`` and raw pipelined ``GET`` (the ceiling) vs ``open_tier(redis://)``
  ``get_many`` vs a composite tier's L1 hits vs ``KVConnector.load`` (fetch + header/crc32 check +
  copy into paged caches);
* writes: raw pipelined ``SET`` and raw ``MSET`` vs ``put_many`` vs ``KVConnector.save_many`` + flush;
* ``contains_prefix`` latency for a 128-block prefix: the tier's Lua script vs pipelined EXISTS
  vs a binary search of single EXISTS calls;
* with ``--engine``: TTFT of a 2,048-token prompt on the engine benchmark model (Llama hidden 512,
  8 layers, 8 heads, 2 KV heads, intermediate 1408, fp32): cold vs memory-tier hit vs Redis hit.

Prints tables and writes JSON to ``bench/results/kv_tier.json`` (``--out``). Target: tier reads
at >= 70 % of the raw GET ceiling. Numbers on a shared 2-core box are noisy: compare ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.local_redis import RedisProcess  # noqa: E402
from kvcache import codec  # noqa: E402
from kvcache.connector import KVConnector  # noqa: E402
from kvcache.keys import block_hashes, tier_key  # noqa: E402
from kvcache.redis_tier import RedisTier  # noqa: E402
from kvcache.tier import open_tier  # noqa: E402

BLOCK_SHAPE = (8, 2, 16, 2, 128)  # 262,144 payload bytes in fp32
FINGERPRINT = "bench"


def interleaved_rates(variants: dict[str, Callable[[], int]], repeats: int) -> dict[str, float]:
    """Median bytes/second of each variant (``fn`` returns the bytes it moved).

    Variants run round-robin, one pass each per repeat, so a burst of load from elsewhere on
    the machine hits every variant alike instead of skewing one of them.
    """
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            nbytes = fn()
            rates[name].append(nbytes / (time.perf_counter() - start))
    return {name: statistics.median(r) for name, r in rates.items()}


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_reads(
    url: str, hashes: list[bytes], values: list[bytes], batch: int, repeats: int
) -> dict[str, float]:
    keys = [tier_key(FINGERPRINT, h) for h in hashes]
    total = sum(len(v) for v in values)
    raw = redis.Redis.from_url(url)
    batches = [keys[i : i + batch] for i in range(0, len(keys), batch)]

    def raw_mget() -> int:
        n = 0
        for b in batches:
            n += sum(len(v) for v in raw.mget(b))
        return n

    def raw_pipelined_get() -> int:
        n = 0
        for b in batches:
            pipe = raw.pipeline(transaction=False)
            for k in b:
                pipe.get(k)
            n += sum(len(v) for v in pipe.execute())
        return n

    tier = open_tier(url)

    def tier_get() -> int:
        n = 0
        for b in batches:
            n += sum(len(v) for v in tier.get_many(b) if v is not None)
        return n

    composite = open_tier(url + f"?l1_bytes={2 * total}")
    for b in batches:  # warm L1
        composite.get_many(b)

    def l1_get() -> int:
        n = 0
        for b in batches:
            n += sum(len(v) for v in composite.get_many(b) if v is not None)
        return n

    conn = KVConnector(url, FINGERPRINT, BLOCK_SHAPE, torch.float32)
    k_caches = [torch.zeros(batch, *BLOCK_SHAPE[2:]) for _ in range(BLOCK_SHAPE[0])]
    v_caches = [torch.zeros(batch, *BLOCK_SHAPE[2:]) for _ in range(BLOCK_SHAPE[0])]
    ids = list(range(batch))

    def connector_load() -> int:
        n = 0
        for i in range(0, len(hashes), batch):
            chunk = hashes[i : i + batch]
            loaded = conn.load(chunk, ids[: len(chunk)], k_caches, v_caches)
            if loaded != len(chunk):
                raise RuntimeError(f"connector loaded {loaded} of {len(chunk)} blocks")
            n += sum(len(values[i + j]) for j in range(loaded))
        return n

    out = interleaved_rates(
        {
            "raw_mget": raw_mget,
            "raw_pipelined_get": raw_pipelined_get,
            "tier_get_many": tier_get,
            "composite_l1_hit": l1_get,
            "connector_load": connector_load,
        },
        repeats,
    )
    for closable in (tier, composite, conn, raw):
        closable.close()
    return out


def bench_writes(
    url: str, hashes: list[bytes], values: list[bytes], batch: int, repeats: int
) -> dict[str, float]:
    keys = [tier_key(FINGERPRINT + "-w", h) for h in hashes]
    total = sum(len(v) for v in values)
    raw = redis.Redis.from_url(url)
    pairs = list(zip(keys, values, strict=True))
    batches = [pairs[i : i + batch] for i in range(0, len(pairs), batch)]

    def raw_pipelined_set() -> int:
        for b in batches:
            pipe = raw.pipeline(transaction=False)
            for k, v in b:
                pipe.set(k, v)
            pipe.execute()
        return total

    def raw_mset() -> int:
        for b in batches:
            raw.mset(dict(b))
        return total

    tier = open_tier(url)

    def tier_put() -> int:
        for b in batches:
            if not all(tier.put_many(b)):
                raise RuntimeError("put_many failed")
        return total

    conn = KVConnector(url, FINGERPRINT + "-c", BLOCK_SHAPE, torch.float32, write_queue=len(hashes))
    k_caches = [torch.randn(batch, *BLOCK_SHAPE[2:]) for _ in range(BLOCK_SHAPE[0])]
    v_caches = [torch.randn(batch, *BLOCK_SHAPE[2:]) for _ in range(BLOCK_SHAPE[0])]

    def connector_save() -> int:
        for i in range(0, len(hashes), batch):
            chunk = hashes[i : i + batch]
            conn.save_many(chunk, list(range(len(chunk))), k_caches, v_caches)
        if not conn.flush(60):
            raise RuntimeError("connector writes did not finish")
        return total

    out = interleaved_rates(
        {
            "raw_pipelined_set": raw_pipelined_set,
            "raw_mset": raw_mset,
            "tier_put_many": tier_put,
            "connector_save": connector_save,
        },
        repeats,
    )
    if conn.stats().writes_dropped:
        raise RuntimeError("connector dropped writes during the benchmark")
    for closable in (tier, conn, raw):
        closable.close()
    return out


def bench_contains(url: str, hashes: list[bytes], repeats: int) -> dict[str, float]:
    n = min(128, len(hashes))
    keys = [tier_key(FINGERPRINT, h) for h in hashes[:n]]
    raw = redis.Redis.from_url(url)
    tier = open_tier(url)

    def binary_search() -> int:
        lo, hi = 0, n  # the answer is in [lo, hi]; chained hashes make presence prefix-closed mostly
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if raw.exists(keys[mid - 1]):
                lo = mid
            else:
                hi = mid - 1
        return lo

    pipelined = RedisTier(url, use_script=False)
    reps = max(repeats * 20, 50)
    out = {
        "keys": n,
        "tier_lua_script_us": median_seconds(lambda: tier.contains_prefix(keys), reps) * 1e6,
        "pipelined_exists_us": median_seconds(lambda: pipelined.contains_prefix(keys), reps) * 1e6,
        "binary_search_exists_us": median_seconds(binary_search, reps) * 1e6,
        "single_exists_us": median_seconds(lambda: raw.exists(keys[0]), reps) * 1e6,
    }
    for closable in (tier, pipelined, raw):
        closable.close()
    return out


def build_bench_model(target: Path) -> Path:
    from engine.demo import build_model

    if (target / "config.json").exists():
        return target
    return build_model(
        target,
        "llama",
        seed=0,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tokenizer_vocab_size=32000,
    )


def bench_engine_ttft(url: str, model_dir: Path, prompt_len: int, repeats: int) -> dict[str, float]:
    """TTFT (max_tokens=1 wall time) of a prompt cold, with its prefix in a memory tier, and in Redis."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    opts = {"block_size": 16, "max_num_batched_tokens": prompt_len, "max_model_len": prompt_len + 64}
    out: dict[str, float] = {}
    for name, tier_url in (("cold", None), ("memory_hit", "memory://ttft-bench"), ("redis_hit", url)):
        llm = LLM(str(model_dir), kv_tier=tier_url, **opts)
        vocab = llm.engine.vocab_size
        llm.generate([[(5 + i) % vocab for i in range(64)]], params)  # warm-up: first-call costs out
        times, loaded_tokens, load_times = [], [], []
        for rep in range(repeats):
            prompt = [((rep + 1) * 7919 + 31 * i) % (vocab - 10) + 10 for i in range(prompt_len)]
            if tier_url is not None:
                llm.generate([prompt], params)  # computes the prompt and writes its blocks
                llm.engine.connector.flush(60)
            llm.engine.block_manager.reset_prefix_cache()  # force the tier (or a full recompute)
            load_before = llm.engine.connector.stats().load_seconds if tier_url is not None else 0.0
            start = time.perf_counter()
            result = llm.generate([prompt], params)[0]
            times.append(time.perf_counter() - start)
            loaded_tokens.append(result.num_cached_tokens)
            if tier_url is not None:
                load_times.append(llm.engine.connector.stats().load_seconds - load_before)
        out[f"{name}_ttft_s"] = statistics.median(times)
        out[f"{name}_cached_tokens"] = statistics.median(loaded_tokens)
        if load_times:
            out[f"{name}_tier_load_s"] = statistics.median(load_times)
        if tier_url is not None:
            llm.engine.connector.close()
    return out


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    print(f"\n{title}")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=256, help="blocks stored and read per pass")
    p.add_argument("--batches", default="16,64", help="comma-separated batch sizes (blocks per call)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--engine", action="store_true", help="also measure engine TTFT cold / memory hit / Redis hit"
    )
    p.add_argument("--engine-prompt-len", type=int, default=2048)
    p.add_argument("--engine-model", type=Path, default=None, help="reuse a bench model directory")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "kv_tier.json")
    args = p.parse_args()
    batch_sizes = [int(b) for b in args.batches.split(",") if b]

    server = RedisProcess()
    try:
        hashes = block_hashes(list(range(16 * args.blocks)), 16)
        g = torch.Generator().manual_seed(0)
        blocks = [torch.randn(BLOCK_SHAPE, generator=g) for _ in range(min(16, args.blocks))]
        values = [
            codec.encode(h, blocks[i % len(blocks)], fingerprint=FINGERPRINT) for i, h in enumerate(hashes)
        ]
        # Blocks must decode under their own hash, so encode each under its key's hash.
        seed = open_tier(server.url)
        seed.put_many([(tier_key(FINGERPRINT, h), v) for h, v in zip(hashes, values, strict=True)])
        seed.close()

        results: dict[str, object] = {
            "block_bytes": len(values[0]),
            "blocks": args.blocks,
            "repeats": args.repeats,
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "redis_py": redis.__version__,
            },
            "reads": {},
            "writes": {},
        }
        for batch in batch_sizes:
            reads = bench_reads(server.url, hashes, values, batch, args.repeats)
            ceiling = max(reads["raw_mget"], reads["raw_pipelined_get"])
            reads_out = {k: v / 1e9 for k, v in reads.items()}
            reads_out["tier_vs_raw_ceiling"] = reads["tier_get_many"] / ceiling
            reads_out["connector_load_vs_raw_ceiling"] = reads["connector_load"] / ceiling
            results["reads"][str(batch)] = reads_out  # type: ignore[index]
            print_table(
                f"reads, batch {batch} x {len(values[0]) / 1024:.0f} KiB (GB/s)",
                [(k, f"{v:.3f}") for k, v in reads_out.items() if not k.endswith("ceiling")]
                + [
                    ("tier / raw ceiling", f"{reads_out['tier_vs_raw_ceiling']:.0%}"),
                    ("connector.load / raw ceiling", f"{reads_out['connector_load_vs_raw_ceiling']:.0%}"),
                ],
            )
            writes = bench_writes(server.url, hashes, values, batch, args.repeats)
            writes_out = {k: v / 1e9 for k, v in writes.items()}
            writes_out["tier_vs_raw_pipelined_set"] = writes["tier_put_many"] / writes["raw_pipelined_set"]
            results["writes"][str(batch)] = writes_out  # type: ignore[index]
            print_table(
                f"writes, batch {batch} (GB/s)",
                [(k, f"{v:.3f}") for k, v in writes_out.items() if k != "tier_vs_raw_pipelined_set"]
                + [("tier / raw pipelined SET", f"{writes_out['tier_vs_raw_pipelined_set']:.0%}")],
            )
        contains = bench_contains(server.url, hashes, args.repeats)
        results["contains_prefix"] = contains
        print_table(
            "contains_prefix of a 128-block prefix (microseconds)",
            [(k, f"{v:.0f}") for k, v in contains.items()],
        )
        if args.engine:
            model_dir = args.engine_model or Path(tempfile.gettempdir()) / "ferry-kv-bench-model"
            build_bench_model(model_dir)
            ttft = bench_engine_ttft(server.url, model_dir, args.engine_prompt_len, max(1, args.repeats // 2))
            results["engine_ttft"] = {"prompt_tokens": args.engine_prompt_len, **ttft}
            print_table(
                f"engine TTFT, {args.engine_prompt_len}-token prompt",
                [(k, f"{v:.3f}" if k.endswith("_s") else f"{v:.0f}") for k, v in ttft.items()],
            )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.out}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
