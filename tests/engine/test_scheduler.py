"""Scheduler unit tests (no model): token budget, chunking, decode-first order, preemption order."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.kv_connector import KVConnector
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.scheduler_output import BlockCopy
from engine.sequence import Request, RequestStatus

BS = 4


def _req(rid: str, n: int, base: int | None = None, **params) -> Request:
    """A request of ``n`` prompt tokens; requests share no prefix unless given the same ``base``."""
    first = 1000 * sum(map(ord, rid)) if base is None else base
    return Request(
        rid,
        list(range(first, first + n)),
        SamplingParams(max_tokens=50, **params),
        seed=0,
        eos_token_ids=(),
        block_size=BS,
    )


def _sched(blocks: int, seqs: int = 8, budget: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(seqs, budget, 1024), BlockManager(blocks, BS), KVConnector())


def _step(s: Scheduler) -> list[tuple[str, int]]:
    """Schedule, pretend the model ran, and append one sampled token where the step samples."""
    out = s.schedule()
    s.update_after_step(out)
    for item in out.scheduled:
        if item.samples:
            item.request.append_token(7)
    return [(item.request.request_id, item.num_new_tokens) for item in out.scheduled]


def test_budget_chunks_prefill_and_decodes_go_first() -> None:
    s = _sched(blocks=64, budget=16)
    a, b = _req("a", 10), _req("b", 30)
    s.add(a)
    s.add(b)
    assert _step(s) == [("a", 10), ("b", 6)]  # a whole, b chunked to the budget left
    assert (a.num_output_tokens, b.num_output_tokens) == (1, 0)
    assert _step(s) == [("a", 1), ("b", 15)]  # a decodes first, b fills the rest
    assert _step(s) == [("a", 1), ("b", 9)]
    assert b.num_output_tokens == 1 and b.num_computed_tokens == 30
    assert _step(s) == [("a", 1), ("b", 1)]
    s.block_manager.check_integrity()


def test_max_num_seqs_limits_admission() -> None:
    s = _sched(blocks=64, seqs=2, budget=64)
    for rid in "abc":
        s.add(_req(rid, 3))
    assert [r for r, _ in _step(s)] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_preemption_takes_the_newest_and_requeues_it_first() -> None:
    s = _sched(blocks=6, budget=64)
    a, b, c = _req("a", 8), _req("b", 7), _req("c", 7)  # 2 + 2 + 2 blocks: the cache is full
    for r in (a, b, c):
        s.add(r)
    assert _step(s) == [("a", 8), ("b", 7), ("c", 7)]
    # a now has 9 tokens and needs a third block: c (newest) is preempted, a and b continue.
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["c"]
    assert [(i.request.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 1), ("b", 1)]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.block_table == []
    assert list(s.waiting) == [c]
    assert s.num_preemptions == 1
    s.block_manager.check_integrity()


def test_oldest_request_always_progresses() -> None:
    s = _sched(blocks=5, budget=64)
    reqs = [_req(f"r{i}", 6) for i in range(4)]
    for r in reqs:
        s.add(r)
    finished: list[str] = []
    for _ in range(200):
        _step(s)
        for r in list(s.running):
            if r.num_output_tokens >= 12:
                s.finish(r, "length")
                finished.append(r.request_id)
        if not s.has_unfinished():
            break
    assert finished == ["r0", "r1", "r2", "r3"]
    assert s.block_manager.num_used_blocks == 0
    s.block_manager.check_integrity()


def test_a_prompt_block_being_computed_is_waited_for_not_recomputed() -> None:
    s = _sched(blocks=64, budget=64)
    a = _req("a", 14, base=100)  # blocks [100..103] [104..107] [108..111] + 2 tokens
    b = _req("b", 11, base=100)  # the same first 2 blocks, then its own tail
    c = _req("c", 5)  # shares nothing
    d = _req("d", 14, base=100, prompt_logprobs=1)  # needs every prompt row: never waits
    for r in (a, b, c, d):
        s.add(r)
    assert _step(s) == [("a", 14), ("c", 5), ("d", 14)]  # b waits, keeping its place
    assert [r.request_id for r in s.waiting] == ["b"] and s.num_prefix_waits == 1
    assert _step(s) == [("a", 1), ("c", 1), ("d", 1), ("b", 3)]
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    s.block_manager.check_integrity()


def test_requests_queued_together_share_what_the_first_computes() -> None:
    """n > 1 fans out into identical prompts: the first computes it, the others hit."""
    s = _sched(blocks=64, budget=12)
    reqs = [_req(f"n{i}", 17, base=500) for i in range(3)]
    for r in reqs:
        s.add(r)
    assert _step(s) == [("n0", 12)]  # chunked: the others wait for blocks n0 computes
    assert _step(s) == [("n0", 5)]  # n0's last block is still pending: they keep waiting
    assert _step(s) == [("n0", 1), ("n1", 1), ("n2", 1)]  # 16 of 17 tokens hit: one to compute
    assert [r.num_cached_tokens for r in reqs] == [0, 16, 16]
    assert reqs[1].block_table[:4] == reqs[2].block_table[:4] == reqs[0].block_table[:4]
    s.block_manager.check_integrity()


def test_no_waiting_without_prefix_caching() -> None:
    s = Scheduler(
        SchedulerConfig(8, 64, 1024), BlockManager(64, BS, enable_prefix_caching=False), KVConnector()
    )
    a, b = _req("a", 9, base=100), _req("b", 9, base=100)
    s.add(a)
    s.add(b)
    assert _step(s) == [("a", 9), ("b", 9)]
    assert s.num_prefix_waits == 0


def test_long_prefill_token_threshold_caps_each_prefill_chunk() -> None:
    s = Scheduler(
        SchedulerConfig(8, 64, 1024, long_prefill_token_threshold=8), BlockManager(64, BS), KVConnector()
    )
    a, b = _req("a", 3), _req("b", 20)
    s.add(a)
    s.add(b)
    assert _step(s) == [("a", 3), ("b", 8)]  # budget left, but b's chunk is capped
    assert _step(s) == [("a", 1), ("b", 8)]
    assert _step(s) == [("a", 1), ("b", 4)]
    assert b.num_output_tokens == 1
    assert _step(s) == [("a", 1), ("b", 1)]
    s.block_manager.check_integrity()


# -- cached partial blocks ---------------------------------------------------------------------------


def _tokens_req(rid: str, tokens: list[int], extra: bytes = b"", **params) -> Request:
    req = Request(
        rid, tokens, SamplingParams(max_tokens=50, **params), seed=0, eos_token_ids=(), block_size=BS
    )
    req.block_extra = extra
    return req


def _run_and_finish(s: Scheduler, req: Request) -> None:
    """Admit ``req`` alone, compute its prompt, sample one token and finish it."""
    s.add(req)
    _step(s)
    assert req.num_computed_tokens == req.num_prompt_tokens
    s.finish(req, "stop")


def test_a_finished_requests_partial_block_is_copied_by_an_extension() -> None:
    s = _sched(blocks=16, budget=64)
    bm = s.block_manager
    a = _req("a", 6, base=100)  # [100..103] [104 105]
    _run_and_finish(s, a)  # a computed 6 tokens; its sampled 7th has no KV
    assert a.token_ids[-1] == 7 and bm.num_partial_blocks == 1 and bm.blocks[1].token_ids == (104, 105)
    assert list(bm._cached) == [1, 0]
    b = _tokens_req("b", [*range(100, 106), 7, 8])  # extends a's tokens inside block 1
    s.add(b)
    out = s.schedule()
    # b reuses full block 0 and the 2 tokens of partial block 1, copied into its own block 2.
    assert out.copies == [BlockCopy(1, 2)] and b.block_table == [0, 2]
    assert [(i.request.request_id, i.start, i.num_new_tokens) for i in out.scheduled] == [("b", 6, 2)]
    assert b.num_computed_tokens == 6 and b.num_cached_tokens == 6
    assert bm.blocks[1].ref_count == 1 and 1 not in bm._cached  # pinned until the copy ran
    bm.check_integrity()
    s.update_after_step(out)
    assert bm.blocks[1].ref_count == 0 and list(bm._cached) == [1]  # unpinned: evictable again
    b.append_token(9)
    s.finish(b, "stop")
    # Tokens that diverge inside the block (105 -> 99) find no partial block: only the full one.
    c = _tokens_req("c", [100, 101, 102, 103, 104, 99, 7])
    s.add(c)
    out = s.schedule()
    assert out.copies == [] and c.num_computed_tokens == 4 and c.num_cached_tokens == 4
    assert s.prefix_cache_hits == 6 + 4 and s.prefix_cache_queries == 6 + 8 + 7
    s.update_after_step(out)
    bm.check_integrity()


def test_partial_blocks_are_not_shared_across_salts() -> None:
    s = _sched(blocks=16, budget=64)
    _run_and_finish(s, _tokens_req("a", [1, 2, 3], extra=b"lora\x00x\x00"))  # a first-block partial
    other = _tokens_req("b", [1, 2, 3, 4, 5], extra=b"salt\x00y")
    same = _tokens_req("c", [1, 2, 3, 4, 5], extra=b"lora\x00x\x00")
    s.add(other)
    s.add(same)
    out = s.schedule()
    assert out.copies == [BlockCopy(0, 3)]  # c's, into its first block (b took blocks 1 and 2)
    assert (other.block_table, same.block_table) == ([1, 2], [3, 4])
    assert (other.num_computed_tokens, same.num_computed_tokens) == (0, 3)
    s.update_after_step(out)
    s.block_manager.check_integrity()


def test_requests_that_compute_every_prompt_row_do_not_reuse_a_partial_block() -> None:
    s = _sched(blocks=16, budget=64)
    _run_and_finish(s, _req("a", 6, base=100))
    b = _tokens_req("b", [*range(100, 106), 7, 8], prompt_logprobs=1)
    s.add(b)
    out = s.schedule()
    assert out.copies == [] and b.num_computed_tokens == 0
    s.update_after_step(out)
    s.block_manager.check_integrity()


def test_a_preempted_request_keeps_its_partial_block_and_copies_it_back() -> None:
    s = Scheduler(SchedulerConfig(1, 64, 1024, priority=True), BlockManager(16, BS), KVConnector())
    bm = s.block_manager
    x = _req("x", 6, base=100)
    x.priority = 5
    s.add(x)
    _step(s)
    y = _req("y", 3)
    s.add(y)  # outranks x, and there is one sequence slot: x is preempted
    out = s.schedule()
    assert out.preempted == [x] and [i.request.request_id for i in out.scheduled] == ["y"]
    assert bm.num_partial_blocks == 1 and bm.blocks[1].token_ids == (104, 105)
    assert y.block_table == [2]
    s.update_after_step(out)
    y.append_token(7)
    s.finish(y, "stop")  # y's 3 tokens stay cached too
    out = s.schedule()
    assert out.copies == [BlockCopy(1, 3)] and x.block_table == [0, 3]
    assert [(i.request.request_id, i.start, i.num_new_tokens) for i in out.scheduled] == [("x", 6, 1)]
    s.update_after_step(out)
    assert bm.num_partial_blocks == 2
    bm.check_integrity()


def test_no_partial_blocks_when_every_layer_slides_or_when_turned_off() -> None:
    windowed = Scheduler(SchedulerConfig(8, 64, 1024, sliding_window=8), BlockManager(16, BS), KVConnector())
    off = Scheduler(
        SchedulerConfig(8, 64, 1024), BlockManager(16, BS, enable_partial_caching=False), KVConnector()
    )
    for s in (windowed, off):
        _run_and_finish(s, _req("a", 6, base=100))
        assert s.block_manager.num_partial_blocks == 0
        b = _tokens_req("b", [*range(100, 106), 7, 8])
        s.add(b)
        out = s.schedule()
        assert out.copies == [] and b.num_computed_tokens == 4
        s.block_manager.check_integrity()
