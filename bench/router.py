"""Router benchmarks: proxy overhead and routing quality, ferry router vs vllm-router and sglang-router.

1. overhead — two stand-in backends that answer at once (``bench/standin.py``); the same load
   client measures, per target (direct, ferry router, vllm-router, sglang-router): sequential
   latency p50/p99 of non-streamed and streamed requests (added latency = minus direct) and
   requests/s at saturation (streamed chat, ``--concurrency`` clients for ``--duration`` s).
2. quality — ``--replicas`` real ``ferry serve`` replicas of a small model, two multi-turn
   workloads (``--workloads``):
   * ``chat``: groups of conversations share a long system prompt; each turn adds a short question;
   * ``rag``: groups share a short system prompt; each turn pastes a retrieved passage of random
     length (``--passage-words``) before its question, as document Q&A and agent tool results do,
     so a turn's new text can outweigh the conversation it continues.
   Per router config: the replicas' prefix-cache hit rate (Δ``vllm:prefix_cache_hits`` /
   Δ``queries``), the prefill imbalance (most prefilled tokens on one replica over the mean),
   the router's CPU seconds (medians of ``--repeats`` interleaved runs), and client TTFT p50/p99
   over the requests of all runs, with the range of the runs' own p50s. All configs of a repeat get the same conversations, each opened by its own
   tag, so caches warmed by one config never help another. The "one replica" row sends everything
   to a single replica with no router: one cache sees every prefix, so its hit rate is the
   workload's ceiling for any router (its TTFT is not comparable: one replica does all the work).

Loopback only, bounded in count and time; every process it starts is stopped. Prints tables and
writes JSON to ``bench/results/router.json``. Numbers on a shared machine are disturbed by other
load: compare configs of one run, not runs.

    .venv/bin/python bench/router.py [--part overhead|quality|all] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from router.upstream import UpstreamClient  # noqa: E402  (the load client: lean keep-alive HTTP/1.1)

BIN = Path(sys.executable).parent
FERRY_EXTRA: list[str] = []  # --ferry-args, e.g. "--balance-abs-threshold 8"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    def __init__(self, name: str, args: list[str], port: int, logdir: Path) -> None:
        self.name, self.args, self.port = name, args, port
        self.log = logdir / f"{name}-{port}.log"
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait(self, probe: str, body: dict | None = None, timeout: float = 180.0) -> Service:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            try:
                r = (
                    httpx.post(self.url + probe, json=body, timeout=5)
                    if body
                    else httpx.get(self.url + probe, timeout=2)
                )
                if r.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready: {self.log.read_text()[-2000:]}")

    def cpu_seconds(self) -> float:
        """CPU time of every process in this service's session (a launcher and what it spawned)."""
        total = 0.0
        tick = os.sysconf("SC_CLK_TCK")
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == self.proc.pid:  # session id
                total += (int(fields[11]) + int(fields[12])) / tick
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def router_cmd(kind: str, port: int, urls: list[str], policy: str, model_dir: str | None) -> list[str]:
    if kind == "ferry":
        cmd = [sys.executable, "-m", "ferry", "router", "--port", str(port), "--policy", policy]
        for u in urls:
            cmd += ["--replica", u]
        if model_dir and policy == "cache_aware":
            cmd += ["--model", model_dir]
        return cmd + FERRY_EXTRA
    prom = ["--prometheus-port", str(free_port())]
    if kind == "vllm-router":
        return [
            str(BIN / "vllm-router"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *urls,
            "--policy",
            policy,
            *prom,
        ]
    return [
        str(BIN / "sglang-router"),
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *urls,
        "--policy",
        policy,
        *prom,
    ]


def available(kind: str) -> bool:
    return kind == "ferry" or (BIN / kind.split()[0]).exists() or shutil.which(kind) is not None


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# ---------------------------------------------------------------- load client


_CONTENT = re.compile(rb'"(?:content|text)": ?"[^"]')


async def one_request(client: UpstreamClient, base: str, path: str, body: dict) -> tuple[float, float, int]:
    """(latency, ttft, status); ttft = the first chunk carrying text (whole answer when not streamed)."""
    payload = json.dumps(body).encode()
    t0 = time.perf_counter()
    resp = await client.request("POST", base, path, [(b"content-type", b"application/json")], payload)
    ttft = None
    try:
        async for chunk in resp.aiter_raw():
            if ttft is None and _CONTENT.search(chunk):
                ttft = time.perf_counter() - t0
    finally:
        await resp.aclose()
    latency = time.perf_counter() - t0
    return latency, ttft if ttft is not None else latency, resp.status_code


async def sequential(base: str, path: str, body: dict, n: int, warmup: int = 20) -> list[float]:
    client = UpstreamClient(read_timeout=60)
    try:
        for _ in range(warmup):
            await one_request(client, base, path, body)
        out = []
        for _ in range(n):
            lat, _, status = await one_request(client, base, path, body)
            if status == 200:
                out.append(lat)
        return out
    finally:
        await client.aclose()


async def saturate(base: str, path: str, body: dict, concurrency: int, duration: float) -> tuple[float, int]:
    client = UpstreamClient(read_timeout=60)
    done = errors = 0
    stop_at = time.perf_counter() + duration

    async def worker() -> None:
        nonlocal done, errors
        while time.perf_counter() < stop_at:
            try:
                _, _, status = await one_request(client, base, path, body)
                done += status == 200
                errors += status != 200
            except Exception:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    await client.aclose()
    return done / elapsed, errors


# ---------------------------------------------------------------- part 1: overhead


def bench_overhead(args: argparse.Namespace, logdir: Path) -> dict:
    backends = [
        Service(
            "standin",
            [sys.executable, str(REPO / "bench/standin.py"), "--port", str(p), "--tokens", "16"],
            p,
            logdir,
        )
        for p in (free_port(), free_port())
    ]
    completion = {"model": "standin", "prompt": "hello router", "max_tokens": 16}
    chat = {
        "model": "standin",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 16,
        "stream": True,
    }
    rows = []
    try:
        for b in backends:
            b.wait("/health")
        urls = [b.url for b in backends]
        targets: list[tuple[str, Service | None]] = [("direct (one stand-in)", None)]
        for kind in ("ferry", "vllm-router", "sglang-router"):
            if available(kind):
                targets.append((kind, None))
        for name, _ in targets:
            svc = None
            if name.startswith("direct"):
                base = urls[0]
            else:
                port = free_port()
                svc = Service(name, router_cmd(name, port, urls, "round_robin", None), port, logdir)
                svc.wait("/v1/completions", completion, timeout=60)
                base = svc.url
            try:
                plain = asyncio.run(sequential(base, "/v1/completions", completion, args.requests))
                streamed = asyncio.run(sequential(base, "/v1/chat/completions", chat, args.requests))
                measured = svc or backends[0]  # CPU of the router (of the stand-in for "direct")
                cpu0 = measured.cpu_seconds()
                rps, errors = asyncio.run(
                    saturate(base, "/v1/chat/completions", chat, args.concurrency, args.duration)
                )
                cpu_us = 1e6 * (measured.cpu_seconds() - cpu0) / max(rps * args.duration, 1)
            finally:
                if svc is not None:
                    svc.stop()
            rows.append(
                {
                    "target": name,
                    "p50_ms": 1000 * pct(plain, 0.5),
                    "p99_ms": 1000 * pct(plain, 0.99),
                    "stream_p50_ms": 1000 * pct(streamed, 0.5),
                    "stream_p99_ms": 1000 * pct(streamed, 0.99),
                    "rps": rps,
                    "cpu_us_per_req": cpu_us,
                    "errors": errors,
                }
            )
    finally:
        for b in backends:
            b.stop()
    base = rows[0]
    for r in rows:
        r["added_p50_ms"] = r["p50_ms"] - base["p50_ms"]
        r["added_stream_p50_ms"] = r["stream_p50_ms"] - base["stream_p50_ms"]
    print_table(
        f"Proxy overhead (stand-in backends; {args.requests} sequential requests; saturation: streamed chat, "
        f"{args.concurrency} clients, {args.duration:.0f}s)",
        rows,
        [
            "target",
            "p50_ms",
            "p99_ms",
            "added_p50_ms",
            "stream_p50_ms",
            "stream_p99_ms",
            "added_stream_p50_ms",
            "rps",
            "cpu_us_per_req",
            "errors",
        ],
    )
    return {"rows": rows}


# ---------------------------------------------------------------- part 2: routing quality


def build_model(root: Path) -> Path:
    from engine.demo import build_model as build

    out = root / "bench-llama"
    if not (out / "config.json").exists():
        build(
            out,
            "llama",
            seed=0,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=4096,
        )
    return out


_WORDS = [w for w in (Path(__file__).read_text().split()) if w.isalpha()][:400] or ["word"]


def conversations(
    seed: str, workload: str, groups: int, per_group: int, turns: int, args: argparse.Namespace
) -> list[list[str]]:
    """Per conversation: its system prompt, then the user message of each turn."""
    rng = random.Random(f"{workload}/{seed}")

    def text(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    system_words = args.system_words if workload == "chat" else args.rag_system_words
    lo, hi = (int(x) for x in args.passage_words.split("-"))
    out = []
    for g in range(groups):
        system = f"group {g}: " + text(system_words)
        for c in range(per_group):
            if workload == "chat":
                users = [f"conversation {c} of group {g}: {text(1)}?"] + [
                    f"and {t}?" for t in range(turns - 1)
                ]
            else:
                users = [
                    f"passage:\n{text(rng.randint(lo, hi))}\nquestion {t}: {text(1)}?" for t in range(turns)
                ]
            out.append([system, *users])
    rng.shuffle(out)
    return out


async def run_conversations(base: str, convs: list[list[str]], concurrency: int) -> list[float]:
    client = UpstreamClient(read_timeout=120)
    ttfts: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def converse(conv: list[str]) -> None:
        msgs = [{"role": "system", "content": conv[0]}]
        for t, user in enumerate(conv[1:]):
            msgs.append({"role": "user", "content": user})
            async with sem:
                body = {
                    "model": "bench-llama",
                    "messages": msgs,
                    "max_tokens": 8,
                    "temperature": 0,
                    "stream": True,
                }
                _, ttft, status = await one_request(client, base, "/v1/chat/completions", body)
            if status == 200:
                ttfts.append(ttft)
            msgs.append({"role": "assistant", "content": f"answer {t}"})

    await asyncio.gather(*(converse(m) for m in convs))
    await client.aclose()
    return ttfts


def cache_counters(urls: list[str]) -> list[tuple[float, float]]:
    """(prefix-cache hits, queries) per replica, in tokens."""
    out = []
    for u in urls:
        hits = queries = 0.0
        for line in httpx.get(u + "/metrics", timeout=5).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.split()[-1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.split()[-1])
        out.append((hits, queries))
    return out


def bench_quality(args: argparse.Namespace, logdir: Path) -> dict:
    model = build_model(Path(tempfile.gettempdir()) / "ferry-bench-models")
    replicas = []
    rows = []
    try:
        for _ in range(args.replicas):
            port = free_port()
            replicas.append(
                Service(
                    "replica",
                    [
                        sys.executable,
                        "-m",
                        "ferry",
                        "serve",
                        "--model",
                        str(model),
                        "--port",
                        str(port),
                        "--num-threads",
                        "1",
                    ],
                    port,
                    logdir,
                )
            )
        for r in replicas:
            r.wait("/health")
        urls = [r.url for r in replicas]
        configs = [("ferry", "cache_aware"), ("ferry", "round_robin")]
        configs += [(k, "cache_aware") for k in ("vllm-router", "sglang-router") if available(k)]
        configs.append(("one replica", "-"))
        if args.only:
            configs = [c for c in configs if c[0] in args.only.split(",")]
        probe = {"model": "bench-llama", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
        # Every config of one repeat gets the same conversations, told apart only by a fixed-length
        # tag at the start of each system prompt (so no config's cache helps another); configs run
        # interleaved, repeat after repeat, so a burst of load on the box hits them alike.
        for rep in range(args.repeats):
            for workload in args.workloads.split(","):
                convs = conversations(f"r{rep}", workload, args.groups, args.per_group, args.turns, args)
                for ci, (kind, policy) in enumerate(configs):
                    tagged = [[f"[r{rep}c{ci}] {c[0]}", *c[1:]] for c in convs]
                    rows.append(
                        run_quality_config(args, logdir, urls, model, workload, tagged, kind, policy, probe)
                    )
    finally:
        for r in replicas:
            r.stop()
    summary = summarize(rows)
    print_table(
        f"Routing quality ({args.replicas} ferry replicas; {args.groups} prompt groups x {args.per_group} "
        f"conversations x {args.turns} turns, {args.concurrency_quality} at once; {args.repeats} runs: "
        "TTFT over all their requests, other columns medians)",
        summary,
        [
            "workload",
            "router",
            "policy",
            "hit_rate",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "run_p50s_ms",
            "prefill_imbalance",
            "wall_s",
            "router_cpu_s",
        ],
    )
    return {"rows": rows, "summary": summary}


def run_quality_config(
    args: argparse.Namespace,
    logdir: Path,
    urls: list[str],
    model: Path,
    workload: str,
    convs: list[list[str]],
    kind: str,
    policy: str,
    probe: dict,
) -> dict:
    svc = None
    if kind == "one replica":
        base = urls[0]  # every request on one cache: the workload's hit-rate ceiling
    else:
        port = free_port()
        svc = Service(kind, router_cmd(kind, port, urls, policy, str(model)), port, logdir)
        base = svc.url
    try:
        if svc is not None:
            svc.wait("/v1/chat/completions", probe, timeout=60)
        before = cache_counters(urls)
        c0 = svc.cpu_seconds() if svc is not None else 0.0
        t0 = time.perf_counter()
        ttfts = asyncio.run(run_conversations(base, convs, args.concurrency_quality))
        wall = time.perf_counter() - t0
        c1 = svc.cpu_seconds() if svc is not None else 0.0
        after = cache_counters(urls)
    finally:
        if svc is not None:
            svc.stop()
    hits = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    queries = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    computed = [q - h for h, q in zip(hits, queries, strict=True)]  # prompt tokens each replica prefilled
    return {
        "workload": workload,
        "router": kind,
        "policy": policy,
        "hit_rate": sum(hits) / max(sum(queries), 1),
        "prompt_tokens": sum(queries),
        "computed_per_replica": computed,
        # Most loaded replica's prefill work over the mean (1.0 = even; "one replica" = N).
        "prefill_imbalance": max(computed) / max(sum(computed) / len(computed), 1),
        "ttft_p50_ms": 1000 * pct(ttfts, 0.5),
        "ttft_p99_ms": 1000 * pct(ttfts, 0.99),
        "ttfts_ms": [round(1000 * t, 3) for t in ttfts],
        "ok": len(ttfts),
        "requests": len(convs) * args.turns,
        "wall_s": wall,
        "router_cpu_s": c1 - c0,
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Median of each measure per (workload, router, policy), in first-seen order."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["router"], r["policy"]), []).append(r)
    out = []
    for (workload, router, policy), rs in groups.items():
        row: dict = {"workload": workload, "router": router, "policy": policy, "runs": len(rs)}
        for k in ("hit_rate", "prefill_imbalance", "wall_s", "router_cpu_s"):
            row[k] = statistics.median(r[k] for r in rs)
        # TTFT over every request of every repeat (a run's p50 moves more between runs than
        # routers differ); the spread of the per-run p50s says how far to trust a difference.
        pooled = [t / 1000 for r in rs for t in r["ttfts_ms"]]
        row["ttft_p50_ms"] = 1000 * pct(pooled, 0.5)
        row["ttft_p99_ms"] = 1000 * pct(pooled, 0.99)
        runs = sorted(r["ttft_p50_ms"] for r in rs)
        row["run_p50s_ms"] = f"{runs[0]:.0f}-{runs[-1]:.0f}"
        row["failed"] = sum(r["requests"] - r["ok"] for r in rs)
        out.append(row)
    return out


def print_table(title: str, rows: list[dict], cols: list[str]) -> None:
    def fmt(v: object) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in cols]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for r in rows:
        print("  ".join(fmt(r[c]).ljust(w) for c, w in zip(cols, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["overhead", "quality", "all"], default="all")
    p.add_argument("--quick", action="store_true", help="small counts, to check the script works")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-words", type=int, default=300, help="chat: shared system prompt length")
    p.add_argument("--rag-system-words", type=int, default=40, help="rag: shared system prompt length")
    p.add_argument("--passage-words", default="40-300", help="rag: passage length range per turn, words")
    p.add_argument("--workloads", default="chat,rag", help="quality workloads to run: chat, rag")
    p.add_argument("--repeats", type=int, default=1, help="quality: run every config N times, report medians")
    p.add_argument("--concurrency-quality", type=int, default=6)
    p.add_argument("--out", default=str(REPO / "bench/results/router.json"))
    p.add_argument(
        "--ferry-args", default="", help="extra flags for ferry router, e.g. '--load-penalty-tokens 32'"
    )
    p.add_argument("--only", default="", help="comma-separated router kinds to run (default: all)")
    args = p.parse_args(argv)
    FERRY_EXTRA.extend(args.ferry_args.split())
    if args.quick:
        args.requests, args.duration, args.groups, args.per_group, args.turns = 60, 2.0, 3, 2, 2
        args.replicas = 2
    logdir = Path(tempfile.mkdtemp(prefix="ferry-bench-router-"))
    result: dict = {"args": vars(args), "cpus": os.cpu_count(), "load_avg_at_start": os.getloadavg()}
    if args.part in ("overhead", "all"):
        result["overhead"] = bench_overhead(args, logdir)
    if args.part in ("quality", "all"):
        result["quality"] = bench_quality(args, logdir)
    result["load_avg_at_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out} (logs in {logdir}); load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
