"""A prefill/decode cluster for the PD tests: real `ferry serve` workers and `ferry router`s.

Started once per module (processes load in parallel): two prefill and two decode workers on a
shared Redis tier (the session's private ``redis_server``), one mixed replica without a tier (the
colocated reference), a PD router, a PD router whose prefill timeout no worker can meet, and a
PD router that also has the mixed replica.
Every process is stopped at the end; logs go to the module's tmp dir.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pd.pd_cluster import PD_THRESHOLD, PDCluster
from tests.router.router_harness import Proc, free_port, replica_args


def _replica(model: Path, tmp: Path, name: str, *flags: str) -> Proc:
    port = free_port()
    return Proc(replica_args(model, port, *flags), port, tmp / f"{name}-{port}.log").start()


def _router(tmp: Path, name: str, *flags: str) -> Proc:
    port = free_port()
    return Proc(
        ["router", "--port", str(port), "--health-interval", "0.2", *flags], port, tmp / f"{name}-{port}.log"
    ).start()


@pytest.fixture(scope="module")
def pd(tiny_llama: Path, redis_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    redis_server.flush()
    tmp = tmp_path_factory.mktemp("pd")
    tier = ("--kv-tier", redis_server.url, "--num-kv-blocks", "256", "--max-num-seqs", "16")
    procs: list[Proc] = []
    try:
        prefill = [_replica(tiny_llama, tmp, f"prefill{i}", "--role", "prefill", *tier) for i in (1, 2)]
        decode = [_replica(tiny_llama, tmp, f"decode{i}", "--role", "decode", *tier) for i in (1, 2)]
        mixed = _replica(tiny_llama, tmp, "mixed", "--num-kv-blocks", "256")
        procs += [*prefill, *decode, mixed]
        for p in procs:
            p.wait_http(180.0)
        model = ("--model", str(tiny_llama), "--pd-threshold", str(PD_THRESHOLD))
        router = _router(
            tmp,
            "router",
            *model,
            *(f for p in prefill for f in ("--prefill", p.url)),
            *(f for d in decode for f in ("--decode", d.url)),
        )
        slow = _router(
            tmp,
            "slow-router",
            *model,
            "--prefill",
            prefill[0].url,
            "--decode",
            decode[0].url,
            "--prefill-timeout",
            "0.002",
            "--max-retries",
            "0",
        )
        with_mixed = _router(
            tmp,
            "mixed-router",
            *model,
            "--prefill",
            prefill[0].url,
            "--decode",
            decode[0].url,
            "--replica",
            mixed.url,
        )
        procs += [router, slow, with_mixed]
        for r in (router, slow, with_mixed):
            r.wait_http(30.0)
        yield PDCluster(prefill, decode, mixed, router, slow, with_mixed, procs)
    finally:
        for p in reversed(procs):
            p.stop()
