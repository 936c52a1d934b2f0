"""Admission's arithmetic (``--max-queued-requests``), one rule for every process that applies it.

The limit counts *sequences*, not HTTP requests: a completion of 3 prompts with ``n=2`` is 6
engine sequences, and admitting it must not take the queue past the limit. A sequence is queued
when it cannot run now: beyond the engine's batch slots (``--max-num-seqs``), or held back by KV
memory (the engine's own waiting queue); while the engine sleeps (sleep mode) every sequence waits,
as it holds them all. A generation request is refused (429) when the queue is full already or when
its sequences would take it past the limit; one larger than the server ever queues (more sequences
than slots + limit: a batch of many prompts) is admitted onto an empty queue only, so the bound is
passed by at most one request, which runs alone. A limit of 0 refuses every generation request (an
empty queue is full already), as before sequences were counted.

Pooling requests (embeddings, classify, score, rerank) keep the per-request rule: admitted while
the queue is under the limit, however many inputs they carry. Their sequences take one forward
pass each, and OpenAI's embeddings API takes up to 2048 inputs in one request: refusing such a
batch outright would break clients that vLLM serves.

``Generation.admit`` applies the rule in each API server process. With ``--api-server-count N``
the engine process applies it again, to the sequences of every API server, when a request's
first sequence reaches it (``EngineHost``): that check is the one that holds, since two API
servers' own views can both admit at once. Both refuse with ``overload_message``'s words.

A beam search (``server/beam_search.py``) of width w is w sequences per prompt, as ``n=w`` is,
though the engine sees it as steps of one-token requests (one per live beam, none between
steps): its request *leases* its places (``Admission.lease``) from its first step to its end, and
its steps run inside the lease, neither checked nor counted again.

This module must not import torch: every API server process imports it.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class BeamStep(NamedTuple):
    """Which beam search a leased step belongs to, and what its API server would count of that
    search if it ended now: one prompt's search (``prompt_index`` of the request), of ``choices``
    answers, its prompt's length, and the steps it had finished when it sent this one (every live
    beam had that many tokens). The engine process counts it if its API server dies
    (``server/orphan_counts.py``)."""

    prompt_index: int
    choices: int
    prompt_tokens: int
    steps: int


class Admission(NamedTuple):
    """What an engine request tells the engine process that admits it: the HTTP request it is
    one sequence of (``key``, per API server), that request's number of sequences, and whether it
    leases them (a beam search: its places are held until the request ends, whatever the steps;
    ``beam``: the search the step is of)."""

    key: int
    size: int
    lease: bool = False
    beam: BeamStep | None = None


class AdmissionRefused(Exception):
    """The engine process refused a request's sequences: the queue is full (a 429 for the client)."""


def running_slots(max_num_seqs: int, stats: Any) -> int:
    """The batch slots that run sequences now (``stats``: the engine's ``EngineStats``): none while
    it sleeps or is paused, which holds every new request until it wakes or resumes (their count
    lags in ``num_waiting``)."""
    return 0 if getattr(stats, "sleep_level", 0) or getattr(stats, "paused", False) else max_num_seqs


def queued_after(in_flight: int, slots: int, num_waiting: int, adding: int = 0) -> int:
    """Sequences queued once ``adding`` more are in flight (``in_flight``: every sequence admitted
    and not finished, the engine's or on its way there; ``slots``: ``running_slots``). While KV
    memory holds sequences back (``num_waiting`` > 0) new ones wait behind them whatever slots are
    free."""
    memory_bound = num_waiting + adding if num_waiting > 0 else 0
    return max(0, in_flight + adding - slots, memory_bound)


def overload_message(
    in_flight: int, slots: int, num_waiting: int, adding: int, limit: int, pooling: bool, max_running: int
) -> str | None:
    """Why a request of ``adding`` sequences must wait for another time (None: admit it)."""
    now = queued_after(in_flight, slots, num_waiting)
    if now >= limit:
        return f"Server is overloaded: {now} sequences are waiting (limit {limit}). Retry later."
    if pooling:
        return None
    if adding > max_running + limit:
        # More than this server ever queues: admitted onto an empty queue (refusing it for good
        # would break one-request batches, which vLLM serves whatever their size).
        if now == 0:
            return None
        return (
            f"Server is overloaded: this request's {adding} sequences (prompts x n) are more than it "
            f"queues ({max_running} running, {limit} waiting), so they wait for an empty queue; "
            f"{now} sequences are waiting. Retry later."
        )
    after = queued_after(in_flight, slots, num_waiting, adding)
    if after <= limit:
        return None
    return (
        f"Server is overloaded: {now} sequences are waiting and this request's {adding} would make "
        f"{after} (limit {limit}). Retry later."
    )


class HeldPlaces:
    """One API server's requests of several sequences as the engine process admitted them (or
    not) at their first sequence: the places held for the sequences still to come, and the
    refused requests whose sequences are refused as they come; each until its sequences all came
    or its API server said the request ended (``release``)."""

    def __init__(self) -> None:
        self._held: dict[int, int] = {}  # request key -> its sequences still to come
        self._leased: dict[int, int] = {}  # request key -> its places, until it ends (beam search)
        self._refused: dict[int, int] = {}
        # Sequences admitted and on their way, plus every leased place (the engine's requests
        # that run in a lease are not counted again).
        self.num_held = 0

    def take(self, key: int) -> bool | None:
        """A sequence of request ``key`` came: True if its place was held (or leased), False if its
        request was refused, None if it is the request's first (to be checked, then ``decide``)."""
        if key in self._leased:
            return True
        if key in self._held:
            _count_down(self._held, key)
            self.num_held -= 1
            return True
        if key in self._refused:
            _count_down(self._refused, key)
            return False
        return None

    def decide(self, key: int, size: int, admitted: bool, lease: bool = False) -> None:
        """Request ``key`` of ``size`` sequences, at its first: admitted (its others' places are
        held; all of them, until it ends, for a ``lease``) or refused."""
        if lease:
            if admitted:
                self._leased[key] = size
                self.num_held += size
            else:  # its other prompts' first steps may still come: refused with it
                self._refused[key] = size
        elif size > 1:
            if admitted:
                self._held[key] = size - 1
                self.num_held += size - 1
            else:
                self._refused[key] = size - 1

    def release(self, key: int) -> int:
        """Request ``key`` ended: the number of places held for it that are free now."""
        self._refused.pop(key, None)
        unsent = self._held.pop(key, 0) + self._leased.pop(key, 0)
        self.num_held -= unsent
        return unsent


def _count_down(counts: dict[int, int], key: int) -> None:
    if counts[key] > 1:
        counts[key] -= 1
    else:
        del counts[key]
