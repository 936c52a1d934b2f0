"""The torch attention backend's per-step plan (engine/attention/torch_backend.py): which query rows
batch together as decodes (groups of similar key counts), which chunks run as prefills, and, per
(window, chunk) pair of the layers, which cache blocks each reads and the masks of the fast path.
Built once per step by its first layer (kept on ``AttentionMetadata.backend_state``); what depends
on a window is built by the first layer with it and kept for the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.attention.base import AttentionMetadata, lowest_key
from engine.attention.torch_ops import TILE

# Chunks of at most this many tokens (decodes, and a decode's draft tokens under verification)
# attend row by row in the batched decode groups: each row sees the cache up to its own position,
# written before attention runs. Longer chunks take the per-sequence prefill path.
DECODE_ROWS_MAX = 8


@dataclass
class DecodeGroup:
    """Query rows attending like single-token decodes, of similar key counts, batched in one call."""

    rows: torch.Tensor  # token indices in the flattened batch
    seqs: list[tuple[int, int]]  # each row's (sequence's batch index, keys up to and including its own)


@dataclass
class DecodeKeys:
    """A decode group's keys under one window (and chunk), padded to the group's longest span.

    Each row's keys are gathered from the first block its window reaches, so key index ``j`` of
    a row is position ``first_key + j`` for that row's own ``first_key``.
    """

    blocks: torch.Tensor  # [Bg, nb] block ids (padded with block 0)
    visible: torch.Tensor  # [Bg, 1, 1, nb*block_size] bool: key inside the row's window
    first: torch.Tensor | None  # [Bg] index of the first key the row sees; None: 0 (no window)
    last: torch.Tensor  # [Bg] index of the last key the row sees (its own token)


@dataclass
class Prefill:
    """One sequence's chunk under one window: queries at positions ctx..ctx+qlen-1, keys from
    ``first_key`` on."""

    start: int  # first row in the flattened batch
    qlen: int
    ctx: int
    first_key: int  # position of key index 0
    blocks: torch.Tensor | None  # block ids from first_key's block; None: keys are this step's new K/V
    mask: torch.Tensor | None  # [qlen, keys] bool for the fast path; None: plain causal


@dataclass
class WindowPlan:
    """What the layers with one (window, chunk) read: each decode group's keys (same order) and the
    prefills."""

    decode_keys: list[DecodeKeys]
    prefills: list[Prefill]


@dataclass
class Plan:
    """Per-step index tensors shared by every layer. What depends on the window (and chunk) is built
    by the first layer with that pair and kept by its value for the others."""

    decode_groups: list[DecodeGroup]
    prefill_seqs: list[tuple[int, int]]  # (batch index, first row) of each multi-token chunk
    windows: dict[tuple[int | None, int | None], WindowPlan] = field(default_factory=dict)


def _split_by_length(seqs: list[int], lens: list[int]) -> list[list[int]]:
    """Sorted by length, cut where padding to the group's longest would waste the most.

    Gathering paged KV costs memory traffic per padded position, so mixed lengths padded to the
    batch maximum can double it; a few groups of similar length keep padding small while each
    group stays one batched matmul.
    """
    order = sorted(range(len(seqs)), key=lambda j: lens[j])
    groups: list[list[int]] = []
    cur: list[int] = []
    for j in order:
        # Start a new group when this sequence is much longer than the group's shortest
        # member and the group is already big enough to be worth its own kernels.
        if cur and len(cur) >= _MIN_GROUP and lens[j] > _GROUP_RATIO * lens[cur[0]]:
            groups.append(cur)
            cur = []
        cur.append(j)
    if cur:
        groups.append(cur)
    return [[seqs[j] for j in g] for g in groups]


_MIN_GROUP = 8
_GROUP_RATIO = 1.5


def step_plan(meta: AttentionMetadata, device: torch.device) -> Plan:
    """The step's decode groups and prefill chunks, built by its first layer and kept on ``meta``."""
    state = meta.backend_state
    if isinstance(state, Plan):
        return state
    dec_rows: list[tuple[int, int]] = []  # (row, its key count)
    dec_seqs: list[tuple[int, int]] = []
    prefill_seqs: list[tuple[int, int]] = []
    start = 0
    for i, qlen in enumerate(meta.query_lens_host):
        if qlen <= DECODE_ROWS_MAX:
            ctx = meta.context_lens_host[i]
            for j in range(qlen):
                dec_rows.append((start + j, ctx + j + 1))
                dec_seqs.append((i, ctx + j + 1))
        else:
            prefill_seqs.append((i, start))
        start += qlen
    groups = []
    if dec_rows:
        for members in _split_by_length(list(range(len(dec_rows))), [n for _, n in dec_rows]):
            rows = torch.tensor([dec_rows[m][0] for m in members], dtype=torch.long, device=device)
            groups.append(DecodeGroup(rows, [dec_seqs[m] for m in members]))
    plan = Plan(groups, prefill_seqs)
    meta.backend_state = plan
    return plan


