"""Speculative decoding, as vLLM's ``speculative_config``: n-gram ("prompt lookup"), a draft model,
or the target's own multi-token-prediction layer.

After a request samples a token, a proposer drafts up to ``num_speculative_tokens`` tokens. The
n-gram proposer (``{"method": "ngram"}``) looks for the latest earlier occurrence of its last n
tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) in its own prompt and output,
and proposes the tokens that followed it. The draft model (``{"model": "/path"}``, method
``draft_model``; engine/draft_model.py) is a smaller model with the target's vocabulary that
proposes its greedy continuation, one token per forward pass. ``{"method": "mtp"}`` (vLLM's
``deepseek_mtp``, the older name, is accepted too; engine/mtp.py) drafts with the checkpoint's
DeepSeek-V3 multi-token-prediction layer, fed the target's hidden states. The next step computes
the request's last token and the drafts in one chunk, and samples a token at every one of those
positions, each under the history the drafts before it imply.

Verification draws each position's token exactly as decoding one token at a time would: from
``(seed, position)`` and the logits given the tokens before it (``engine/sampler.py``). The first
position whose draw differs from its draft ends the accepted run, and that draw is the step's
last token. So every token a request outputs is the one it would have output without drafts (greedy
or seeded, in deterministic mode bit for bit): speculation changes how many forward passes a
sequence takes, never what it says. A draft token is accepted with the probability the model gives
it, the acceptance rule of speculative sampling for a draft that is certain of its proposal.

Requests under structured outputs (whose grammar would have to walk the drafts) and embedding
requests are not drafted for; they run beside drafted ones.

This module is torch-free: the engine config parses the setting with it.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "mtp")
# vLLM's method names for a DeepSeek-V3-style MTP layer: the older one means the same.
_MTP_NAMES = ("mtp", "deepseek_mtp")
# Other methods vLLM knows, refused by name (they need heads or layers ferry does not load).
_MODEL_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "suffix")
_NGRAM_FIELDS = ("prompt_lookup_max", "prompt_lookup_min")
_DRAFT_FIELDS = ("model", "draft_tensor_parallel_size", "quantization", "max_model_len")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    # draft_model: the draft checkpoint's directory (or hub id), the quantization its weights must
    # have (as --quantization), and the longest sequence it drafts for (None: its own limit).
    model: str | None = None
    quantization: str | None = None
    max_model_len: int | None = None

    @classmethod
    def parse(cls, spec: Any) -> SpeculativeConfig | None:
        """vLLM's ``speculative_config``: a dict or its JSON text (None: no speculation). Raises
        ValueError naming what is wrong. ``model`` given without ``method``: ``draft_model``. Only
        one of ``prompt_lookup_max``/``_min`` given: the other takes its value (as vLLM)."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(spec, dict):
            raise ValueError("speculative_config must be a JSON object")
        known = {"method", "num_speculative_tokens", *_NGRAM_FIELDS, *_DRAFT_FIELDS}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        method = spec.get("method", "draft_model" if spec.get("model") is not None else "ngram")
        if method in _MODEL_METHODS:
            raise ValueError(
                f"speculative_config method {method!r} is not supported (ferry drafts with: ngram, "
                "draft_model, mtp)"
            )
        if method in _MTP_NAMES:
            method = "mtp"
        if method not in METHODS:
            raise ValueError(
                f"speculative_config method must be 'ngram', 'draft_model' or 'mtp', got {method!r}"
            )
        if method == "draft_model":
            return cls._parse_draft(spec)
        extra = [name for name in _DRAFT_FIELDS if spec.get(name) is not None]
        if extra:
            raise ValueError(f"speculative_config {', '.join(extra)}: only for method 'draft_model'")
        if method == "mtp":
            extra = [name for name in _NGRAM_FIELDS if spec.get(name) is not None]
            if extra:
                raise ValueError(f"speculative_config {', '.join(extra)}: only for method 'ngram'")
        values = {}
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = spec.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
            values[name] = value
        if values["num_speculative_tokens"] is None:
            raise ValueError("speculative_config needs num_speculative_tokens")
        if method == "mtp":
            return cls("mtp", values["num_speculative_tokens"])
        high, low = values["prompt_lookup_max"], values["prompt_lookup_min"]
        if high is None and low is None:
            high = low = cls.prompt_lookup_max
        high, low = high or low, low or high
        if low > high:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({low}) exceeds prompt_lookup_max ({high})"
            )
        return cls(method, values["num_speculative_tokens"], high, low)

    @classmethod
    def _parse_draft(cls, spec: dict[str, Any]) -> SpeculativeConfig:
        extra = [name for name in _NGRAM_FIELDS if spec.get(name) is not None]
        if extra:
            raise ValueError(f"speculative_config {', '.join(extra)}: only for method 'ngram'")
        model = spec.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config method 'draft_model' needs model (the draft's path)")
        for name in ("num_speculative_tokens", "max_model_len"):
            value = spec.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
        if spec.get("num_speculative_tokens") is None:
            raise ValueError("speculative_config needs num_speculative_tokens")
        tp = spec.get("draft_tensor_parallel_size")
        if tp is not None and (isinstance(tp, bool) or tp != 1):
            raise ValueError(
                f"speculative_config draft_tensor_parallel_size must be 1 (ferry runs one device), got {tp!r}"
            )
        quantization = spec.get("quantization")
        if quantization is not None:
            from engine.config import QUANTIZATION_METHODS

            if quantization not in QUANTIZATION_METHODS:
                raise ValueError(
                    f"speculative_config quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                    f"got {quantization!r}"
                )
        return cls(
            "draft_model",
            spec["num_speculative_tokens"],
            model=model,
            quantization=quantization,
            max_model_len=spec.get("max_model_len"),
        )


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, tokens: array, limit: int) -> list[int]:
        """Up to ``min(limit, num_speculative_tokens)`` tokens that followed the latest earlier
        occurrence of the longest suffix of ``tokens`` (int32) between ``prompt_lookup_min`` and
        ``prompt_lookup_max`` long; [] when none occurs."""
        cfg = self.config
        k = min(limit, cfg.num_speculative_tokens)
        size = len(tokens)
        if k <= 0 or size < 2:
            return []
        data = tokens.tobytes()
        width = tokens.itemsize
        for n in range(min(cfg.prompt_lookup_max, size - 1), cfg.prompt_lookup_min - 1, -1):
            suffix = data[-n * width :]
            end = (size - 1) * width  # an occurrence must end before the last token: something follows
            while True:
                at = data.rfind(suffix, 0, end)
                if at < 0:
                    break
                if at % width == 0:
                    start = at // width + n
                    return tokens[start : start + k].tolist()
                end = at + len(suffix) - 1  # a match across token boundaries: look further left
        return []
