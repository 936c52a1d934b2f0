"""``shared-prefix``: G groups x M prompts; every prompt of a group starts with the group's
--prefix-len-token prefix and ends with its own --input-len-token suffix. The measured prompts are
shuffled (seeded) so groups interleave in time, as they do when many users share system prompts."""

from __future__ import annotations

from bench.client.datasets.common import DatasetContext, single_prompt_body
from bench.client.types import BenchRequest, Chain


def build(ctx: DatasetContext, count: int | None) -> list[Chain]:
    cfg = ctx.cfg
    groups = cfg.num_groups
    total = count if count is not None else groups * cfg.prompts_per_group + cfg.warmup
    prefixes = [ctx.prompt(cfg.prefix_len) for _ in range(groups)]
    order = [i % groups for i in range(total)]
    # Warm-up requests come first (one per group in turn); the measured ones are shuffled.
    measured = order[cfg.warmup :]
    ctx.rng.shuffle(measured)
    order = order[: cfg.warmup] + measured
    chains: list[Chain] = []
    for g in order:
        suffix_len, out_len = ctx.draw_len(cfg.input_len), ctx.draw_len(cfg.output_len)
        prefix = prefixes[g]
        suffix = ctx.prompt(suffix_len)
        prompt = prefix + suffix  # str + str or list + list, as --token-ids says
        body = single_prompt_body(ctx, prompt, out_len)
        chains.append(
            [BenchRequest(cfg.endpoint, body, input_len=cfg.prefix_len + suffix_len, output_len=out_len)]
        )
    return chains
