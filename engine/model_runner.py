"""Loads the model, owns the paged KV cache, and runs one flattened forward per engine step.

A step's scheduled requests are laid out back to back in one token dimension (a decode adds one
token, a prefill chunk many), so one forward serves the whole mixed batch. Logits are computed
only for the rows that sample (each request's last scheduled token when it reaches the end of its
known tokens) and, when a request asks for prompt logprobs, for its prompt rows.

Loading, sleeping, waking and replacing the weights, and allocating and releasing the KV cache,
are ``RunnerWeights`` (``engine/runner_weights.py``), which ``ModelRunner`` inherits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.attention import AttentionMetadata, get_attention_backend, resolve_backend_name
from engine.classifier import ClassifierInfo, is_classifier
from engine.config import EngineConfig
from engine.draft_model import DraftModel, PagedDraft
from engine.kv_budget import CPU_DEFAULT_BYTES, cuda_kv_bytes
from engine.lora import DeviceAdapters
from engine.models.config import ModelConfig, read_hf_config
from engine.models.kv_scales import KVScales, scales_digest
from engine.models.loader import resolve_dtype, weights_id
from engine.models.registry import get_model_class
from engine.mtp import MTPProposer
from engine.ops import select_ops
from engine.runner_parts import (
    Segment,
    build_batch,
    kv_block_bytes,
    position_limit,
    read_weights,
)
from engine.runner_weights import RunnerWeights
from engine.scheduler_output import BlockCopy, ScheduledRequest, SchedulerOutput
from engine.sequence import Request
from engine.weight_update import weight_signature
from kvcache.keys import model_fingerprint

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_RAW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's (``auto``) or an fp8 format."""
    return model_dtype if name == "auto" else _KV_DTYPES[name]


@dataclass
class PromptLogits:
    """One request's prompt rows this step (row j predicts prompt token ``first + j``), whose
    vocabulary-wide logits ``chunks`` makes a bounded number of rows at a time, so a long
    prompt's never hold more device memory at once than the activation reserve counts."""

    scheduled: ScheduledRequest
    first: int
    hidden: torch.Tensor  # [rows, hidden]: the model's output at those positions
    compute_logits: Callable[[torch.Tensor], torch.Tensor]

    def chunks(self, rows: int) -> Iterator[torch.Tensor]:
        """fp32 logits ``[<= rows, vocab]``, chunk after chunk, in row order."""
        for lo in range(0, self.hidden.shape[0], rows):
            yield self.compute_logits(self.hidden[lo : lo + rows])


