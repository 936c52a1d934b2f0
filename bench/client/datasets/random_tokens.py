"""``random``: independent prompts with input/output lengths drawn around --input-len/--output-len."""

from __future__ import annotations

from bench.client.datasets.common import DatasetContext, single_prompt_body
from bench.client.types import BenchRequest, Chain

DEFAULT_NUM_PROMPTS = 200


def build(ctx: DatasetContext, count: int | None) -> list[Chain]:
    cfg = ctx.cfg
    n = count if count is not None else DEFAULT_NUM_PROMPTS + cfg.warmup
    # Draw every length first so a length never depends on the token source's behaviour.
    lens = [(ctx.draw_len(cfg.input_len), ctx.draw_len(cfg.output_len)) for _ in range(n)]
    chains: list[Chain] = []
    for in_len, out_len in lens:
        body = single_prompt_body(ctx, ctx.prompt(in_len), out_len)
        chains.append([BenchRequest(cfg.endpoint, body, input_len=in_len, output_len=out_len)])
    return chains
