"""``multi-turn``: sessions of --turns turns. Each turn adds a new --input-len-token user message;
the client sends it after the previous answer arrives, with the whole conversation so far (earlier
user turns and the server's real answers), so the context grows turn by turn. With ``--endpoint
responses`` the client sends only the new message and the previous answer's id
(``previous_response_id``): the server keeps the conversation. Every request of a session
carries the same ``X-Session-Id`` header for affinity routing."""

from __future__ import annotations

from bench.client.datasets.common import DatasetContext, make_body
from bench.client.types import BenchRequest, Chain

DEFAULT_SESSIONS = 8


def build(ctx: DatasetContext, count: int | None) -> list[Chain]:
    cfg = ctx.cfg
    sessions = count if count is not None else DEFAULT_SESSIONS + cfg.warmup
    chains: list[Chain] = []
    for s in range(sessions):
        session_id = f"bench-{cfg.seed}-s{s:05d}"
        chain: Chain = []
        for t in range(cfg.turns):
            in_len, out_len = ctx.draw_len(cfg.input_len), ctx.draw_len(cfg.output_len)
            body = make_body(
                ctx, messages=[{"role": "user", "content": ctx.text(in_len)}], max_tokens=out_len
            )
            chain.append(
                BenchRequest(
                    cfg.endpoint, body, session_id=session_id, turn=t, input_len=in_len, output_len=out_len
                )
            )
        chains.append(chain)
    return chains
