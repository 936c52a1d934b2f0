"""Torch-free snapshots the engine hands to the server: model facts and live counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.classifier import ClassifierInfo
from engine.multimodal import ImageSpec
from engine.pooler import Matryoshka

# Upper edges of vLLM's vllm:iteration_tokens_total histogram buckets (tokens per engine step).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    model_fingerprint: str = ""
    weights_id: str = ""
    num_kv_blocks: int = 0
    # Tokens one sequence can hold in the KV cache (0: unknown): the whole cache, or the model's
    # context when every layer slides and the cache holds the blocks a window reaches.
    kv_capacity_tokens: int = 0
    hidden_size: int = 0  # the width of the model's hidden states (of its embeddings)
    pooling_type: str = "last"  # how embeddings pool the prompt (engine/pooler.py)
    # Whether (and to which sizes) embeddings may be cut by ``dimensions``; None: they may not.
    matryoshka: Matryoshka | None = None
    # Sampling values a request that leaves them unset gets, and max_tokens' cap (SamplingParams
    # field names; engine/generation_defaults.py).
    generation_defaults: dict = field(default_factory=dict)
    # A sequence-classification model's labels and activations (engine/classifier.py); None for a
    # decoder that generates (and embeds).
    classifier: ClassifierInfo | None = None
    # A vision-language model's image token and placeholder run (engine/multimodal.py); None:
    # text only.
    image: ImageSpec | None = None


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # used blocks / all blocks, 0..1
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int = 0  # of which found (device prefix cache or KV tier)
    partial_prefix_hits: int = 0  # of which copied from cached partial blocks (cumulative)
    num_preemptions: int = 0  # cumulative
    num_prefix_waits: int = 0  # cumulative admissions put off to reuse a prompt block being computed
    prompt_tokens: int = 0  # cumulative prompt tokens of finished requests
    generation_tokens: int = 0  # cumulative generated tokens
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    # Times the prefix cache was emptied (sleep, new weights, /reset_prefix_cache), cumulative: a
    # replica's /health names it, so a router forgets which prompts it believed cached there.
    prefix_cache_resets: int = 0
    # Speculative decoding (cumulative): request-steps that verified drafts, drafts, those accepted,
    # and accepted drafts by their position in the draft (vLLM's spec_decode metrics).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: tuple[int, ...] = ()
    # Tokens per engine step (vLLM's iteration_tokens_total): steps by ITERATION_TOKEN_BUCKETS
    # (non-cumulative; the last counts steps above every edge), and the tokens of all steps.
    iteration_tokens_counts: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    # LoRA adapters of the running and of the waiting requests (names, sorted; vLLM's lora_requests_info)
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    # Sleep mode (engine/sleep_mode.py): 0 awake; else the level slept at (1: weights offloaded,
    # 2: discarded), until every part is awake again (vLLM's vllm:engine_sleep_state).
    sleep_level: int = 0
    # Generation paused (vLLM's /pause, engine/async_sleep.py): new requests held until /resume.
    paused: bool = False
