"""The bench run's configuration: parsed flags checked once and frozen."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any

SLO_KEYS = ("ttft", "tpot", "e2e")
DEFAULT_OUTPUT_LEN = 128
DEFAULT_TURNS = 4


class ConfigError(ValueError):
    """A flag value that cannot work; the message says which and why."""


@dataclass(frozen=True)
class LoadPoint:
    """One sweep point: a concurrency cap (None = unbounded) and an arrival rate (inf = all at once)."""

    concurrency: int | None
    request_rate: float

    @property
    def label(self) -> str:
        parts = []
        if self.concurrency is not None:
            parts.append(f"c={self.concurrency}")
        if not math.isinf(self.request_rate):
            parts.append(f"rate={self.request_rate:g}")
        return " ".join(parts) or "c=inf"


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str | None
    endpoint: str
    api_key: str | None
    headers: tuple[tuple[str, str], ...]
    dataset: str
    dataset_path: str | None
    num_prompts: int | None
    input_len: int
    output_len: int
    range_ratio: float
    prefix_len: int
    num_groups: int
    prompts_per_group: int
    turns: int
    tokenizer: str
    token_ids: bool
    seed: int
    max_tokens: int | None
    ignore_eos: bool
    continuous_usage_stats: bool
    temperature: float
    extra_body: tuple[tuple[str, Any], ...]
    points: tuple[LoadPoint, ...]
    burstiness: float
    warmup: int
    repeat: int
    reset_prefix_cache: bool
    timeout: float
    slo_ms: tuple[tuple[str, float], ...]
    output_dir: str | None
    label: str | None
    dry_run: bool
    progress: bool
    lora_modules: tuple[str, ...] = ()  # each chain names one of these as its model
    output_len_given: bool = False  # --output-len on the command line (sharegpt: overrides replies)
    turns_given: bool = False  # --turns on the command line (sharegpt: replay conversations)
    sharegpt_max_input_len: int = 1024
    sharegpt_max_total_len: int = 2048

    @property
    def slo(self) -> dict[str, float]:
        return dict(self.slo_ms)

    @property
    def extra(self) -> dict[str, Any]:
        return dict(self.extra_body)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        # None = not given: sharegpt then keeps each recorded reply's length and single turns.
        output_len = DEFAULT_OUTPUT_LEN if args.output_len is None else args.output_len
        turns = DEFAULT_TURNS if args.turns is None else args.turns
        sessions = args.dataset == "multi-turn" or (
            args.dataset == "sharegpt" and args.turns is not None and args.turns > 1
        )
        endpoint = args.endpoint or ("chat" if sessions else "completions")
        if sessions and endpoint not in ("chat", "responses"):
            what = "multi-turn" if args.dataset == "multi-turn" else "sharegpt --turns"
            raise ConfigError(
                f"--dataset {what} needs --endpoint chat (the client resends the conversation) or "
                "responses (each turn continues the last answer by previous_response_id)"
            )
        if args.dataset in ("jsonl", "sharegpt") and not args.dataset_path:
            raise ConfigError(f"--dataset {args.dataset} needs --dataset-path FILE")
        if args.token_ids and endpoint not in ("completions", "embeddings"):
            raise ConfigError(
                "--token-ids applies to --endpoint completions and embeddings only (chat content is text)"
            )
        if args.continuous_usage_stats and endpoint in ("responses", "embeddings"):
            raise ConfigError(
                f"--continuous-usage-stats does not apply to --endpoint {endpoint} (its usage comes "
                "with the whole answer only)"
            )
        values = {"output_len": output_len, "turns": turns}
        for name in (
            "input_len",
            "output_len",
            "prefix_len",
            "num_groups",
            "prompts_per_group",
            "turns",
            "sharegpt_max_input_len",
            "sharegpt_max_total_len",
        ):
            if values.get(name, getattr(args, name)) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if args.num_prompts is not None and args.num_prompts < 1:
            raise ConfigError("--num-prompts must be >= 1")
        if not 0.0 <= args.range_ratio < 1.0:
            raise ConfigError("--range-ratio must be in [0, 1)")
        if args.max_tokens is not None and args.max_tokens < 1:
            raise ConfigError("--max-tokens must be >= 1")
        if not (math.isfinite(args.burstiness) and args.burstiness > 0):  # inf: Infinity in the JSON
            raise ConfigError("--burstiness must be a finite number > 0")
        if args.warmup < 0 or args.repeat < 1:
            raise ConfigError("--warmup must be >= 0 and --repeat >= 1")
        if not (math.isfinite(args.timeout) and args.timeout > 0):  # nan passed every comparison
            raise ConfigError("--timeout must be a finite number > 0")
        return cls(
            base_url=args.base_url.rstrip("/"),
            model=args.model,
            endpoint=endpoint,
            api_key=args.api_key,
            headers=tuple(parse_header(h) for h in args.header),
            dataset=args.dataset,
            dataset_path=args.dataset_path,
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=output_len,
            range_ratio=args.range_ratio,
            prefix_len=args.prefix_len,
            num_groups=args.num_groups,
            prompts_per_group=args.prompts_per_group,
            turns=turns,
            tokenizer=args.tokenizer,
            token_ids=args.token_ids,
            seed=args.seed,
            max_tokens=args.max_tokens,
            ignore_eos=args.ignore_eos,
            continuous_usage_stats=args.continuous_usage_stats,
            temperature=args.temperature,
            extra_body=tuple(parse_extra_body(args.extra_body).items()),
            points=parse_points(args.concurrency, args.request_rate),
            burstiness=args.burstiness,
            warmup=args.warmup,
            repeat=args.repeat,
            reset_prefix_cache=args.reset_prefix_cache,
            timeout=args.timeout,
            slo_ms=tuple(parse_slo(args.slo).items()),
            output_dir=args.output_dir,
            label=args.label,
            dry_run=args.dry_run,
            progress=not args.no_progress,
            lora_modules=tuple(args.lora_modules),
            output_len_given=args.output_len is not None,
            turns_given=args.turns is not None,
            sharegpt_max_input_len=args.sharegpt_max_input_len,
            sharegpt_max_total_len=args.sharegpt_max_total_len,
        )


def parse_header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise ConfigError(f"--header {text!r}: expected NAME:VALUE")
    return name.strip(), value.strip()


def parse_extra_body(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--extra-body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError("--extra-body must be a JSON object")
    return value


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft=500,tpot=50`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise ConfigError(f"--slo {part!r}: expected KEY=MS with KEY one of {', '.join(SLO_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ConfigError(f"--slo {part!r}: {value!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ConfigError(f"--slo {part!r}: the target must be > 0 ms")
        out[key] = ms
    return out


def parse_points(concurrency: str | None, rate: str | None) -> tuple[LoadPoint, ...]:
    """The sweep: every concurrency with every rate (a missing one is unbounded / inf)."""
    concs: list[int | None] = [None]
    if concurrency:
        try:
            concs = [int(c) for c in concurrency.split(",")]
        except ValueError:
            raise ConfigError(f"--concurrency {concurrency!r}: expected integers like 1,4,16") from None
        if any(c < 1 for c in concs):
            raise ConfigError("--concurrency values must be >= 1")
    rates = [math.inf]
    if rate:
        try:
            rates = [float(r) for r in rate.split(",")]
        except ValueError:
            raise ConfigError(f"--request-rate {rate!r}: expected numbers like 2,8 or inf") from None
        if any(not r > 0 for r in rates):
            raise ConfigError("--request-rate values must be > 0")
    return tuple(LoadPoint(c, r) for c in concs for r in rates)
