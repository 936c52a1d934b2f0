"""What every dataset shares: the build context, length draws, and OpenAI body construction."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.client.config import BenchConfig
from bench.client.tokens import TokenSource


@dataclass
class DatasetContext:
    cfg: BenchConfig
    model: str
    token_source_factory: Callable[[], TokenSource]
    rng: random.Random = field(init=False)
    _source: TokenSource | None = field(default=None, init=False)
    _pool: list[int] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.cfg.seed)

    @property
    def source(self) -> TokenSource:
        """The token source, made on first use (jsonl never needs one)."""
        if self._source is None:
            self._source = self.token_source_factory()
        return self._source

    def source_description(self) -> dict[str, Any] | None:
        """What built the prompts (None when no token source was needed, e.g. jsonl)."""
        return self._source.describe() if self._source is not None else None

    @property
    def pool(self) -> list[int]:
        if self._pool is None:
            self._pool = self.source.pool()
        return self._pool

    def draw_len(self, mean: int) -> int:
        """A length uniform in [mean*(1-r), mean*(1+r)], at least 1."""
        r = self.cfg.range_ratio
        lo, hi = max(1, int(mean * (1 - r))), max(1, int(mean * (1 + r)))
        return self.rng.randint(lo, hi)

    def prompt(self, n: int) -> str | list[int]:
        """A prompt of ``n`` tokens: an id list with --token-ids, else text."""
        if self.cfg.token_ids:
            if not self.source.exact:
                raise ValueError("--token-ids needs a tokenizer (--tokenizer DIR or server), not 'words'")
            return self.source.sample_ids(self.rng, self.pool, n)
        return self.source.text_of_length(self.rng, self.pool, n)

    def text(self, n: int) -> str:
        return self.source.text_of_length(self.rng, self.pool, n)


def apply_request_options(
    cfg: BenchConfig, body: dict[str, Any], model: str, endpoint: str
) -> dict[str, Any]:
    """Make ``body`` a streamed request as the flags say: model (if absent or --model given),
    max_tokens override, ignore_eos, streaming with usage (per chunk with
    --continuous-usage-stats), --extra-body on top."""
    out = dict(body)
    if cfg.model is not None or "model" not in out:
        out["model"] = model
    if endpoint == "embeddings":  # one answer, nothing generated: no streaming or sampling fields
        for key in (
            "stream",
            "stream_options",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "ignore_eos",
        ):
            out.pop(key, None)
        out.update(cfg.extra)
        return out
    if cfg.max_tokens is not None:
        out.pop("max_completion_tokens", None)
        out["max_tokens"] = cfg.max_tokens
    if cfg.ignore_eos:
        out["ignore_eos"] = True
    out["stream"] = True
    options = dict(out.get("stream_options") or {})
    options["include_usage"] = True
    if cfg.continuous_usage_stats:
        options["continuous_usage_stats"] = True
    out["stream_options"] = options
    if endpoint == "responses":
        out = as_responses_body(out)
    out.update(cfg.extra)
    return out


def as_responses_body(body: dict[str, Any]) -> dict[str, Any]:
    """A chat-shaped body as the Responses API takes it: ``messages`` as ``input``, the token
    limit as ``max_output_tokens``; no ``stream_options`` (usage comes with the last event)."""
    out = dict(body)
    if "messages" in out:
        out["input"] = out.pop("messages")
    limit = out.pop("max_tokens", None) or out.pop("max_completion_tokens", None)
    out.pop("max_completion_tokens", None)
    if limit is not None:
        out["max_output_tokens"] = limit
    out.pop("stream_options", None)
    return out


def make_body(
    ctx: DatasetContext,
    *,
    prompt: str | list[int] | None = None,
    messages: list[dict[str, Any]] | None = None,
    max_tokens: int,
) -> dict[str, Any]:
    cfg = ctx.cfg
    body: dict[str, Any] = {"model": ctx.model}
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    body["max_tokens"] = max_tokens
    body["temperature"] = cfg.temperature
    return apply_request_options(cfg, body, ctx.model, cfg.endpoint)


def single_prompt_body(
    ctx: DatasetContext, prompt_len_text: str | list[int], max_tokens: int
) -> dict[str, Any]:
    """A one-message chat (or Responses) body, a completions body or an embeddings one, as
    --endpoint says."""
    if ctx.cfg.endpoint == "embeddings":
        return apply_request_options(
            ctx.cfg, {"model": ctx.model, "input": prompt_len_text}, ctx.model, "embeddings"
        )
    if ctx.cfg.endpoint in ("chat", "responses"):
        return make_body(ctx, messages=[{"role": "user", "content": prompt_len_text}], max_tokens=max_tokens)
    return make_body(ctx, prompt=prompt_len_text, max_tokens=max_tokens)
