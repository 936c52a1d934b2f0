"""Load generation: drive the request set at a sweep point (concurrency cap and/or arrival rate).

* Arrivals: with a finite rate, chains start at gamma-distributed gaps (shape --burstiness, mean
  1/rate; burstiness 1 is a Poisson process). The gaps come from a generator seeded by --seed, so
  every run of a point sees the same schedule. With rate inf every chain arrives at once.
* Concurrency: at most --concurrency chains in flight (a chain is one request, or one whole
  conversation for multi-turn: a session holds its slot from first turn to last).
* Warm-up: the first --warmup chains run before the measured phase, at the same concurrency.
* Every run sends the same request set, so a server with a prefix cache serves later runs'
  prompts from cache; --reset-prefix-cache asks the server to drop it before each run.
* A lost server ends the run fast: the first connection error (refused / unreachable) marks the
  server lost; no further request is sent, and every chain not yet sent is recorded as
  ``not_sent``. Requests in flight end on their own errors (a killed server closes their sockets).
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
import uuid
from dataclasses import dataclass

import httpx

from bench.client.config import BenchConfig, LoadPoint
from bench.client.progress import Progress
from bench.client.request import send_request
from bench.client.types import BenchRequest, Chain, ErrorKind, RequestRecord


@dataclass
class RunResult:
    run: int
    point: LoadPoint
    repeat: int
    records: list[RequestRecord]
    duration_s: float  # measured phase: first arrival to last completion
    lost: str | None  # why the server was declared lost, if it was


def arrival_gaps(rate: float, burstiness: float, n: int, seed: int) -> list[float]:
    """Seconds between consecutive arrivals (the first chain arrives at 0)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals-{seed}")
    theta = 1.0 / (rate * burstiness)
    return [0.0] + [rng.gammavariate(burstiness, theta) for _ in range(max(n - 1, 0))]


class PointRunner:
    """Runs the request set once at one sweep point."""

    def __init__(self, cfg: BenchConfig, chains: list[Chain], base_headers: dict[str, str]) -> None:
        self.cfg = cfg
        self.chains = chains
        self.base_headers = base_headers
        self.lost: str | None = None
        self._reset_warned = False

    async def run(self, run: int, point: LoadPoint, repeat: int) -> RunResult:
        self.lost = None
        nonce = uuid.uuid4().hex[:8]
        limits = httpx.Limits(max_connections=point.concurrency, max_keepalive_connections=point.concurrency)
        timeout = httpx.Timeout(self.cfg.timeout, connect=min(self.cfg.timeout, 30.0))
        records: list[RequestRecord] = []
        warm = self.chains[: self.cfg.warmup]
        measured = self.chains[self.cfg.warmup :]
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
            ctx = _RunContext(self, client, run, point, repeat, nonce, records)
            if self.cfg.reset_prefix_cache:
                await self._reset_prefix_cache(client)
            if warm:
                progress = Progress(f"{point.label} warm-up", sum(map(len, warm)), self.cfg.progress)
                sem = _semaphore(point.concurrency)
                ctx.t0 = time.perf_counter()
                await asyncio.gather(*(ctx.run_chain(i, c, sem, True, progress) for i, c in enumerate(warm)))
                progress.close()
            progress = Progress(
                f"{point.label} run {repeat + 1}/{self.cfg.repeat}",
                sum(map(len, measured)),
                self.cfg.progress,
            )
            t0 = time.perf_counter()
            for r in records:  # warm-up send times become negative offsets from the measured start
                r.send_time_s -= t0 - ctx.t0
            ctx.t0 = t0
            sem = _semaphore(point.concurrency)
            gaps = arrival_gaps(point.request_rate, self.cfg.burstiness, len(measured), self.cfg.seed)
            tasks = []
            next_at = t0
            for i, (chain, gap) in enumerate(zip(measured, gaps, strict=False)):
                next_at += gap
                delay = next_at - time.perf_counter()
                if delay > 0 and self.lost is None:
                    await asyncio.sleep(delay)
                tasks.append(
                    asyncio.create_task(ctx.run_chain(self.cfg.warmup + i, chain, sem, False, progress))
                )
            await asyncio.gather(*tasks)
            duration = time.perf_counter() - t0
            progress.close()
        records.sort(key=lambda r: (r.warmup is False, r.chain, r.turn))
        return RunResult(run, point, repeat, records, duration, self.lost)

    async def _reset_prefix_cache(self, client: httpx.AsyncClient) -> None:
        """POST /reset_prefix_cache (vLLM's endpoint) so a run does not reuse the previous run's
        cached prompts. A server without it gets one warning, and the run goes on."""
        if self._reset_warned:
            return
        try:
            resp = await client.post(self.cfg.base_url + "/reset_prefix_cache", headers=self.base_headers)
            problem = None if resp.status_code < 300 else f"answered {resp.status_code}"
        except httpx.HTTPError as exc:
            problem = f"failed: {exc}"
        if problem:
            self._reset_warned = True
            print(
                f"ferry bench: warning: POST /reset_prefix_cache {problem}; runs may hit the prefix cache "
                "of earlier runs",
                file=sys.stderr,
            )


