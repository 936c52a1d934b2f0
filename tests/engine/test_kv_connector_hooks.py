"""The engine's KV-connector hooks with a connector written here: block events, a synchronous load,
and an asynchronous load during which the request is parked while others keep running."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from engine import LLM, SamplingParams
from engine.kv_connector import KVConnector
from kvcache.keys import block_hashes

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BS = 16


class CopyConnector(KVConnector):
    """'Loads' blocks by copying them out of another engine that already computed the prompt."""

    def __init__(self, source: LLM) -> None:
        src = source.engine
        self.src_caches = src.model_runner.kv_caches
        self.src_blocks = {
            b.block_hash: b.block_id for b in src.block_manager.blocks if b.block_hash is not None
        }
        self.dst_caches = None
        self.finished: list[str] = []

    def num_loadable_blocks(self, request, block_hashes) -> int:  # noqa: ANN001
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self.src_blocks:
            n += 1
        return n

    def load_blocks(self, request, block_ids, block_hashes) -> int:  # noqa: ANN001
        for bid, h in zip(block_ids, block_hashes, strict=True):
            for (sk, sv), (dk, dv) in zip(self.src_caches, self.dst_caches, strict=True):
                dk[bid].copy_(sk[self.src_blocks[h]])
                dv[bid].copy_(sv[self.src_blocks[h]])
        return len(block_ids)

    def request_finished(self, request) -> None:  # noqa: ANN001
        self.finished.append(request.request_id)
        request.kv_transfer_result = {"seen_by": "CopyConnector"}


class AsyncCopyConnector(CopyConnector):
    """Same, on a thread that waits for ``release`` first (so the test sees the request parked)."""

    def __init__(self, source: LLM) -> None:
        super().__init__(source)
        self.release = threading.Event()

    def load_blocks_async(self, request, block_ids, block_hashes) -> Future:  # noqa: ANN001
        fut: Future = Future()

        def run() -> None:
            self.release.wait(60)
            fut.set_result(self.load_blocks(request, block_ids, block_hashes))

        threading.Thread(target=run, daemon=True).start()
        return fut


@pytest.fixture(scope="module")
def source(tiny_llama, prompts) -> tuple[LLM, list[int]]:
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    out = llm.generate(prompts[-1], GREEDY)[0]  # 200 prompt tokens: 12 full blocks registered
    return llm, out.outputs[0].token_ids


def _attach(llm: LLM, conn: CopyConnector) -> None:
    conn.dst_caches = llm.engine.model_runner.kv_caches
    llm.engine.connector = conn
    llm.engine.scheduler.connector = conn
    llm.engine.scheduler._load_async = getattr(conn, "load_blocks_async", None)


class Events:
    def __init__(self) -> None:
        self.stored: list[bytes] = []
        self.removed: list[bytes] = []

    def block_stored(self, block_id, block_hash, parent_hash, token_ids) -> None:  # noqa: ANN001
        self.stored.append(block_hash)

    def block_removed(self, block_id, block_hash) -> None:  # noqa: ANN001
        self.removed.append(block_hash)


def test_block_events_follow_the_chain(tiny_llama, prompts) -> None:
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    ev = Events()
    llm.engine.block_manager.add_listener(ev)
    prompt = prompts[-1]
    out = llm.generate(prompt, GREEDY)[0].outputs[0]
    all_tokens = prompt + out.token_ids[:-1]  # the last sampled token never gets KV
    assert ev.stored == block_hashes(all_tokens, BS)
    assert ev.removed == []
    llm.engine.block_manager.reset_prefix_cache()
    assert sorted(ev.removed) == sorted(ev.stored)


def test_synchronous_load_serves_the_prefix(tiny_llama, prompts, source) -> None:
    src, ref = source
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    conn = CopyConnector(src)
    _attach(llm, conn)
    out = llm.generate(prompts[-1], GREEDY)[0]
    assert out.outputs[0].token_ids == ref
    assert out.num_cached_tokens == (199 // BS) * BS == 192
    assert llm.engine.stats().prefix_cache_hits == 192
    assert conn.finished == [out.request_id]
    llm.engine.block_manager.check_integrity()


def test_async_load_parks_the_request_while_others_run(tiny_llama, prompts, source) -> None:
    src, ref = source
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    conn = AsyncCopyConnector(src)
    _attach(llm, conn)
    engine = llm.engine
    parked = engine.make_request("parked", prompts[-1], GREEDY, kv_transfer={"role": "consumer"})
    other = engine.make_request("other", prompts[3], GREEDY)
    engine.add_request(parked)
    engine.add_request(other)
    done: dict[str, object] = {}
    for _ in range(9):  # the other request finishes while the load is held back
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert "other" in done and "parked" not in done
    assert parked.status.value == "loading" and engine.stats().num_waiting == 1
    conn.release.set()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    final = engine.post.final(parked)
    assert final.outputs[0].token_ids == ref
    assert final.num_cached_tokens == 192
    assert done["parked"].kv_transfer["seen_by"] == "CopyConnector"
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_integrity()


def test_abort_while_parked_frees_blocks_after_the_load(tiny_llama, prompts, source) -> None:
    src, _ = source
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    conn = AsyncCopyConnector(src)
    _attach(llm, conn)
    engine = llm.engine
    engine.add_request(engine.make_request("a", prompts[-1], GREEDY))
    engine.step()
    assert engine.block_manager.num_used_blocks == 12  # allocated for the load
    assert engine.abort_request("a").outputs[0].finish_reason == "abort"
    assert engine.block_manager.num_used_blocks == 12  # the loader may still be writing them
    conn.release.set()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_integrity()
