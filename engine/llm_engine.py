"""The engine step loop: schedule -> run the model -> sample -> append, stop, detokenize.

``LLMEngine`` is synchronous and single-threaded; ``LLM`` drives it to completion and
``AsyncEngine`` runs it on a background thread. ``step()`` returns DELTA outputs: for each request
that advanced, only what is new since the previous step.
"""

from __future__ import annotations

import bisect
import logging
import random
import time
import uuid
from array import array
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.generation_defaults import load_generation_defaults
from engine.image_processor import ImageProcessor, probe_image
from engine.kv_budget import logit_rows
from engine.kv_connector import build_kv_connector
from engine.lora import LoRAAdapter, LoRACache, load_adapter
from engine.lora_request import LoRARequest
from engine.model_runner import ModelOutput, ModelRunner
from engine.models.config import ModelConfig
from engine.models.loader import resolve_model_dir
from engine.models.quantized import check_quantization
from engine.outputs import RequestOutput, merge_deltas
from engine.pooler import needs_every_row, resolve_matryoshka, resolve_pooling_type
from engine.postprocess import Postprocessor
from engine.prompt_embeds import PreparedEmbeds, prepare_prompt_embeds
from engine.sampler import Sampler, SamplerOutput, SamplingRow
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import Request, RequestStatus
from engine.sleep_mode import EngineSleep, SleepState
from engine.spec_decode import NgramProposer
from engine.stats import ITERATION_TOKEN_BUCKETS, EngineStats, ModelInfo
from engine.structured_output import GrammarCompiler
from engine.tokenizer import Tokenizer
from kvcache.keys import salt_extra

logger = logging.getLogger(__name__)

# The most a step that finds only the KV tier to wait on (loads, lookups, a producer's writes)
# waits before returning; a new command cuts it short (``step_interrupt``).
TIER_IDLE_WAIT_S = 0.05

LogitsObserver = Callable[[list[str], torch.Tensor], None]