def window_plan(
    plan: Plan,
    meta: AttentionMetadata,
    device: torch.device,
    window: int | None,
    chunk: int | None,
    deterministic: bool,
) -> WindowPlan:
    """What the layers with one (window, chunk) read this step."""
    bs = meta.block_size
    # Deterministic tiles must keep their absolute positions, so gathering starts at a tile
    # boundary that is also a block boundary.
    align = math.lcm(bs, TILE) if deterministic else bs

    def first_key(q_pos: int) -> int:
        """Where the keys gathered for queries from ``q_pos`` on start."""
        return lowest_key(q_pos, window, chunk) // align * align

    decode_keys = [_decode_keys(meta, g.seqs, first_key, window, chunk, device) for g in plan.decode_groups]
    prefills = [
        _prefill_plan(
            meta, i, start, first_key(meta.context_lens_host[i]), window, chunk, device, deterministic
        )
        for i, start in plan.prefill_seqs
    ]
    return WindowPlan(decode_keys, prefills)


def _decode_keys(
    meta: AttentionMetadata,
    seqs: list[tuple[int, int]],
    first_key: Callable[[int], int],
    window: int | None,
    chunk: int | None,
    device: torch.device,
) -> DecodeKeys:
    bs = meta.block_size
    lens = [n for _, n in seqs]
    fks = [first_key(n - 1) for n in lens]
    nb = max(-(-n // bs) - fk // bs for n, fk in zip(lens, fks, strict=True))
    tables = [
        meta.block_tables_host[i][fk // bs : -(-n // bs)]
        for (i, _), n, fk in zip(seqs, lens, fks, strict=True)
    ]
    table = [t + [0] * (nb - len(t)) for t in tables]
    lens_t = torch.tensor(lens, dtype=torch.long, device=device)
    fks_t = torch.tensor(fks, dtype=torch.long, device=device)
    last = lens_t - 1 - fks_t
    pos = torch.arange(nb * bs, device=device)[None, :]
    visible = pos <= last[:, None]
    first = None
    if window is not None or chunk is not None:
        lows = [lowest_key(n - 1, window, chunk) for n in lens]
        first = torch.tensor(lows, dtype=torch.long, device=device) - fks_t
        visible &= pos >= first[:, None]
    blocks = torch.tensor(table, dtype=torch.long, device=device)
    return DecodeKeys(blocks, visible[:, None, None, :], first, last)


def _prefill_plan(
    meta: AttentionMetadata,
    i: int,
    start: int,
    fk: int,
    window: int | None,
    chunk: int | None,
    device: torch.device,
    deterministic: bool,
) -> Prefill:
    qlen, ctx, n = meta.query_lens_host[i], meta.context_lens_host[i], meta.seq_lens_host[i]
    bs = meta.block_size
    blocks = None
    if ctx > 0 or deterministic:
        table = meta.block_tables_host[i][fk // bs : -(-n // bs)]
        blocks = torch.tensor(table, dtype=torch.long, device=device)
    mask = None
    limited = (window is not None and window < qlen) or (chunk is not None and chunk < n)
    if not deterministic and (ctx > 0 or limited):
        # Query i (position ctx + i) sees key j (position fk + j) for
        # ctx + i - window < fk + j <= ctx + i, within the query's chunk.
        mask = torch.ones(qlen, n - fk, dtype=torch.bool, device=device).tril_(diagonal=ctx - fk)
        if window is not None:
            mask.triu_(diagonal=ctx - fk - window + 1)
        if chunk is not None:
            q_chunk = torch.arange(ctx, n, device=device)[:, None] // chunk
            mask &= torch.arange(fk, n, device=device)[None, :] // chunk == q_chunk
    return Prefill(start, qlen, ctx, fk, blocks, mask)