@dataclass
class ModelOutput:
    # fp32 [num sampling rows, vocab], order of ``sampling``: 1 + num_spec rows per request
    sample_logits: torch.Tensor
    sampling: list[ScheduledRequest]
    prompt_logits: list[PromptLogits] = field(default_factory=list)
    # Pooling requests whose prompt ended this step, and their pooled hidden states (fp32 [n, hidden]),
    # or a classifier's logits over them (fp32 [n, num_labels]).
    pooled: list[ScheduledRequest] = field(default_factory=list)
    pooled_hidden: torch.Tensor | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner(RunnerWeights):
    def __init__(self, config: EngineConfig, model_dir: Path, model_config: ModelConfig) -> None:
        self.config = config
        self.pooling_type = "last"  # set by the engine once resolved (engine/pooler.py)
        self.model_config = cfg = model_config
        self.device = resolve_device(config.device)
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(config.dtype, cfg.checkpoint_dtype, self.device)
        # Sliding-window layers attend within their window (the attention backends mask and skip
        # the rest), so the whole trained context is served. When every layer slides, the scheduler
        # gives back the blocks behind the window (their table slots then read as block 0).
        limit, source = position_limit(cfg)
        if config.max_model_len is not None and config.max_model_len > limit:
            # Positions past the trained ones give garbage, not an error: refuse, as vLLM does.
            raise ValueError(
                f"max_model_len={config.max_model_len} is more than the {limit} positions of the model "
                f"({source})"
            )
        self.max_model_len = config.max_model_len or limit
        self.block_size = config.block_size
        dummy = config.load_format == "dummy"
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.attention_backend = resolve_backend_name(config.attention_backend, self.device.type)
        attention = get_attention_backend(
            self.attention_backend, self.device.type, deterministic=config.deterministic
        )
        self._model_cls = get_model_class(cfg.architecture)
        self._ops = select_ops(self.attention_backend)
        self._attention = attention
        self.model_dir = model_dir  # the checkpoint the weights came from (a weight update changes it)
        weights = read_weights(model_dir, cfg, self.dtype, self.device, config.hf_overrides, dummy)
        # After the load: the tensor samples it reads are in the page cache by now.
        self.weights_id = weights_id(model_dir, config.hf_overrides, dummy)
        # What a weight update must match (engine/weight_update.py).
        self.weight_signature = weight_signature(weights)
        # A classifier's ``score`` head [num_labels, hidden], kept fp32 (vLLM's default head dtype):
        # its pooling requests end with the head's logits instead of the hidden state.
        self.score_head: torch.Tensor | None = None
        self.classifier: ClassifierInfo | None = None
        if is_classifier(cfg.architecture):
            head = weights.get("score.weight")
            if head is None:
                raise ValueError(
                    f"{cfg.architecture} checkpoint has no score.weight (its classification head)"
                )
            self.classifier = ClassifierInfo.from_config(
                read_hf_config(model_dir, config.hf_overrides), head.shape[0]
            )
        self.model: Any = None
        self.kv_scales: KVScales | None = None  # the fp8 cache's per-layer scales (install_weights)
        self.draft: PagedDraft | None = None  # loaded below, once the target is
        self.install_weights(weights)
        self.model_fingerprint = self._fingerprint()  # covers the KV scales the weights brought
        self.vocab_size = int(self.model.lm_head.shape[0])
        self.takes_images = hasattr(self.model, "encode_image")
        if config.enable_prompt_embeds and not hasattr(self.model, "embed_tokens"):
            raise ValueError(f"prompt embeddings are not supported for {cfg.architecture} models")
        # Whether a step may replace token embeddings (images, prompt embeddings): decided once here.
        self.replaces_embeddings = self.takes_images or config.enable_prompt_embeds
        self.lora_adapters = DeviceAdapters(self.device, config.max_loras) if config.enable_lora else None
        # A draft model (engine/draft_model.py) or the MTP layer (engine/mtp.py) is loaded before the
        # block count is decided: its weights are resident then, and its KV takes a share of every
        # block's bytes.
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            self.draft = DraftModel(self, spec, attention)
        elif spec is not None and spec.method == "mtp":
            self.draft = MTPProposer(self, attention)
        self.num_kv_blocks = self._num_kv_blocks()
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        self.allocate_kv_cache()

    def _fingerprint(self) -> str:
        cfg = self.model_config
        # Blocks of an fp8 cache are other bytes than the model dtype's: never shared with them; nor
        # are those written with the checkpoint's KV scales (without scales, the name is as before).
        kv_name = "" if self.kv_dtype == self.dtype else f"+kv:{str(self.kv_dtype).removeprefix('torch.')}"
        if self.kv_scales is not None:
            kv_name += f"+scales:{scales_digest(self.kv_scales)}"
        # Deterministic mode's batch-invariant projections write other K/V bits than the default
        # linears (whose rows also vary with the batch): a deterministic engine that loaded those
        # would continue from KV it never computes itself.
        if self.config.deterministic:
            kv_name += "+batch_invariant"
        return model_fingerprint(
            weights_id=self.weights_id,
            dtype=_DTYPE_NAMES[self.dtype] + kv_name,
            block_size=self.block_size,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.kv_cache_heads,
            head_dim=cfg.kv_cache_dim,
            kv_layout=cfg.kv_layout,
        )

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of the target model's KV (what the KV tier moves)."""
        return kv_block_bytes(self.model_config, self.block_size, self.kv_dtype)

    @property
    def kv_bytes_per_block(self) -> int:
        """Device bytes one block id takes: the target's KV and the draft model's."""
        draft = self.draft.bytes_per_block if self.draft is not None else 0
        return self.bytes_per_block + draft

    def _kv_cache_bytes(self) -> int:
        """``kv_cache_memory_bytes``, or on CUDA what ``gpu_memory_utilization`` leaves now that the
        weights are loaded (engine/kv_budget.py), or the CPU default."""
        config = self.config
        if config.kv_cache_memory_bytes is not None:
            return config.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return CPU_DEFAULT_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        budget, reserve = cuda_kv_bytes(config, self.model_config, self.kv_bytes_per_block, free, total)
        logger.info(
            "KV cache: %.2f GiB (gpu_memory_utilization %.2f of %.1f GiB; %.2f GiB in use after loading, "
            "%.2f GiB reserved for activations)",
            budget / 2**30, config.gpu_memory_utilization, total / 2**30, (total - free) / 2**30, reserve / 2**30,
        )  # fmt: skip
        return budget

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        kv_bytes = self._kv_cache_bytes()
        by_memory = kv_bytes // self.kv_bytes_per_block
        # More than every sequence slot filled to max_model_len is never used at once; the rest
        # would only lengthen prefix-cache retention, at a real memory cost.
        ceiling = self.config.max_num_seqs * -(-self.max_model_len // self.block_size) * 2
        n = min(by_memory, ceiling)
        if n < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={kv_bytes} is less than one KV block ({self.kv_bytes_per_block} bytes)"
            )
        return n

    # -- one step ------------------------------------------------------------------------------------

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        segments: list[Segment] = []
        for s in out.scheduled:
            req, start, n = s.request, s.start, s.num_new_tokens
            if s.num_spec:
                ids = req.token_ids[start:] + req.spec_token_ids[: s.num_spec]
            else:
                ids = req.token_ids[start : start + n]
            segments.append((ids, start, req.block_table))
        return build_batch(segments, self.block_size, self.device)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy whole KV blocks (reused partial blocks) in every layer's every cache part, as raw
        bytes so fp8 caches copy the same way."""
        dev = self.device
        src = torch.tensor([c.src for c in copies], dtype=torch.long, device=dev)
        dst = torch.tensor([c.dst for c in copies], dtype=torch.long, device=dev)
        draft = self.draft.kv_caches if self.draft is not None else []
        for layer in [*self.kv_caches, *draft]:
            for cache in layer:
                raw = cache.view(_RAW_DTYPES[cache.element_size()])
                raw[dst] = raw[src]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        if out.copies:
            self.copy_blocks(out.copies)
        input_ids, positions, meta = self.prepare(out)
        if self.lora_adapters is not None:
            rows, first = [], 0
            for s in out.scheduled:
                rows.append((first, s.num_new_tokens, s.request.lora))
                first += s.num_new_tokens
            self.model.lora = self.lora_adapters.batch(rows, self.model.linear)
        embeds = self._image_embeddings(out, input_ids) if self.replaces_embeddings else None
        if embeds is None:
            hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)
        else:
            hidden = self.model.forward(input_ids, positions, self.kv_caches, meta, inputs_embeds=embeds)
        if self.draft is not None:
            self.draft.follow(out.scheduled, hidden)
        rows: list[int] = []
        sampling: list[ScheduledRequest] = []
        prompt: list[PromptLogits] = []
        pooled_rows: list[int] = []
        pooled_vectors: list[torch.Tensor] = []  # mean / cls pooling: built from every chunk's rows
        pooled: list[ScheduledRequest] = []
        start = 0
        for s in out.scheduled:
            end = start + s.num_new_tokens
            if s.request.pooling and self.pooling_type != "last":
                self._pool_rows(s, hidden[start:end])
                if s.samples:
                    pooled_vectors.append(self._pooled_vector(s.request))
                    pooled.append(s)
            elif s.samples and s.request.pooling:
                pooled_rows.append(end - 1)
                pooled.append(s)
            elif s.samples:
                rows.extend(range(end - 1 - s.num_spec, end))  # the last known token, then each draft
                sampling.append(s)
            req = s.request
            if req.prompt_logprobs is not None:
                # Row for position p predicts token p + 1; only prompt tokens not yet scored.
                first = max(s.start, len(req.prompt_logprobs) - 1)
                last = min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1)
                if last > first:
                    h = hidden[start + first - s.start : start + last - s.start]
                    prompt.append(PromptLogits(s, first + 1, h, self.model.compute_logits))
            start = end
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        pooled_hidden = None
        if pooled_vectors:
            pooled_hidden = torch.stack(pooled_vectors)
        elif pooled:
            pooled_index = torch.tensor(pooled_rows, dtype=torch.long, device=self.device)
            pooled_hidden = hidden.index_select(0, pooled_index).float()
        if pooled_hidden is not None:
            if self.score_head is not None:
                pooled_hidden = self.model.linear(pooled_hidden, self.score_head, None)
            pooled_hidden = pooled_hidden.cpu()
        return ModelOutput(logits, sampling, prompt, pooled, pooled_hidden)

    def _image_embeddings(self, out: SchedulerOutput, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's input embeddings with image features (or given prompt embeddings) at the
        placeholder positions it computes, or None when it computes none. An image is encoded when a
        chunk first reaches its run and its features are kept on the request until the run is
        computed: chunked prefill may split a run across steps, and a prefix hit or a recompute
        after preemption may start inside one. Given features stay on the request throughout."""
        embeds = None
        row = 0
        for s in out.scheduled:
            req = s.request
            lo, hi = s.start, s.start + s.num_new_tokens
            for i, image in enumerate(req.images):
                first, last = max(lo, image.offset), min(hi, image.offset + image.length)
                if first >= last:
                    continue
                features = image.features
                if features is None:
                    features = req.image_features.get(i)
                    if features is None:
                        features = req.image_features[i] = self.model.encode_image(image.pixel_values)
                    if last == image.offset + image.length:
                        del req.image_features[i]
                if embeds is None:
                    embeds = self.model.embed_tokens(input_ids)
                embeds[row + first - lo : row + last - lo] = features[
                    first - image.offset : last - image.offset
                ]
            row += s.num_new_tokens
        return embeds

    def _pool_rows(self, s: ScheduledRequest, rows: torch.Tensor) -> None:
        """Fold a pooling request's chunk of prompt rows into what it keeps (engine/pooler.py). A
        chunk at position 0 starts over: a preempted request computes its prompt again."""
        req = s.request
        if self.pooling_type == "mean":
            chunk = rows.float().sum(dim=0)
            req.pooled_rows = chunk if s.start == 0 else req.pooled_rows + chunk
        elif s.start == 0:  # cls
            req.pooled_rows = rows[0].float()

    def _pooled_vector(self, req: Request) -> torch.Tensor:
        vector = req.pooled_rows
        if self.pooling_type == "mean":
            vector = vector / req.num_prompt_tokens
        req.pooled_rows = None
        return vector