class LLMEngine(EngineSleep):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir: Path = resolve_model_dir(config.model, config.revision, config.download_dir)
        self.model_config = ModelConfig.from_dir(self.model_dir, config.hf_overrides)
        check_quantization(config.quantization, self.model_config.quant_method)
        # vLLM's --tokenizer: tokenizer, chat template and special tokens from another directory.
        self.tokenizer_dir: Path = self.model_dir
        if config.tokenizer or config.tokenizer_revision:
            tokenizer_revision = config.tokenizer_revision or config.revision
            self.tokenizer_dir = resolve_model_dir(
                config.tokenizer or config.model, tokenizer_revision, config.download_dir
            )
        self.tokenizer = Tokenizer.from_dir(
            self.tokenizer_dir,
            config.chat_template,
            config.chat_template_content_format,
            config_dir=self.model_dir,
        )
        self.generation_defaults = load_generation_defaults(
            self.model_dir, config.generation_config, config.override_generation_config
        )
        self.model_runner = ModelRunner(config, self.model_dir, self.model_config)
        runner = self.model_runner
        self.image_processor = self._image_processor() if runner.takes_images else None
        self.pooling_type = runner.pooling_type = resolve_pooling_type(config.pooling_type, self.model_dir)
        self.max_model_len = runner.max_model_len
        self.vocab_size = self.model_config.vocab_size
        eos = list(self.tokenizer.eos_token_ids) + list(self.model_config.eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.block_manager = BlockManager(
            runner.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.partial_prefix_caching,
        )
        # New at each start: what a replica's /health names so a router can tell a restarted
        # replica (whose KV cache is empty) from one that merely stopped answering for a while;
        # its KV events name it too (set before the connector, which publishes them).
        self.instance_id = uuid.uuid4().hex
        self.connector = build_kv_connector(config, self)
        windows = self.model_config.layer_windows
        # Blocks behind the window can be given back only if no layer attends further.
        self.sliding_window: int | None = (
            min(w for w in windows if w is not None) if windows and None not in windows else None
        )
        sched_cfg = SchedulerConfig(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            config.long_prefill_token_threshold,
            self.sliding_window,
            needs_every_row(self.pooling_type),
            config.max_loras if config.enable_lora else 0,
            config.scheduling_policy == "priority",
            draft_hit_lag=1 if getattr(config.speculative_config, "method", None) == "mtp" else 0,
        )
        self.scheduler = Scheduler(sched_cfg, self.block_manager, self.connector)
        self.loras: LoRACache | None = None
        if config.enable_lora:
            layout = getattr(runner.model, "lora_layout", None)
            if layout is None:
                raise ValueError(
                    f"LoRA adapters are not supported for {self.model_config.architecture} models"
                )
            self.lora_layouts = layout()
            self.loras = LoRACache(config.max_cpu_loras or config.max_loras)
        # A checkpoint's embedding may be padded past the tokenizer (e.g. to a multiple of 64): those
        # rows are not tokens, so the sampler and prompt logprobs never look past the tokenizer.
        self.sampling_vocab_size = min(self.vocab_size, self.tokenizer.vocab_size)
        self.sampler = Sampler(self.sampling_vocab_size, config.logprobs_mode)
        self.post = Postprocessor(
            self.tokenizer, self.max_model_len, self.sampling_vocab_size, config.logprobs_mode
        )
        self.logit_rows = logit_rows(config)  # prompt logprobs' chunk: what the activation reserve counts
        self.grammars = GrammarCompiler(
            self.tokenizer,
            self.sampling_vocab_size,
            self.eos_token_ids,
            mask_budget_ms=config.structured_outputs_mask_budget_ms,
        )
        self.requests: dict[str, Request] = {}
        # Finished requests whose final output waits for the KV connector's report (a PD
        # producer's prompt blocks being written to the tier), with that output.
        self._held_finals: list[tuple[Request, RequestOutput]] = []
        # A step that finds only the tier to wait on also returns once this is set: the async
        # loop sets it when a command (a new request, an abort) comes in.
        self.step_interrupt: Future = Future()
        self.sleep_state = SleepState()
        self._seed_rng = random.Random(config.seed)
        # Test and debugging hook: called with (request ids, fp32 logits) of each step's sampling rows.
        self.logits_observers: list[LogitsObserver] = []
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.iteration_tokens_counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.iteration_tokens_sum = 0
        spec = config.speculative_config
        self.proposer = NgramProposer(spec) if spec is not None and spec.method == "ngram" else None
        # Decided once: how a step's sampled requests get their next drafts, if at all.
        self._propose: Callable[[list[Request]], None] | None = None
        if runner.draft is not None:
            self._propose = self._propose_draft
        elif self.proposer is not None:
            self._propose = self._propose_ngram
        self.spec_drafts = 0  # steps in which a request verified drafts
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_accepted_per_position = [0] * (spec.num_speculative_tokens if spec is not None else 0)
        self.kv_capacity_tokens = self.block_manager.num_blocks * config.block_size
        if self.sliding_window is not None and self.block_manager.num_blocks >= self._window_peak_blocks():
            self.kv_capacity_tokens = self.max_model_len
        if self.kv_capacity_tokens < self.max_model_len:
            # vLLM refuses to start here; ferry serves, each sequence held to what the cache holds
            # (the API's max_model_len says so), and says so once.
            logger.warning(
                "the KV cache holds %d tokens (%d blocks of %d), fewer than max_model_len %d: each "
                "request is limited to %d tokens (more KV memory or --num-kv-blocks, or a lower "
                "--max-model-len, lifts this)",
                self.kv_capacity_tokens,
                self.block_manager.num_blocks,
                config.block_size,
                self.max_model_len,
                self.kv_capacity_tokens,
            )
        name = config.model if config.model is not None else "ferry-demo"
        self.model_info = ModelInfo(
            name=str(name),
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            block_size=config.block_size,
            model_fingerprint=runner.model_fingerprint,
            weights_id=runner.weights_id,
            num_kv_blocks=runner.num_kv_blocks,
            kv_capacity_tokens=self.kv_capacity_tokens,
            hidden_size=runner.model_config.hidden_size,
            pooling_type=self.pooling_type,
            matryoshka=resolve_matryoshka(self.model_config, self.model_dir),
            generation_defaults=self.generation_defaults,
            classifier=runner.classifier,
            image=self.image_processor.spec if self.image_processor is not None else None,
        )

    def _image_processor(self) -> ImageProcessor:
        """The model's image processor, checked once against the vision tower: one image's features
        must fill exactly the placeholder run the processor expands its token into."""
        vision = self.model_config.vision
        processor = ImageProcessor(self.model_dir, vision.image_token_id)  # type: ignore[union-attr]
        _, (probe,) = processor.prepare([vision.image_token_id], [probe_image()])  # type: ignore[union-attr]
        rows = self.model_runner.model.encode_image(probe.pixel_values).shape[0]
        if rows != probe.length:
            raise ValueError(
                f"the vision tower gives {rows} features per image but the processor expands an image "
                f"into {probe.length} tokens"
            )
        return processor

    @property
    def model_fingerprint(self) -> str:
        return self.model_runner.model_fingerprint

    # -- LoRA adapters -------------------------------------------------------------------------------

    def read_lora(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter (ValueError if it cannot run on this model); touches no engine
        state, so it may run on any thread."""
        if self.loras is None:
            raise ValueError("LoRA adapters are not enabled on this engine (start it with --enable-lora)")
        return load_adapter(
            request, self.lora_layouts, max_rank=self.config.max_lora_rank, dtype=self.model_runner.dtype
        )

    def cached_lora(self, request: LoRARequest) -> LoRAAdapter | None:
        """The loaded adapter for ``request``, if it is loaded from the same directory."""
        adapter = self.loras.get(request.lora_name) if self.loras is not None else None
        if adapter is not None and adapter.path == str(Path(request.lora_path).expanduser()):
            return adapter
        return None

    def load_lora(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> LoRAAdapter:
        """The adapter for ``request``: ``adapter`` (read elsewhere) if given, else the loaded one,
        else read now; kept loaded."""
        cached = self.cached_lora(request) if adapter is None else None
        if cached is not None:
            return cached
        adapter = adapter or self.read_lora(request)
        self.loras.put(adapter)  # type: ignore[union-attr]
        return adapter

    def remove_lora(self, name: str) -> bool:
        """Unload adapter ``name``; requests running with it keep it until they finish."""
        return self.loras is not None and self.loras.pop(name) is not None

    # -- requests ------------------------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt: str | list[int] | torch.Tensor | PreparedEmbeds,
        params: SamplingParams,
        *,
        resume_token_ids: list[int] | None = None,
        kv_transfer: dict[str, Any] | None = None,
        grammar: Any = None,
        pooling: bool = False,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        images: list[Any] | None = None,
    ) -> Request:
        """Validate and build a request (raises ValueError for bad input); does not queue it.

        ``prompt``: text, token ids, or (with ``enable_prompt_embeds``) the prompt's input embeddings,
        a tensor ``[seq_len, hidden]`` or what ``prepare_prompt_embeds`` made of one
        (``engine/prompt_embeds.py``): its token ids are then ``seq_len`` placeholders, and it takes
        neither images nor prompt logprobs.

        ``images``: PIL images for a vision-language model, one per image token of the prompt (in
        order); each image token becomes the image's placeholder run (``engine/image_processor.py``).

        ``priority``: under ``scheduling_policy="priority"``, lower values run first (vLLM's);
        any other value than 0 is refused under ``fcfs``.

        ``cache_salt`` (vLLM's): salts every block hash of the request (``kvcache.keys.salt_extra``),
        so it shares cached blocks only with requests of the same salt.

        ``lora_request``: run it with that LoRA adapter, loaded now unless it is (``load_lora``).

        ``pooling``: an embedding request; it ends when its prompt is computed, its result the
        prompt's pooled hidden state (``RequestOutput.embedding``; engine/pooler.py), and samples nothing.

        ``grammar``: the compiled ``params.structured_outputs`` (``self.grammars.compile``), when the
        caller compiled it elsewhere (the async engine does, off its threads); else it is compiled here.
        """
        params.validate()
        if not pooling and self.model_runner.classifier is not None:
            raise ValueError(
                f"this model ({self.model_config.architecture}) is a sequence classifier and does not "
                "generate text: use /classify, /score or /rerank (LLM.classify, LLM.score)"
            )
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(
                "request priority needs priority scheduling (scheduling_policy='priority', "
                "ferry serve --scheduling-policy priority)"
            )
        adapter = self.load_lora(lora_request) if lora_request is not None else None
        if params.n != 1:
            raise ValueError("one engine request is one sequence: fan out n > 1 before the engine")
        for name, n in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if n is not None and n > self.config.max_logprobs:
                raise ValueError(f"{name}={n} exceeds the engine's max_logprobs={self.config.max_logprobs}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        image_inputs = []
        embeds = None
        if isinstance(prompt, (torch.Tensor, PreparedEmbeds)):
            embeds = self._prompt_embeds(prompt, params, images)
            ids, image_inputs = embeds.token_ids, [embeds.span]
        else:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if not ids:
                raise ValueError("the prompt is empty")
            if self.image_processor is not None:
                ids, image_inputs = self.image_processor.prepare(ids, list(images or []))
            elif images:
                raise ValueError(f"this model ({self.model_config.architecture}) takes text only, not images")
        resumed = list(resume_token_ids or [])
        extra = [
            *(params.allowed_token_ids or ()),
            *(t for seq in params.bad_words_token_ids or () for t in seq),
        ]
        for seq in (ids, resumed, extra):
            _check_token_ids(seq, self.sampling_vocab_size)
        limit = self.max_model_len
        if pooling:
            if len(ids) > limit:
                raise ValueError(f"the input has {len(ids)} tokens, more than max_model_len={limit}")
            params = _with_max_tokens(params, 1)  # reserves the KV slot the last position writes
            limit += 1
        if params.max_tokens is None:
            # As much as fits in max_model_len and in the KV cache (so it can always finish).
            capacity = self.kv_capacity_tokens
            params = _with_max_tokens(params, min(limit, capacity) - len(ids))
            if params.max_tokens < 1:
                raise ValueError(
                    f"the prompt has {len(ids)} tokens, which leaves no room to generate (max_model_len={limit}, "
                    f"KV cache {capacity} tokens)"
                )
        if len(ids) + params.max_tokens > limit:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {len(ids) + params.max_tokens} "
                f"exceeds max_model_len={limit}"
            )
        if len(resumed) >= params.max_tokens:
            raise ValueError(
                f"{len(resumed)} resumed tokens leave nothing to generate under max_tokens={params.max_tokens}"
            )
        # A pooling request ends once its prompt is computed: it never writes the KV of a next token.
        need = self.block_manager.blocks_for(len(ids) + (0 if pooling else params.max_tokens))
        if self.sliding_window is not None:
            need = min(need, self._window_peak_blocks())
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt + max_tokens needs {need} KV blocks but the cache has only {self.block_manager.num_blocks}"
            )
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(
            request_id,
            ids,
            params,
            seed=seed,
            eos_token_ids=self.eos_token_ids,
            block_size=self.config.block_size,
            prompt=text,
            resume_token_ids=resumed,
            kv_transfer=kv_transfer,
        )
        req.pooling = pooling
        req.priority = priority
        if image_inputs:
            req.images = image_inputs
            req.image_spans = tuple((i.offset, i.length, i.digest) for i in image_inputs)
        if adapter is not None:
            req.lora, req.block_extra = adapter, adapter.block_extra
        if cache_salt is not None:
            if not isinstance(cache_salt, str) or not cache_salt:
                raise ValueError("cache_salt must be a non-empty string")
            req.block_extra += salt_extra(cache_salt)
        if image_inputs and kv_transfer and kv_transfer.get("block_hashes"):
            _check_listed_hashes(req, kv_transfer["block_hashes"])
        if embeds is not None:
            req.prompt_embeds, req.penalty_prompt_ids = True, []
        # Placeholders are no text to continue from: a prompt given as embeddings gives no context.
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, params, req.penalty_prompt_ids)
        if params.structured_outputs is not None:
            if grammar is None:
                grammar = self.grammars.compile(params.structured_outputs)
            req.grammar = self.grammars.matcher(grammar, params.structured_outputs.after_token_id)
            for i, tok in enumerate(resumed):
                if not req.grammar.accept(tok):
                    raise ValueError(
                        f"resumed token {i} ({tok}) does not follow the request's structured outputs"
                    )
        if resumed:
            # The text of resumed tokens was delivered by whoever produced them.
            req.detokenizer.append(resumed)
        return req

    def prepare_prompt_embeds(self, embeds: torch.Tensor) -> PreparedEmbeds:
        """Check, cast and hash a prompt given as embeddings (ValueError for bad ones, or when the
        engine does not take them); touches no engine state, so it may run on any thread."""
        if not self.config.enable_prompt_embeds:
            raise ValueError(
                "prompt embeddings are not enabled on this engine (enable_prompt_embeds=True, "
                "ferry serve --enable-prompt-embeds)"
            )
        runner = self.model_runner
        return prepare_prompt_embeds(embeds, self.model_config.hidden_size, runner.dtype, runner.device)

    def _prompt_embeds(
        self, embeds: torch.Tensor | PreparedEmbeds, params: SamplingParams, images: list[Any] | None
    ) -> PreparedEmbeds:
        if not isinstance(embeds, PreparedEmbeds):
            embeds = self.prepare_prompt_embeds(embeds)
        if images:
            raise ValueError("a prompt given as embeddings takes no images")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs needs prompt tokens: a prompt given as embeddings has none")
        return embeds

    def _window_peak_blocks(self) -> int:
        """Most blocks one request holds at once when every layer slides: the window behind its
        next query, the largest step it can take, and the partly filled blocks at both ends."""
        step = self.config.max_num_batched_tokens
        if self.config.long_prefill_token_threshold:
            step = min(step, self.config.long_prefill_token_threshold)
        return self.block_manager.blocks_for((self.sliding_window or 0) + step) + 1

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.prompt_tokens_total += request.num_prompt_tokens
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a request at once (blocks freed); its final delta output, or None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None or req.is_finished:
            return None
        self.scheduler.finish(req, "abort")
        return self.post.delta(req, [], "", None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._held_finals)

    @property
    def has_held_outputs(self) -> bool:
        """Finished requests whose final output waits for the KV connector (stepped even asleep)."""
        return bool(self._held_finals)

    # -- the step ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        released = self._release_finals() if self._held_finals else []
        if self.sleep_state.is_sleeping:
            if not self.has_held_outputs and not released:
                raise RuntimeError("the engine is asleep: wake_up() before stepping")
            sched = SchedulerOutput()  # asleep: only finished requests' held outputs go out
        else:
            sched = self.scheduler.schedule()
        if sched.is_empty:
            if not released:
                # Only requests waiting on the tier remain (parked loads, lookups still out,
                # finished producers' blocks being written): wait for one instead of spinning.
                held = [req.kv_transfer_future for req, _ in self._held_finals]
                self.scheduler.wait_for_tier(
                    timeout=TIER_IDLE_WAIT_S, also=held, interrupt=self.step_interrupt
                )
            return released
        model_out = self.model_runner.execute(sched)
        self.scheduler.update_after_step(sched)
        tokens = sched.num_batched_tokens
        self.iteration_tokens_counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
        self.iteration_tokens_sum += tokens
        return released + self._postprocess(sched, model_out)

    def _release_finals(self) -> list[RequestOutput]:
        """The final outputs whose connector report (``kv_transfer_future``) came in."""
        outputs: list[RequestOutput] = []
        still: list[tuple[Request, RequestOutput]] = []
        for req, out in self._held_finals:
            future = req.kv_transfer_future
            assert future is not None
            if not future.done():
                still.append((req, out))
                continue
            try:
                req.kv_transfer_result = future.result()
            except Exception:  # the connector reports nothing: the consumer recomputes
                logger.exception("request %s: the KV connector's finish report failed", req.request_id)
            req.kv_transfer_future = None
            outputs.append(self.post.finalize(req, out))
        self._held_finals = still
        return outputs

    def _postprocess(self, sched: SchedulerOutput, model_out: ModelOutput) -> list[RequestOutput]:
        for pl in model_out.prompt_logits:
            self.post.add_prompt_logprobs(pl, self.logit_rows)
        pooled = self._finish_pooled(model_out)
        if not model_out.sampling:
            return pooled + [
                self.post.delta(p.scheduled.request, [], "", None) for p in model_out.prompt_logits
            ]
        rows: list[SamplingRow] = []
        for s in model_out.sampling:
            req = s.request
            for j in range(1 + s.num_spec):  # a draft's row: the history the drafts before it imply
                outputs_so_far = (
                    req.output_token_ids if j == 0 else req.output_token_ids + req.spec_token_ids[:j]
                )
                rows.append(
                    SamplingRow(
                        params=req.params,
                        seed=req.seed,
                        position=req.num_tokens + j,
                        prompt_token_ids=req.penalty_prompt_ids,
                        output_token_ids=outputs_so_far,
                        eos_token_ids=req.eos_token_ids,
                        grammar=req.grammar,
                    )
                )
        for observer in self.logits_observers:
            ids = [s.request.request_id for s in model_out.sampling for _ in range(1 + s.num_spec)]
            observer(ids, model_out.sample_logits)
        sampled = self.sampler(model_out.sample_logits, rows)
        outputs: list[RequestOutput] = []
        drafting: list[Request] = []
        i = 0
        for s in model_out.sampling:
            req = s.request
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = time.monotonic()
            out = self.post.append_token(req, sampled, i)
            if s.num_spec:
                out = self._verify(s, sampled, i, out)
            i += 1 + s.num_spec
            self.generation_tokens_total += len(out.outputs[0].token_ids)
            if req.finish_reason is not None and req.status is not RequestStatus.FINISHED:
                self.scheduler.finish(req, req.finish_reason)
                self.requests.pop(req.request_id, None)
                if req.kv_transfer_future is not None:
                    self._held_finals.append((req, out))  # out when its connector's report is in
                    continue
                out = self.post.finalize(req, out)
            elif self._propose is not None:
                drafting.append(req)
            outputs.append(out)
        if drafting:
            self._propose(drafting)
        return pooled + outputs

    def _verify(
        self, s: ScheduledRequest, sampled: SamplerOutput, i: int, out: RequestOutput
    ) -> RequestOutput:
        """Walk a request's drafts after its first token (``out``, drawn at row ``i``): while the
        token drawn at a position equals the draft there, that draft's KV holds and the next
        position's draw is the next token. Returns the step's whole delta."""
        req, drafts = s.request, s.request.spec_token_ids
        accepted = 0
        while (
            accepted < s.num_spec
            and req.finish_reason is None
            and sampled.token_ids[i + accepted] == drafts[accepted]
        ):
            accepted += 1
            out = merge_deltas(out, self.post.append_token(req, sampled, i + accepted))
        req.num_computed_tokens += accepted
        req.spec_token_ids = []
        self.spec_drafts += 1
        self.spec_draft_tokens += s.num_spec
        self.spec_accepted_tokens += accepted
        for pos in range(accepted):
            self.spec_accepted_per_position[pos] += 1
        return out

    def _room(self, req: Request) -> int:
        """Most drafts a request's next step may verify: its tokens then, drafts and the token
        drawn after them, stay within ``max_tokens`` and ``max_model_len``. None under structured
        outputs (whose grammar would have to walk the drafts)."""
        if req.grammar is not None:
            return 0
        return (
            min((req.params.max_tokens or 0) - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        )

    def _propose_ngram(self, requests: list[Request]) -> None:
        for req in requests:
            room = self._room(req)
            if room <= 0:
                continue
            tokens = req.lookup_tokens
            if tokens is None:
                tokens = req.lookup_tokens = array("i", req.token_ids)
            else:
                tokens.extend(req.token_ids[len(tokens) :])
            req.spec_token_ids = self.proposer.propose(tokens, room)  # type: ignore[union-attr]

    def _propose_draft(self, requests: list[Request]) -> None:
        """The draft model's drafts for the requests, in one batch. It feeds each request's newest
        token and every draft but the last: their slots are allocated now (vLLM's lookahead
        slots), and where blocks are short a request gets only the drafts its blocks hold. Requests
        without room go too, with no drafts: the MTP layer (engine/mtp.py) completes their entries."""
        draft, bm = self.model_runner.draft, self.block_manager
        k_max, bs = self.config.speculative_config.num_speculative_tokens, self.config.block_size
        batch: list[tuple[Request, int]] = []
        for req in requests:
            # Draft KV past the accepted tokens holds rejected drafts.
            req.num_draft_computed = min(req.num_draft_computed, req.num_computed_tokens)
            newest = req.num_tokens - 1  # the position the draft feeds first
            k = min(self._room(req), k_max, draft.max_model_len - newest)  # type: ignore[union-attr]
            if k > 0 and not bm.may_append(req.block_table, newest + k):
                k = len(req.block_table) * bs - newest
            batch.append((req, max(k, 0)))
        draft.propose(batch, self.sampling_vocab_size)  # type: ignore[union-attr]

    def _finish_pooled(self, model_out: ModelOutput) -> list[RequestOutput]:
        """Pooling requests whose prompt was computed this step end with their embedding."""
        outputs: list[RequestOutput] = []
        vectors = model_out.pooled_hidden if model_out.pooled_hidden is not None else ()
        for s, vector in zip(model_out.pooled, vectors, strict=True):
            req = s.request
            req.metrics.first_token_time = time.monotonic()
            req.embedding = vector.tolist()
            req.finish_reason = "stop"
            self.scheduler.finish(req, "stop")
            self.requests.pop(req.request_id, None)
            out = self.post.finalize(req, self.post.delta(req, [], "", None))
            out.embedding = req.embedding
            outputs.append(out)
        return outputs

    # -- introspection -------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        return EngineStats(
            num_running=len(s.running),
            num_waiting=s.num_waiting,
            kv_cache_usage=bm.usage(),
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            partial_prefix_hits=s.partial_prefix_hits,
            num_preemptions=s.num_preemptions,
            num_prefix_waits=s.num_prefix_waits,
            prompt_tokens=self.prompt_tokens_total,
            generation_tokens=self.generation_tokens_total,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            prefix_cache_resets=bm.prefix_cache_resets,
            spec_decode_num_drafts=self.spec_drafts,
            spec_decode_num_draft_tokens=self.spec_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_accepted_tokens,
            spec_decode_accepted_per_position=tuple(self.spec_accepted_per_position),
            iteration_tokens_counts=tuple(self.iteration_tokens_counts),
            iteration_tokens_sum=self.iteration_tokens_sum,
            running_loras=_lora_names(s.running) if self.loras is not None else (),
            waiting_loras=_lora_names([*s.waiting, *(p.request for p in s.loading)])
            if self.loras is not None
            else (),
        )


def _lora_names(requests: list[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    return replace(params, max_tokens=max_tokens)


def _check_listed_hashes(req: Request, listed: list[str]) -> None:
    """A PD consumer's ``kv_transfer.block_hashes`` must lead its prompt's own block hashes. The API
    server checks this for text prompts (server/roles.py); images are hashed by their pixels, which
    only the engine computes, so their prompts are checked here."""
    own = [h.hex() for h in req.full_block_hashes()[: req.num_prompt_tokens // req.block_size]]
    if len(listed) > len(own) or own[: len(listed)] != [h.lower() for h in listed]:
        raise ValueError(
            f"kv_transfer.block_hashes ({len(listed)} hashes) are not the leading block hashes of this "
            f"prompt with its images ({len(own)} full blocks of {req.block_size} tokens)"
        )


def _check_token_ids(ids: list[Any], vocab_size: int) -> None:
    """Every id an int in ``[0, vocab_size)``: against the tokenizer's vocabulary, as padded
    embedding rows are not tokens (and have no prompt logprob column). A request's whole prompt
    passes through here on the submitter's event loop, so the common case (plain ints) is checked
    by C builtins, not a Python step per token."""
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size):
        return
    for tok in ids:
        if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < vocab_size:
            raise ValueError(f"token id {tok!r} is out of the vocabulary [0, {vocab_size})")
