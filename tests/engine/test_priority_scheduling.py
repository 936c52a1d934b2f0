"""`scheduling_policy="priority"` (vLLM's --scheduling-policy priority): the queue in (priority,
arrival) order, the lowest priority preempted first, a waiting request preempting running ones of a
lower priority for slots and blocks; equal priorities behave as fcfs; through the engine, outputs
are unchanged and only the order differs."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.kv_connector import KVConnector
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Request, RequestStatus

BS = 4


def _req(rid: str, n: int, priority: int = 0) -> Request:
    first = 1000 * sum(map(ord, rid))
    req = Request(
        rid,
        list(range(first, first + n)),
        SamplingParams(max_tokens=50),
        seed=0,
        eos_token_ids=(),
        block_size=BS,
    )
    req.priority = priority
    return req


def _sched(blocks: int, seqs: int = 8, budget: int = 64, priority: bool = True) -> Scheduler:
    return Scheduler(
        SchedulerConfig(seqs, budget, 1024, priority=priority), BlockManager(blocks, BS), KVConnector()
    )


def _step(s: Scheduler) -> tuple[list[tuple[str, int]], list[str]]:
    out = s.schedule()
    s.update_after_step(out)
    for item in out.scheduled:
        if item.samples:
            item.request.append_token(7)
    return [(i.request.request_id, i.num_new_tokens) for i in out.scheduled], [
        r.request_id for r in out.preempted
    ]


def test_queue_runs_in_priority_then_arrival_order() -> None:
    s = _sched(blocks=64, seqs=2)
    for rid, prio in [("a", 5), ("b", 1), ("c", 5), ("d", -3), ("e", 1)]:
        s.add(_req(rid, 3, prio))
    assert [r.request_id for r in s.waiting] == ["d", "b", "e", "a", "c"]
    assert _step(s) == ([("d", 3), ("b", 3)], [])
    assert [r.request_id for r in s.running] == ["d", "b"]


def test_fcfs_ignores_priority() -> None:
    s = _sched(blocks=64, seqs=2, priority=False)
    for rid, prio in [("a", 5), ("b", 1), ("c", -3)]:
        s.add(_req(rid, 3, prio))
    assert _step(s) == ([("a", 3), ("b", 3)], [])


def test_a_higher_priority_arrival_takes_a_slot_from_the_lowest() -> None:
    s = _sched(blocks=64, seqs=2)
    low, mid = _req("low", 3, 9), _req("mid", 3, 4)
    s.add(low)
    s.add(mid)
    assert _step(s) == ([("mid", 3), ("low", 3)], [])
    urgent = _req("urgent", 3, 0)
    s.add(urgent)
    # low was scheduled this step before urgent was seen: it is taken out of the step again.
    assert _step(s) == ([("mid", 1), ("urgent", 3)], ["low"])
    assert low.status is RequestStatus.PREEMPTED and low.block_table == []
    assert [r.request_id for r in s.waiting] == ["low"]
    # An equal priority never preempts: fcfs among equals.
    s.add(_req("peer", 3, 4))
    assert _step(s) == ([("urgent", 1), ("mid", 1)], [])  # the running set in priority order
    assert [r.request_id for r in s.waiting] == ["peer", "low"]
    s.block_manager.check_integrity()


def test_a_higher_priority_arrival_takes_blocks_from_the_lowest() -> None:
    s = _sched(blocks=6)
    a, b = _req("a", 11, 2), _req("b", 11, 7)  # 3 blocks each: the cache is full
    s.add(a)
    s.add(b)
    assert _step(s) == ([("a", 11), ("b", 11)], [])
    c = _req("c", 7, 1)
    s.add(c)
    assert _step(s) == ([("a", 1), ("c", 7)], ["b"])
    assert [r.request_id for r in s.running] == ["c", "a"]  # kept in priority order
    s.block_manager.check_integrity()


def test_memory_pressure_preempts_the_lowest_priority_not_the_newest() -> None:
    s = _sched(blocks=6)
    a, b, c = _req("a", 8, 0), _req("b", 7, 9), _req("c", 7, 3)
    for r in (a, b, c):
        s.add(r)
    assert _step(s) == ([("a", 8), ("c", 7), ("b", 7)], [])
    # a needs a third block: b has the lowest priority (fcfs would take c, the newest).
    assert _step(s) == ([("a", 1), ("c", 1)], ["b"])
    assert list(s.waiting) == [b]


def test_engine_serves_the_urgent_request_first_with_unchanged_outputs(tiny_llama: Path) -> None:
    prompts = [[5 + i, 9, 14, 3, 22] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(tiny_llama), num_kv_blocks=64, num_threads=1, max_num_seqs=1, deterministic=True) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(
        str(tiny_llama),
        num_kv_blocks=64,
        num_threads=1,
        max_num_seqs=1,
        deterministic=True,
        scheduling_policy="priority",
    ) as llm:
        outs = llm.generate(prompts, params, priority=[3, 2, 1, 0])
        with pytest.raises(ValueError, match="priorities for"):
            llm.generate(prompts, params, priority=[0])
    assert [o.outputs[0].token_ids for o in outs] == plain
    # One sequence at a time: the last prompt (priority 0) ran first, the first ran last.
    finished = [o.metrics["first_scheduled_time"] for o in outs]
    assert finished == sorted(finished, reverse=True)


def test_priority_is_refused_under_fcfs(tiny_llama: Path) -> None:
    with LLM(str(tiny_llama), num_kv_blocks=16, num_threads=1) as llm:
        with pytest.raises(ValueError, match="needs priority scheduling"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), priority=[1])
