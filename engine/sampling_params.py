"""Per-request sampling and stopping parameters (torch-free: the server and router import it)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine.repetition import RepetitionDetectionParams, repetition_params

# vLLM's --logprobs-mode: what reported logprobs are (engine/sampler.py).
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")

# The kinds of constraint a StructuredOutputsParams can carry: exactly one per request.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# JSON nesting levels a schema may have (OpenAI allows 10 levels of objects, each two JSON levels
# deep in a schema). Compiling grows fast with depth: 500 levels measured 6 s of CPU.
MAX_SCHEMA_DEPTH = 64


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, a regex, one of some strings, an EBNF grammar or any
    JSON object (vLLM's ``structured_outputs``). Exactly one of them; ``json`` may be given as a
    schema dict and is kept as its compact JSON text, so equal schemas share a compiled grammar.

    ``disable_any_whitespace``: JSON is written compactly, with no optional whitespace (by default
    the grammar allows it, as vLLM's does).
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    # xgrammar's structural tag (vLLM's): JSON text, either ``{"type": "structural_tag", "format":
    # {...}}`` or the older ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}``:
    # free text, with a schema enforced between tags once a trigger appears.
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    # The constraint starts after this token (a reasoning model's end of thinking, as vLLM's
    # structured outputs wait for the reasoning parser); None: from the first output token.
    after_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", canonical_json(self.json))
            except RecursionError:
                raise ValueError(
                    f"structured outputs json is nested more than {MAX_SCHEMA_DEPTH} levels deep"
                ) from None
        if self.structural_tag is not None and not isinstance(self.structural_tag, str):
            object.__setattr__(self, "structural_tag", canonical_json(self.structural_tag))
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def grammar_key(self) -> StructuredOutputsParams:
        """What the compiled grammar depends on (not on where it starts)."""
        return self if self.after_token_id is None else replace(self, after_token_id=None)

    @property
    def kind(self) -> str:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of "
                + ", ".join(STRUCTURED_KINDS)
                + (f"; got {', '.join(given)}" if given else "; got none")
            )
        return given[0]

    def validate(self) -> None:
        kind = self.kind
        if kind == "choice":
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured outputs choice must be a non-empty list of strings")
        elif kind == "json":
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured outputs json is not valid JSON: {e}") from e
            except RecursionError:
                schema = None  # nested deeper than Python parses: over the limit below anyway
            if schema is not None and not isinstance(schema, (dict, bool)):
                raise ValueError("structured outputs json must be a JSON schema (an object)")
            depth = json_depth(schema) if schema is not None else MAX_SCHEMA_DEPTH + 1
            if depth > MAX_SCHEMA_DEPTH:
                raise ValueError(
                    f"structured outputs json is nested more than {MAX_SCHEMA_DEPTH} levels deep; "
                    "a grammar's cost grows with its depth"
                )
        elif kind == "structural_tag":
            try:
                tag = json.loads(self.structural_tag)
            except (json.JSONDecodeError, RecursionError) as e:
                raise ValueError(f"structured outputs structural_tag is not valid JSON: {e}") from e
            if not isinstance(tag, dict):
                raise ValueError("structured outputs structural_tag must be a JSON object")
            if json_depth(tag) > MAX_SCHEMA_DEPTH + 4:
                raise ValueError("structured outputs structural_tag is nested too deeply")


def json_depth(value: Any) -> int:
    """Nesting levels of a decoded JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        else:
            deepest = max(deepest, depth)
            continue
        deepest = max(deepest, depth + 1)
    return deepest


def canonical_json(value: Any) -> str:
    """A schema's compact JSON text: its cache key. Key order is kept, not sorted: a grammar writes
    an object's properties in the order its schema declares them."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass
class SamplingParams:
    """What to generate and when to stop. Field names follow vLLM's so users can carry code over.

    Validation of user input happens at the HTTP edge (server/protocol.py); ``validate()``
    here guards the offline API and raises ValueError with a clear message.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token (0 = only the sampled one)
    prompt_logprobs: int | None = None
    # vLLM's: report these vocab ids' logprobs at each generated position (beside the sampled token's)
    # instead of the natural top-``logprobs``; needs ``logprobs`` set.
    logprob_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's)
    # Token sequences that must not be completed: the last token of each is masked while the output
    # ends with the rest (vLLM's bad_words, tokenized by the caller).
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's bad_words as words: the engine tokenizes them (``bad_word_sequences``) into
    # bad_words_token_ids when it builds the request (engine/request_builder.py).
    bad_words: list[str] | None = None
    # What this request's logprobs are (``EngineConfig.logprobs_mode``'s values); None: the
    # engine's. Beam search pins raw log-probabilities: its scores are sums of them.
    logprobs_mode: str | None = None
    # vLLM's: at most this many tokens of thinking (after the reasoning start marker, ``<think>``)
    # before the end marker (``</think>``) is forced (engine/thinking_budget.py); -1 or None: no cap.
    thinking_token_budget: int | None = None
    # vLLM's: end the output once its tail is one N-gram repeated back to back (engine/repetition.py);
    # a dict of its fields is taken too.
    repetition_detection: RepetitionDetectionParams | None = None
    # vLLM's: a stream's outputs carry this many new tokens each (the first and the last go at once;
    # ``engine.outputs.next_output``); None or 1: each step's.
    stream_interval: int | None = None

    def __post_init__(self) -> None:
        self.repetition_detection = repetition_params(self.repetition_detection)
        if self.thinking_token_budget == -1 and not isinstance(self.thinking_token_budget, bool):
            self.thinking_token_budget = None  # vLLM's "unlimited"
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``SamplingParams.clone``)."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    def validate(self) -> None:
        if self.logprobs_mode is not None and self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}"
            )
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError("presence_penalty must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError("frequency_penalty must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be positive")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be non-negative")
        if self.logprob_token_ids is not None:
            if not self.logprob_token_ids:
                raise ValueError("logprob_token_ids must not be empty")
            if self.logprobs is None:
                raise ValueError("logprob_token_ids needs logprobs (0 or more)")
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.logprob_token_ids):
                raise ValueError("logprob_token_ids must be non-negative token ids")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError("prompt_logprobs must be non-negative")
        if self.structured_outputs is not None:
            # Exactly one constraint; its content is checked once, where it is compiled (a cache
            # hit is not parsed again on every request).
            _ = self.structured_outputs.kind
        budget = self.thinking_token_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(
                f"thinking_token_budget must be a non-negative integer or -1 for unlimited, got {budget!r}"
            )
        if self.repetition_detection is not None:
            self.repetition_detection.validate()
        interval = self.stream_interval
        if interval is not None and (
            isinstance(interval, bool) or not isinstance(interval, int) or interval < 1
        ):
            raise ValueError(f"stream_interval must be a positive integer, got {interval!r}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if self.bad_words_token_ids is not None and any(not seq for seq in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must not hold an empty sequence")
        if self.allowed_token_ids and self.bad_words_token_ids:
            banned = {seq[0] for seq in self.bad_words_token_ids if len(seq) == 1}
            if set(self.allowed_token_ids) <= banned:
                raise ValueError("every token in allowed_token_ids is a bad word: nothing could be generated")


def bad_word_sequences(words: Sequence[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each bad word's token ids alone and after a space (a word inside text is usually tokenized
    with its leading space), as vLLM derives them; ``encode`` adds no special tokens. Deduplicated
    through a dict (ordered): a list's ``in`` made a request with many bad words quadratic, minutes of
    the event loop for one request of 50k words."""
    seqs: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = encode(text)
            if ids:
                seqs[tuple(ids)] = None
    return [list(ids) for ids in seqs]
