"""What the HTTP layer costs: TTFT and inter-token latency through `ferry serve` vs in-process AsyncEngine.

Same model, same engine options, same requests (token-id prompts, greedy, ``ignore_eos`` so every
request makes exactly ``--max-tokens`` tokens), at each concurrency in ``--concurrency``:

* in-process: ``AsyncEngine.generate`` called directly from asyncio tasks;
* HTTP: a `ferry serve` subprocess, streamed over loopback by a minimal asyncio HTTP/1.1 client in
  this process (SSE parsed here) on keep-alive connections, as SDK clients pool them; with
  ``--api-server-count 1 2``, one such mode per count (``http``: one process, the engine on a
  thread; ``http-2``: an engine process behind 2 API server processes), all interleaved; with
  ``--burst-wait-ms 25 0``, each of those once per burst wait (``http/bw25``, ``http/bw0``, ...);
  with ``--base DIR``, each of those also served from another checkout (``base/http-4``, ...), so
  a change and the code before it are measured in one interleaved run.

Both modes get one unrecorded wave per concurrency first. TTFT is submit -> first token; TPOT
(time per output token, the mean inter-token latency) is (last token - first token) / (tokens - 1)
per request. Over HTTP a token counts as there when its bytes arrived (stamped as the event loop
reads the socket, ``_StampedReader``), not when this client got round to parsing it: its one loop
parses 32 streams' first chunks one after another, which independent clients would not; the
parse-time TTFT p50 is printed too. The table prints p50/p90 of each mode, the milliseconds and ratio each HTTP mode adds
and the CPU per token of the server's event loop (``http``) or of all API server processes and of the
engine process's event loop (``http-N``); JSON goes to bench/results/server_overhead.json. Those
CPU clocks are the scheduler's nanosecond counts (/proc/PID/task/TID/schedstat; clock ticks of
10 ms where a kernel keeps none, which need hundreds of requests per cell to say anything).

Default model: the engine benchmark model (Llama, hidden 512, 8 layers, 8 heads, 2 KV heads,
intermediate 1408, vocab 32000, random fp32 weights), built once into the ferry cache directory.
On a shared machine, numbers move with other load; compare runs from the same minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
BENCH_SPEC = dict(
    arch="llama",
    seed=0,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tokenizer_vocab_size=32000,
)


def bench_model_dir() -> Path:
    """The engine benchmark model, built on first use (bench/engine_throughput.py's when it exists)."""
    try:
        from bench.engine_throughput import bench_model_dir as shared  # the engine bench owns the spec

        return Path(shared())
    except (ImportError, AttributeError):
        pass
    from engine.demo import build_model

    base = Path(os.environ.get("FERRY_CACHE_DIR") or Path.home() / ".cache" / "ferry")
    target = base / "bench-llama-512x8"
    if not (target / "config.json").exists():
        build_model(target, **BENCH_SPEC)
    return target


@dataclass
class Sample:
    ttft_s: float
    tpot_s: float
    tokens: int
    # HTTP: TTFT stamped when this client had parsed the chunk, not when its bytes arrived (the
    # client's one event loop reads the other streams' chunks in between)
    ttft_parsed_s: float | None = None


@dataclass
class Summary:
    mode: str
    concurrency: int
    requests: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    wall_s: float
    # CPU the server's event-loop thread spent per generated token (HTTP mode): parsing,
    # chunk building, SSE writes; the engine runs on another thread.
    loop_cpu_us_per_token: float | None = None
    # With API server processes: CPU the engine process's event-loop thread spent per token,
    # relaying outputs to them (it shares the GIL with the engine's own thread).
    engine_loop_cpu_us_per_token: float | None = None
    ttft_parsed_p50_ms: float | None = None  # HTTP: TTFT stamped after parsing (Sample)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarize(
    mode: str,
    concurrency: int,
    samples: list[Sample],
    wall: float,
    loop_cpu: float | None = None,
    engine_loop_cpu: float | None = None,
) -> Summary:
    ttft = [s.ttft_s * 1e3 for s in samples]
    tpot = [s.tpot_s * 1e3 for s in samples]
    tokens = sum(s.tokens for s in samples)
    return Summary(
        mode,
        concurrency,
        len(samples),
        statistics.median(ttft),
        _pct(ttft, 0.9),
        statistics.median(tpot),
        _pct(tpot, 0.9),
        wall,
        1e6 * loop_cpu / tokens if loop_cpu is not None and tokens else None,
        1e6 * engine_loop_cpu / tokens if engine_loop_cpu is not None and tokens else None,
        statistics.median(parsed)
        if (parsed := [1e3 * s.ttft_parsed_s for s in samples if s.ttft_parsed_s])
        else None,
    )


