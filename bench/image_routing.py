"""Cache-aware routing of multi-turn image chats: what keying images by their bytes buys.

``--replicas`` ``ferry serve`` replicas of a small LLaVA checkpoint (random weights; 8x8 patches of
``--image-size`` pixel images: ``(image_size / 8) ** 2`` placeholder tokens per image) behind one
``ferry router --policy cache_aware --model DIR``. Each conversation opens with its own image and
asks ``--turns`` questions, resending the image and the history every turn, as chat clients do.
Three configs, each on conversations of its own (told apart by a tag in the system prompt and by
their images):

* ``data URLs`` — the images inline: the router keys every turn's blocks through the image (its
  bytes' digest, as the replicas key them), so a conversation's later turns find the replica that
  holds its KV;
* ``http URLs`` — the same images from a loopback origin: the router fetches no URL and keys each
  image by its URL instead (matched against its own history only; before that, its keys stopped
  before the image and it could not tell the conversations apart); the replicas fetch and cache
  exactly as above;
* ``round robin`` — no cache awareness, data URLs;
* ``one replica`` — every request to one replica, no router: one cache sees every prefix, so its
  hit rate is the workload's ceiling for any router.

Per config: the replicas' prefix-cache hit rate (Δ``vllm:prefix_cache_hits`` / Δ``queries``) and
client TTFT p50/p99. Loopback only, bounded; every process is stopped. Prints a table, writes
``bench/results/image_routing.json``.

    .venv/bin/python bench/image_routing.py [--conversations 24 --turns 4 --replicas 2]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.router import Service, cache_counters, free_port, one_request, pct, print_table  # noqa: E402
from router.upstream import UpstreamClient  # noqa: E402


def png(seed: int, size: int) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def serve_images(images: dict[str, bytes]) -> tuple[ThreadingHTTPServer, str]:
    class Origin(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's API
            data = images.get(self.path)
            if data is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Origin)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


async def converse_all(
    base: str, model: str, convs: list[tuple[str, str]], turns: int, concurrency: int
) -> list[float]:
    """Each conversation (system prompt, image URL): ``turns`` questions, the image in the first."""
    client = UpstreamClient(read_timeout=120)
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []

    async def converse(system: str, url: str) -> None:
        first = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is this?"}]
        msgs: list[dict] = [{"role": "system", "content": system}, {"role": "user", "content": first}]
        for t in range(turns):
            async with sem:
                body = {"model": model, "messages": msgs, "max_tokens": 4, "temperature": 0, "stream": True}
                _, ttft, status = await one_request(client, base, "/v1/chat/completions", body)
            if status == 200:
                ttfts.append(ttft)
            msgs += [
                {"role": "assistant", "content": f"answer {t}"},
                {"role": "user", "content": f"and {t}?"},
            ]

    await asyncio.gather(*(converse(s, u) for s, u in convs))
    await client.aclose()
    return ttfts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--image-size", type=int, default=64, help="pixels a side (8x8 patches)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--out", default=str(REPO / "bench/results/image_routing.json"))
    args = p.parse_args(argv)
    from engine.demo import build_llava

    root = Path(tempfile.gettempdir()) / "ferry-bench-models"
    model = root / f"bench-llava-{args.image_size}"
    if not (model / "config.json").exists():
        build_llava(model, seed=0, image_size=args.image_size)
    logdir = Path(tempfile.mkdtemp(prefix="ferry-bench-image-routing-"))
    configs = [
        ("data URLs", "cache_aware"),
        ("http URLs", "cache_aware"),
        ("round robin", "round_robin"),
        ("one replica", "-"),
    ]
    images = {
        f"/c{ci}-{i}.png": png(1000 * ci + i, args.image_size)
        for ci in range(len(configs))
        for i in range(args.conversations)
    }
    httpd, origin = serve_images(images)
    replicas: list[Service] = []
    rows = []
    try:
        for _ in range(args.replicas):
            port = free_port()
            cmd = [sys.executable, "-m", "ferry", "serve", "--model", str(model), "--port", str(port)]
            replicas.append(
                Service("replica", [*cmd, "--num-threads", "1", "--served-model-name", "llava"], port, logdir)
            )
        for r in replicas:
            r.wait("/health")
        urls = [r.url for r in replicas]
        for ci, (name, policy) in enumerate(configs):
            convs = []
            for i in range(args.conversations):
                path = f"/c{ci}-{i}.png"
                url = (
                    origin + path
                    if name == "http URLs"
                    else "data:image/png;base64," + base64.b64encode(images[path]).decode()
                )
                convs.append((f"[config {ci}] conversation {i}: answer briefly.", url))
            router = None
            if policy != "-":
                port = free_port()
                cmd = [sys.executable, "-m", "ferry", "router", "--port", str(port), "--policy", policy]
                cmd += [f for u in urls for f in ("--replica", u)] + ["--model", str(model)]
                router = Service("router", cmd, port, logdir)
            try:
                if router is not None:
                    router.wait("/health", timeout=60)
                    time.sleep(1.0)  # the first health round
                base = router.url if router is not None else urls[0]
                before = cache_counters(urls)
                t0 = time.perf_counter()
                ttfts = asyncio.run(converse_all(base, "llava", convs, args.turns, args.concurrency))
                wall = time.perf_counter() - t0
                after = cache_counters(urls)
            finally:
                if router is not None:
                    router.stop()
            hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
            queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
            rows.append(
                {
                    "config": name,
                    "policy": policy,
                    "hit_rate": hits / max(queries, 1),
                    "prompt_tokens": queries,
                    "ttft_p50_ms": 1000 * pct(ttfts, 0.5),
                    "ttft_p99_ms": 1000 * pct(ttfts, 0.99),
                    "ok": len(ttfts),
                    "requests": args.conversations * args.turns,
                    "wall_s": wall,
                }
            )
    finally:
        for r in replicas:
            r.stop()
        httpd.shutdown()
    tokens = (args.image_size // 8) ** 2
    print_table(
        f"Image chats behind ferry router ({args.replicas} LLaVA replicas, {tokens} tokens per image; "
        f"{args.conversations} conversations x {args.turns} turns, {args.concurrency} at once)",
        rows,
        ["config", "policy", "hit_rate", "prompt_tokens", "ttft_p50_ms", "ttft_p99_ms", "ok", "wall_s"],
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"platform": platform.platform(), "cpus": os.cpu_count()}
    out.write_text(json.dumps({"machine": machine, "args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
