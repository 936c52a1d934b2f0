"""Event-loop CPU a streamed generation request costs `ferry serve`'s app, with and without its
generation fast path (``server.generation_routes``).

Why CPU and not latency: when a burst arrives at an idle engine, the engine waits until the
event loop has taken every request in (``AsyncEngine._gather_burst``), so the burst's TTFT grows
by the sum of the requests' intake time, one after another on one thread. Wall-clock TTFT at 32
concurrent requests moves tens of ms between runs with the engine's prefill step on a shared
machine (``bench/server_overhead.py``); the loop thread's own CPU clock does not.

The app is called in process, as uvicorn calls it (ASGI scope, body, then the response messages),
``--concurrency`` streamed /v1/completions requests at once, wave after wave, over one
``AsyncEngine`` of the engine benchmark model (token-id prompts, greedy, ``ignore_eos``,
continuous usage stats, as `bench/server_overhead.py` sends them). Variants, interleaved:

* ``ferry``: the app as ``build_app`` makes it;
* ``fastapi-routes``: the same app with FastAPI's own route handlers serving the two routes.

Per variant and ``--max-tokens``: the loop thread's CPU per request (median over ``--repeats``).
Socket reads and writes and HTTP parsing (uvicorn's part) are not in these figures. A linear fit
over two ``--max-tokens`` values splits a request's cost into intake (fixed) and per token.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.server_overhead import bench_model_dir, make_prompts, write_result  # noqa: E402


def _scope(path: str, body: bytes) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"bench"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
    }


async def call(app, body: bytes) -> int:
    """One request through the ASGI app; returns the number of body messages it sent."""
    delivered = False
    finished = asyncio.Event()
    status = 0
    messages = 0

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await finished.wait()  # the client stays until the response is complete
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status, messages
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            messages += 1

    await app(_scope("/v1/completions", body), receive, send)
    finished.set()
    if status != 200:
        raise RuntimeError(f"the app answered {status}")
    return messages


async def measure(app, bodies: list[bytes], waves: int) -> float:
    """Loop-thread CPU seconds per request over ``waves`` waves of all ``bodies`` at once."""
    cpu0 = time.thread_time()
    for _ in range(waves):
        await asyncio.gather(*(call(app, b) for b in bodies))
    return (time.thread_time() - cpu0) / (waves * len(bodies))


def build_variants(engine) -> dict:
    from server.app import build_app
    from server.config import ServerConfig
    from server.generation_routes import GenerationRoutes

    config = ServerConfig(served_model_name="bench")
    fast = build_app(engine, config)
    plain = build_app(engine, config)
    plain.user_middleware = [m for m in plain.user_middleware if m.cls is not GenerationRoutes]
    return {"ferry": fast, "fastapi-routes": plain}


async def run(args: argparse.Namespace) -> list[dict]:
    from engine import AsyncEngine
    from engine.tokenizer import Tokenizer

    model = args.model or str(bench_model_dir())
    vocab = Tokenizer.from_dir(model).vocab_size
    prompts = make_prompts(args.concurrency, args.prompt_len, vocab)
    engine = AsyncEngine(
        model=model, num_threads=args.num_threads, num_kv_blocks=2048, max_num_seqs=args.concurrency
    )
    try:
        variants = build_variants(engine)
        bodies = {
            mt: [
                json.dumps(
                    {
                        "prompt": p,
                        "max_tokens": mt,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": True,
                        "stream_options": {"continuous_usage_stats": True},
                    }
                ).encode()
                for p in prompts
            ]
            for mt in args.max_tokens
        }
        for app in variants.values():  # warm-up: first batches of each shape, lazy imports
            for mt in args.max_tokens:
                await measure(app, bodies[mt], 1)
        gc.collect()
        gc.freeze()  # as `ferry serve` does after startup
        samples: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.repeats):
            for mt in args.max_tokens:
                for name, app in variants.items():
                    samples.setdefault((name, mt), []).append(await measure(app, bodies[mt], args.waves))
    finally:
        await engine.shutdown()
    return [
        {
            "variant": name,
            "max_tokens": mt,
            "cpu_ms_per_request": 1e3 * statistics.median(values),
            "runs_ms": [round(1e3 * v, 4) for v in values],
        }
        for (name, mt), values in samples.items()
    ]


def fit(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per variant, from its two smallest ``max_tokens``: intake (fixed) and per-token CPU, ms."""
    out = {}
    for name in dict.fromkeys(r["variant"] for r in rows):
        pts = sorted((r["max_tokens"], r["cpu_ms_per_request"]) for r in rows if r["variant"] == name)
        if len(pts) >= 2:
            (t0, c0), (t1, c1) = pts[0], pts[1]
            per_token = (c1 - c0) / (t1 - t0)
            out[name] = {"intake_ms": c0 - per_token * t0, "per_token_ms": per_token}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model dir (default: the engine benchmark model)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--waves", type=int, default=10, help="waves per measurement")
    p.add_argument("--max-tokens", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=1, help="engine torch threads (the loop keeps a core)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "server_intake.json"))
    args = p.parse_args(argv)

    rows = asyncio.run(run(args))
    print(f"{'variant':>15} {'max_tokens':>10} {'loop CPU/request':>17}  runs (ms)")
    for r in rows:
        runs = ", ".join(f"{v:.3f}" for v in r["runs_ms"])
        print(f"{r['variant']:>15} {r['max_tokens']:>10} {r['cpu_ms_per_request']:14.3f} ms  {runs}")
    split = fit(rows)
    for name, f in split.items():
        print(f"{name:>15}: intake {f['intake_ms']:.3f} ms + {1e3 * f['per_token_ms']:.1f} us per token")
    if {"ferry", "fastapi-routes"} <= split.keys():
        a, b = split["ferry"]["intake_ms"], split["fastapi-routes"]["intake_ms"]
        print(f"intake: ferry {a:.3f} ms vs FastAPI's routes {b:.3f} ms ({a / b:.2f}x)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, args, rows=rows, fit=split)
    return 0


if __name__ == "__main__":
    sys.exit(main())
