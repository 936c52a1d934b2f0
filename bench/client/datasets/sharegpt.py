"""``sharegpt``: real prompts and reply lengths from a ShareGPT file (--dataset-path), the request
set behind most published serving numbers (vLLM's ``--dataset-name sharegpt``).

Rules, as vLLM's benchmark has them so the numbers compare:

* The records are shuffled with --seed, then taken in that order until --num-prompts (default
  1000, vLLM's) are found; only those are tokenized, so a 90k-record file costs what is used.
* A request is a record's first human turn; its max_tokens is the token count of the reply that
  follows (``--output-len``, when given, replaces it for every request).
* A pair is skipped when the prompt or the reply has fewer than 4 tokens (the reply is not checked
  when --output-len is given), the prompt more than --sharegpt-max-input-len (1024) or prompt +
  output more than --sharegpt-max-total-len (2048).
* Token counts come from --tokenizer (a local directory, the server's /tokenize, or words).

Where ferry differs: vLLM takes a record's first two turns whoever spoke them, ferry the first
human turn and the reply to it; a file with fewer usable pairs than asked for runs those (with a
note) instead of repeating prompts, which a prefix cache would answer from memory.

With ``--turns N`` (N > 1) each record is a session instead, as in ``multi-turn``: up to N human
turns, each sent after the previous answer with the conversation so far (the server's own answers,
not the recorded ones), its max_tokens the recorded reply's length. A session ends before its
first turn that breaks the rules above, counting the context so far (earlier prompts and
planned outputs) into the prompt.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from bench.client.datasets.common import DatasetContext, make_body, single_prompt_body
from bench.client.datasets.jsonl import DatasetFileError
from bench.client.datasets.sharegpt_file import Conversation, read_conversations
from bench.client.types import BenchRequest, Chain

DEFAULT_NUM_PROMPTS = 1000
MIN_LEN = 4


def build(ctx: DatasetContext, count: int | None) -> list[Chain]:
    cfg = ctx.cfg
    path = Path(cfg.dataset_path or "")
    conversations = read_conversations(path)
    usable = [c for c in conversations if c.pairs]
    ctx.rng.shuffle(usable)
    wanted = count if count is not None else DEFAULT_NUM_PROMPTS + cfg.warmup
    sessions = cfg.turns_given and cfg.turns > 1
    skipped: Counter[str] = Counter()
    chains: list[Chain] = []
    for conv in usable:
        if len(chains) >= wanted:
            break
        chain = _session(ctx, conv, len(chains), skipped) if sessions else _single(ctx, conv, skipped)
        if chain:
            chains.append(chain)
    if not chains:
        raise DatasetFileError(
            f"{path}: no usable prompt/reply pair among {len(conversations)} records: "
            f"{len(conversations) - len(usable)} without a human turn followed by a reply, "
            f"{skipped['short']} under {MIN_LEN} tokens, {skipped['long']} over "
            f"--sharegpt-max-input-len {cfg.sharegpt_max_input_len} or "
            f"--sharegpt-max-total-len {cfg.sharegpt_max_total_len} tokens"
        )
    if len(chains) < wanted:
        print(
            f"ferry bench: note: {path} has {len(chains)} usable pairs, fewer than the {wanted} asked "
            "for; sending those",
            file=sys.stderr,
        )
    return chains


def _lengths(ctx: DatasetContext, human: str, reply: str) -> tuple[int, int]:
    out_len = ctx.cfg.output_len if ctx.cfg.output_len_given else ctx.source.count(reply)
    return ctx.source.count(human), out_len


def _rejected(ctx: DatasetContext, context: int, in_len: int, out_len: int) -> str | None:
    """Why a pair is left out ('short' or 'long'), or None. ``context``: earlier turns' tokens."""
    cfg = ctx.cfg
    if in_len < MIN_LEN or (not cfg.output_len_given and out_len < MIN_LEN):
        return "short"
    if context + in_len > cfg.sharegpt_max_input_len:
        return "long"
    if context + in_len + out_len > cfg.sharegpt_max_total_len:
        return "long"
    return None


def _single(ctx: DatasetContext, conv: Conversation, skipped: Counter[str]) -> Chain:
    human, reply = conv.pairs[0]
    in_len, out_len = _lengths(ctx, human, reply)
    why = _rejected(ctx, 0, in_len, out_len)
    if why:
        skipped[why] += 1
        return []
    prompt: str | list[int] = human
    if ctx.cfg.token_ids:
        if not ctx.source.exact:
            raise ValueError("--token-ids needs a tokenizer (--tokenizer DIR or server), not 'words'")
        prompt = ctx.source.encode(human)
    body = single_prompt_body(ctx, prompt, out_len)
    return [BenchRequest(ctx.cfg.endpoint, body, input_len=in_len, output_len=out_len)]


def _session(ctx: DatasetContext, conv: Conversation, index: int, skipped: Counter[str]) -> Chain:
    cfg = ctx.cfg
    session_id = f"bench-{cfg.seed}-s{index:05d}"
    chain: Chain = []
    context = 0
    for turn, (human, reply) in enumerate(conv.pairs[: cfg.turns]):
        in_len, out_len = _lengths(ctx, human, reply)
        why = _rejected(ctx, context, in_len, out_len)
        if why:
            if turn == 0:
                skipped[why] += 1
            break
        body = make_body(ctx, messages=[{"role": "user", "content": human}], max_tokens=out_len)
        chain.append(
            BenchRequest(
                cfg.endpoint, body, session_id=session_id, turn=turn, input_len=in_len, output_len=out_len
            )
        )
        context += in_len + out_len
    return chain
