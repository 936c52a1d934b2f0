"""``SequenceRequest``: one engine request (one prompt, one choice) as the endpoints plan it and
``Generation`` runs it, and ``block_extra``, what its KV blocks' hashes are salted with.

Its own module because every endpoint builds these, while only ``server/generation.py`` runs them:
the endpoints' planning code need not read the engine door to know what it is handed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.beam_search import BeamSearchParams
from engine.sampling_params import SamplingParams
from kvcache.keys import salt_extra


@dataclass(frozen=True)
class SequenceRequest:
    """One engine request: a prompt and the params of one choice."""

    choice_index: int
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    resume_token_ids: list[int] | None = None
    kv_transfer: Any = None
    pooling: bool = False  # an embedding: the prompt's last hidden state, nothing sampled
    lora: Any = None  # engine.lora_request.ServedLoRA: the adapter it runs with
    priority: int = 0  # lower runs first under --scheduling-policy priority
    cache_salt: str | None = None  # salts its block hashes: cache hits only among equal salts
    # use_beam_search: this choice is one of its prompt's beam_width answers (``beam_search.py``)
    beam: BeamSearchParams | None = None
    images: list[Any] | None = None  # PIL images of a vision-language model's prompt, in order
    # The prompt's input embeddings (a tensor; prompt_token_ids are its placeholders): what the
    # engine is given as the prompt instead of the ids.
    prompt_embeds: Any = None
    n: int = 1  # the choices its request asked for per prompt (its trace span's gen_ai.request.n)
    # The text the chat template rendered, kept only for a request that asked for it (vLLM's
    # ``return_prompt_text``): the answer shows it; the engine never reads it.
    prompt_text: str | None = None

    @property
    def block_extra(self) -> bytes:
        """The salt of its blocks' hashes (``kvcache.keys.lora_extra`` + ``salt_extra``)."""
        return block_extra(self.lora, self.cache_salt)


def block_extra(lora: Any, cache_salt: str | None) -> bytes:
    """What a request's block hashes are salted with: its adapter's, then its cache salt's."""
    return (lora.block_extra if lora is not None else b"") + salt_extra(cache_salt)
