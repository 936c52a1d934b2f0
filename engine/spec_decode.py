"""N-gram speculative decoding ("prompt lookup"), as vLLM's ``speculative_config={"method": "ngram"}``.

After a request samples a token, the proposer looks for the latest earlier occurrence of its last
n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) in its own prompt and output,
and proposes the up to ``num_speculative_tokens`` tokens that followed it. The next step computes
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

METHODS = ("ngram",)
# Other methods vLLM knows, refused by name (they need a draft model or heads ferry does not load).
_MODEL_METHODS = (
    "eagle",
    "eagle3",
    "medusa",
    "mlp_speculator",
    "draft_model",
    "mtp",
    "deepseek_mtp",
    "suffix",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5

    @classmethod
    def parse(cls, spec: Any) -> SpeculativeConfig | None:
        """vLLM's ``speculative_config``: a dict or its JSON text (None: no speculation). Raises
        ValueError naming what is wrong. Only one of ``prompt_lookup_max``/``_min`` given: the other
        takes its value (as vLLM)."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(spec, dict):
            raise ValueError("speculative_config must be a JSON object")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        method = spec.get("method", "ngram")
        if method in _MODEL_METHODS:
            raise ValueError(
                f"speculative_config method {method!r} is not supported (ferry drafts with: ngram)"
            )
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be 'ngram', got {method!r}")
        values = {}
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = spec.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
            values[name] = value
        if values["num_speculative_tokens"] is None:
            raise ValueError("speculative_config needs num_speculative_tokens")
        high, low = values["prompt_lookup_max"], values["prompt_lookup_min"]
        if high is None and low is None:
            high = low = cls.prompt_lookup_max
        high, low = high or low, low or high
        if low > high:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({low}) exceeds prompt_lookup_max ({high})"
            )
        return cls(method, values["num_speculative_tokens"], high, low)


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