def thread_cpu_seconds(pid: int, tid: int) -> float:
    """CPU time of one thread (Linux /proc; the main thread's tid is the pid): the scheduler's
    nanosecond count where the kernel keeps one (``schedstat``), else user + system clock ticks
    (10 ms each: a bench cell of a few hundred requests would read in 15-30 us steps)."""
    try:
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def replica_pids(supervisor: int) -> tuple[list[int], int | None]:
    """The API server processes and the engine process of a ``--api-server-count`` replica: the
    supervisor's children, told apart by torch (only the engine process loads it; the resource
    tracker is left out)."""
    api_servers, engine = [], None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent != supervisor or b"resource_tracker" in Path(f"/proc/{entry}/cmdline").read_bytes():
                continue
            if "libtorch" in Path(f"/proc/{entry}/maps").read_text():
                engine = int(entry)
            else:
                api_servers.append(int(entry))
        except (OSError, IndexError):
            continue
    return api_servers, engine


def processes_cpu_seconds(pids: list[int]) -> float:
    """CPU time of whole processes: all their live threads (``thread_cpu_seconds``)."""
    total = 0.0
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):  # a thread that just ended
                total += thread_cpu_seconds(pid, int(tid))
    return total


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


async def _waves(prompts: list[list[int]], concurrency: int, one) -> tuple[list[Sample], float]:
    """Run ``one(prompt)`` with at most ``concurrency`` in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def run(p: list[int]) -> Sample:
        async with sem:
            return await one(p)

    start = time.perf_counter()
    samples = await asyncio.gather(*(run(p) for p in prompts))
    return list(samples), time.perf_counter() - start


def _sample(submit: float, stamps: list[tuple[float, int]]) -> Sample:
    """From (time, tokens in this delta) stamps: TTFT and per-token time after the first."""
    tokens = sum(n for _, n in stamps)
    first = stamps[0][0]
    tail_tokens = tokens - stamps[0][1]
    tpot = (stamps[-1][0] - first) / tail_tokens if tail_tokens > 0 else 0.0
    return Sample(first - submit, tpot, tokens)


def in_process_runner(engine, max_tokens: int):
    """``one(prompt) -> Sample`` straight on an AsyncEngine."""
    from engine import SamplingParams

    counter = iter(range(10**9))

    async def one(prompt: list[int]) -> Sample:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        stamps: list[tuple[float, int]] = []
        submit = time.perf_counter()
        async for out in engine.generate(f"bench-{next(counter)}", prompt, params):
            n = len(out.outputs[0].token_ids)
            if n:
                stamps.append((time.perf_counter(), n))
        return _sample(submit, stamps)

    return one


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model: str, engine_opts: dict, log_path: Path, api_server_count: int = 1, repo: Path = REPO
) -> tuple[subprocess.Popen, str]:
    """`ferry serve` from the checkout at ``repo`` (this one by default) on a free port."""
    port = _free_port()
    flags = ["--api-server-count", str(api_server_count)]
    for key, value in engine_opts.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    cmd = [
        sys.executable,
        "-m",
        "ferry",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--max-queued-requests",
        "100000",
        *flags,
    ]
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(
        cmd,
        cwd=repo,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
        },
    )
    url = f"http://127.0.0.1:{port}"
    wait_serving(proc, url, log_path)
    return proc, url


def wait_serving(proc: subprocess.Popen, url: str, log_path: Path, timeout: float = 300) -> None:
    """Until the server at ``url`` answers /health 200 (its log's tail raised if it exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ferry serve exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("ferry serve did not start")


def stop_servers(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every server, then wait for each (killed after 60 s)."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


class _StampedReader(asyncio.StreamReader):
    """A StreamReader that notes when each piece of the response arrived: ``feed_data`` runs in the
    event loop's read callback for the socket, before any task resumes, so a chunk's arrival is not
    stamped late by the time this client's one loop spends parsing other streams' chunks first."""

    def __init__(self) -> None:
        super().__init__(limit=1 << 20)
        self.received = 0  # bytes fed so far
        self.arrivals: deque[tuple[int, float]] = deque()  # (bytes received by then, when)

    def feed_data(self, data: bytes) -> None:
        self.received += len(data)
        self.arrivals.append((self.received, time.perf_counter()))
        super().feed_data(data)

    def arrived(self) -> float:
        """When the last byte read from this reader arrived."""
        consumed = self.received - len(self._buffer)
        while self.arrivals[0][0] < consumed:
            self.arrivals.popleft()
        return self.arrivals[0][1]


async def _open(host: str, port: int) -> tuple[_StampedReader, asyncio.StreamWriter]:
    loop = asyncio.get_running_loop()
    reader = _StampedReader()
    transport, protocol = await loop.create_connection(
        lambda: asyncio.StreamReaderProtocol(reader), host, port
    )
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


class _Connections:
    """Keep-alive HTTP/1.1 connections to one server, reused across requests as the OpenAI SDK's
    pool does (a new TCP connection per request would bill its setup to the server's TTFT)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post_sse(self, body: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Send one streaming POST; the caller reads the chunked SSE body, then ``release``s."""
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        while True:
            reused = bool(self.idle)
            conn = self.idle.pop() if reused else await _open(self.host, self.port)
            reader, writer = conn
            try:
                writer.write(head + body)
                await writer.drain()
                status = await reader.readline()
            except ConnectionError:
                status = b""
            if status or not reused:
                break
            writer.close()  # the server closed it while idle (keep-alive timeout): use a fresh one
        if b" 200 " not in status:
            writer.close()
            raise RuntimeError(f"HTTP error: {status!r}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # headers
        return conn

    def release(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], complete: bool) -> None:
        if complete:
            self.idle.append(conn)
        else:
            conn[1].close()


async def _sse_events(reader: asyncio.StreamReader):
    """Yield each SSE event payload (bytes after 'data: ') from a chunked response body, with when
    its bytes arrived (a ``_StampedReader``'s stamp; for a plain reader, when it was read); returns
    after the terminating chunk, leaving the connection ready for the next request.

    A minimal client on purpose: on a small machine a full client library's per-chunk Python work
    competes with the server for the same cores and would be billed to the server."""
    buf = b""
    while True:
        size_line = await reader.readline()
        size = int(size_line.strip() or b"0", 16)
        if size == 0:
            await reader.readline()  # the blank line after the last chunk
            return
        buf += await reader.readexactly(size)
        await reader.readexactly(2)  # CRLF after the chunk
        arrived = reader.arrived() if isinstance(reader, _StampedReader) else time.perf_counter()
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if event.startswith(b"data: "):
                yield event[6:], arrived


def http_runner(url: str, max_tokens: int):
    """``one(prompt) -> Sample`` through `ferry serve`'s /v1/completions stream."""
    host, port = url.removeprefix("http://").split(":")
    connections = _Connections(host, int(port))

    async def one(prompt: list[int]) -> Sample:
        # continuous usage stats: each chunk says how many tokens so far, so deltas that carry
        # several tokens are counted exactly (cheaper for the server than logprobs).
        body = json.dumps(
            {
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"continuous_usage_stats": True},
            }
        ).encode()
        stamps: list[tuple[float, int]] = []  # when each token's bytes arrived
        first_parsed = 0.0
        seen = 0
        submit = time.perf_counter()
        conn = await connections.post_sse(body)
        complete = False
        try:
            async for payload, arrived in _sse_events(conn[0]):
                if payload == b"[DONE]":
                    continue  # read on to the end of the body: the connection is reused
                total = json.loads(payload)["usage"]["completion_tokens"]
                if total > seen:
                    first_parsed = first_parsed or time.perf_counter()
                    stamps.append((arrived, total - seen))
                    seen = total
            complete = True
        finally:
            connections.release(conn, complete)
        sample = _sample(submit, stamps)
        sample.ttft_parsed_s = first_parsed - submit
        return sample

    return one


async def run_interleaved(
    runners: dict,
    prompts: list[list[int]],
    concurrencies: list[int],
    repeats: int,
    cpu_of: dict | None = None,
) -> list[Summary]:
    """Alternate the modes (same prompts, same concurrency) so drifting machine load hits both alike,
    the order rotated every repeat.
    ``cpu_of[mode]()``, where given, reads the CPU clocks charged to that mode's waves: the
    server's (its event loop, or its API server processes) and the engine process's event loop
    (None in one process)."""
    cpu_of = cpu_of or {}
    for one in runners.values():
        await one(prompts[0])  # warm-up
        for c in concurrencies:
            # and one unrecorded wave per concurrency: the first batch of a new shape pays for
            # allocations (hundreds of ms at 32), which would land in one mode's p90.
            await _waves(prompts, c, one)
    samples: dict[tuple[str, int], list[Sample]] = {}
    walls: dict[tuple[str, int], float] = {}
    cpus: dict[tuple[str, int], list[float | None]] = {}
    order = list(runners.items())
    for repeat in range(repeats):
        for c in concurrencies:
            # The order rotates each repeat, so each mode follows each other one as often: what
            # ran just before a mode shows in it (on a 2-core VM, two replicas of the same code
            # differed by 0.2-1 ms of TTFT at 32 when one always followed the in-process engine,
            # or when the other ran twice in a row).
            shift = repeat % len(order)
            for mode, one in order[shift:] + order[:shift]:
                clock = cpu_of.get(mode)
                before = clock() if clock else ()
                got, wall = await _waves(prompts, c, one)
                if clock:
                    spent = [None if b is None else a - b for a, b in zip(clock(), before, strict=True)]
                    total = cpus.setdefault((mode, c), [0.0] * len(spent))
                    for i, value in enumerate(spent):
                        total[i] = None if value is None or total[i] is None else total[i] + value
                samples.setdefault((mode, c), []).extend(got)
                walls[(mode, c)] = walls.get((mode, c), 0.0) + wall
    return [
        summarize(mode, c, samples[(mode, c)], walls[(mode, c)], *cpus.get((mode, c), ()))
        for (mode, c) in samples
    ]


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _one_process(mode: str) -> bool:
    """Whether an HTTP mode's replica is one process (the engine on a thread of the API server's)."""
    return mode.removeprefix("base/").split("/")[0] == "http"


def print_table(rows: list[Summary]) -> list[dict]:
    by_c: dict[int, dict[str, Summary]] = {}
    for r in rows:
        by_c.setdefault(r.concurrency, {})[r.mode] = r
    print(f"{'conc':>4} {'mode':>12} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9} {'TPOT p90':>9}  (ms)")
    overhead = []
    for c, modes in sorted(by_c.items()):
        for r in modes.values():
            print(
                f"{c:>4} {r.mode:>12} {r.ttft_p50_ms:9.2f} {r.ttft_p90_ms:9.2f} {r.tpot_p50_ms:9.2f} {r.tpot_p90_ms:9.2f}"
            )
        for name, h in modes.items():
            if name == "in-process" or "in-process" not in modes:
                continue
            e = modes["in-process"]
            row = {
                "mode": name,
                "concurrency": c,
                "ttft_added_ms_p50": h.ttft_p50_ms - e.ttft_p50_ms,
                "ttft_ratio_p50": h.ttft_p50_ms / e.ttft_p50_ms if e.ttft_p50_ms else None,
                "tpot_added_ms_p50": h.tpot_p50_ms - e.tpot_p50_ms,
                "tpot_ratio_p50": h.tpot_p50_ms / e.tpot_p50_ms if e.tpot_p50_ms else None,
            }
            overhead.append(row)
            print(
                f"{c:>4} {'+' + name:>12} {row['ttft_added_ms_p50']:9.2f} {'':>9} {row['tpot_added_ms_p50']:9.2f}"
                f"   ratio TTFT {_ratio(row['ttft_ratio_p50'])}, TPOT {_ratio(row['tpot_ratio_p50'])}"
            )
            if h.ttft_parsed_p50_ms is not None:
                row["ttft_parsed_added_ms_p50"] = h.ttft_parsed_p50_ms - e.ttft_p50_ms
                print(
                    f"{c:>4} {'':>12} TTFT p50 stamped when parsed: {h.ttft_parsed_p50_ms:.2f} ms "
                    f"(+{row['ttft_parsed_added_ms_p50']:.2f})"
                )
            if h.loop_cpu_us_per_token is not None:
                row["loop_cpu_us_per_token"] = h.loop_cpu_us_per_token
                what = "server event loop" if _one_process(name) else "API server processes"
                print(f"{c:>4} {'':>12} {what}: {h.loop_cpu_us_per_token:.0f} us CPU per token")
            if h.engine_loop_cpu_us_per_token is not None:
                row["engine_loop_cpu_us_per_token"] = h.engine_loop_cpu_us_per_token
                print(
                    f"{c:>4} {'':>12} engine process event loop: {h.engine_loop_cpu_us_per_token:.0f} us CPU per token"
                )
    return overhead


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model dir (default: the engine benchmark model)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--num-kv-blocks", type=int, default=2048)
    p.add_argument(
        "--burst-wait-ms",
        type=float,
        nargs="+",
        default=None,
        help="the engine's burst_wait_ms (default: its own); several values: each HTTP mode once per "
        "value ('http/bw0', ...), interleaved, the in-process engine with the first",
    )
    p.add_argument("--device", default="cpu", help="engine device: cpu | cuda | auto")
    p.add_argument("--dtype", default="auto", help="engine dtype (auto: the checkpoint's)")
    p.add_argument("--repeats", type=int, default=3, help="alternate the modes this many times")
    p.add_argument(
        "--api-server-count",
        type=int,
        nargs="+",
        default=[1],
        help="one HTTP mode per count: a replica with that many API server processes ('http' for 1, "
        "'http-N' for N)",
    )
    p.add_argument(
        "--base",
        default=None,
        help="another checkout (e.g. a git worktree of the code before a change): each HTTP mode is "
        "also served from it ('base/http-4', ...), interleaved with the modes served from this one",
    )
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "server_overhead.json"))
    args = p.parse_args(argv)

    model = args.model or str(bench_model_dir())
    from engine.tokenizer import Tokenizer

    vocab = Tokenizer.from_dir(model).vocab_size
    prompts = make_prompts(args.num_requests, args.prompt_len, vocab)
    engine_opts = {
        "num_threads": args.num_threads,
        "num_kv_blocks": args.num_kv_blocks,
        "max_num_seqs": max(args.concurrency),
        "device": args.device,
        "dtype": args.dtype,
    }
    waits = args.burst_wait_ms or [None]
    if waits[0] is not None:
        engine_opts["burst_wait_ms"] = waits[0]

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for count in args.api_server_count:
            for wait in waits:
                name = "http" if count == 1 else f"http-{count}"
                opts = dict(engine_opts)
                if len(waits) > 1:
                    name += f"/bw{wait:g}"
                    opts["burst_wait_ms"] = wait
                for prefix, repo in (("", REPO), ("base/", args.base)):
                    if repo is None:
                        continue
                    mode = prefix + name
                    log = Path(tempfile.gettempdir()) / f"ferry-server-overhead-{mode.replace('/', '-')}.log"
                    servers[mode] = start_server(model, opts, log, count, Path(repo))  # idle while others run
        rows = asyncio.run(_run(model, engine_opts, servers, prompts, args))
    finally:
        stop_servers([proc for proc, _ in servers.values()])
    overhead = print_table(rows)
    write_result(out, args, model=model, rows=[asdict(r) for r in rows], overhead=overhead)
    return 0