def _semaphore(n: int | None) -> asyncio.Semaphore | None:
    return asyncio.Semaphore(n) if n is not None else None


class _RunContext:
    def __init__(
        self,
        runner: PointRunner,
        client: httpx.AsyncClient,
        run: int,
        point: LoadPoint,
        repeat: int,
        nonce: str,
        records: list[RequestRecord],
    ) -> None:
        self.runner = runner
        self.cfg = runner.cfg
        self.client = client
        self.run = run
        self.point = point
        self.repeat = repeat
        self.nonce = nonce
        self.records = records
        self.t0 = 0.0
        self._index_of: dict[int, int] = {}
        start = 0
        for i, chain in enumerate(runner.chains):
            self._index_of[i] = start
            start += len(chain)

    def _record(self, chain_i: int, turn_i: int, req: BenchRequest, warmup: bool) -> RequestRecord:
        rec = RequestRecord(
            run=self.run,
            concurrency=self.point.concurrency,
            request_rate=None if math.isinf(self.point.request_rate) else self.point.request_rate,
            repeat=self.repeat,
            chain=chain_i,
            index=self._index_of[chain_i] + turn_i,
            warmup=warmup,
            session_id=req.session_id,
            turn=req.turn,
            input_len=req.input_len,
            output_len=req.output_len,
        )
        self.records.append(rec)
        return rec

    async def run_chain(
        self, chain_i: int, chain: Chain, sem: asyncio.Semaphore | None, warmup: bool, progress: Progress
    ) -> None:
        if sem is None:
            await self._run_chain(chain_i, chain, warmup, progress)
            return
        async with sem:
            await self._run_chain(chain_i, chain, warmup, progress)

    async def _run_chain(self, chain_i: int, chain: Chain, warmup: bool, progress: Progress) -> None:
        history: list[dict] = []  # chat: the conversation so far
        previous: str | None = None  # responses: the last answer's id (the server keeps the rest)
        broken: str | None = None
        for turn_i, req in enumerate(chain):
            rec = self._record(chain_i, turn_i, req, warmup)
            rec.send_time_s = time.perf_counter() - self.t0
            why_not = self.runner.lost and f"not sent: server lost ({self.runner.lost})"
            why_not = why_not or (broken and f"not sent: an earlier turn of the session failed ({broken})")
            if why_not:
                rec.error_kind, rec.error = ErrorKind.NOT_SENT, why_not
                progress.update(False)
                continue
            body = req.body
            if req.session_id is not None and req.endpoint == "responses":
                if previous is not None:
                    body = {**req.body, "previous_response_id": previous}
            elif req.session_id is not None:
                body = {**req.body, "messages": history + req.body["messages"]}
            headers = dict(self.runner.base_headers)
            headers["X-Request-Id"] = f"bench-{self.nonce}-{self.run}-{rec.index}"
            if req.session_id is not None:
                headers["X-Session-Id"] = req.session_id
            out = await send_request(
                self.client, self.cfg.base_url, req.endpoint, body, headers, rec, self.cfg.timeout
            )
            if rec.error_kind == ErrorKind.CONNECT and self.runner.lost is None:
                self.runner.lost = rec.error or "connection error"
            if not rec.ok:
                broken = rec.error_kind
            elif req.session_id is not None and req.endpoint == "responses":
                previous = out.response_id
            elif req.session_id is not None:
                history = body["messages"] + [{"role": "assistant", "content": out.text}]
            progress.update(rec.ok)