async def _run(
    model: str, engine_opts: dict, servers: dict[str, tuple[subprocess.Popen, str]], prompts, args
) -> list[Summary]:
    from engine import AsyncEngine

    engine = AsyncEngine(model=model, **engine_opts)  # idle while the servers run, and vice versa
    try:
        runners = {"in-process": in_process_runner(engine, args.max_tokens)}
        cpu_of = {}
        for name, (proc, url) in servers.items():
            runners[name] = http_runner(url, args.max_tokens)
            if _one_process(name):  # the event-loop thread (the engine runs on another one)
                cpu_of[name] = lambda pid=proc.pid: (thread_cpu_seconds(pid, pid), None)
            else:  # every API server process, whole; the engine process's event-loop thread
                pids, engine_pid = replica_pids(proc.pid)
                cpu_of[name] = lambda pids=pids, e=engine_pid: (
                    processes_cpu_seconds(pids),
                    thread_cpu_seconds(e, e) if e is not None else None,
                )
        return await run_interleaved(runners, prompts, args.concurrency, args.repeats, cpu_of)
    finally:
        await engine.shutdown()


def write_result(out: Path, args: argparse.Namespace, **fields: object) -> None:
    """``fields`` as JSON at ``out``, with the arguments, the machine's size and load, and the time."""
    load = os.getloadavg()
    result = {
        "args": vars(args),
        **fields,
        "loadavg": load,
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"load average {load[0]:.1f} on {os.cpu_count()} CPUs; wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
