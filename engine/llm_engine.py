"""The engine step loop: schedule -> run the model -> sample -> append, stop, detokenize.

``LLMEngine`` is synchronous and single-threaded; ``LLM`` drives it to completion and
``AsyncEngine`` runs it on a background thread. ``step()`` returns DELTA outputs: for each request
that advanced, only what is new since the previous step.

``LLMEngine`` inherits five parts that live in files of their own: checking and building a request
(``make_request``, engine/request_builder.py), speculative decoding's verify and propose
(engine/spec_step.py), sleep mode and weight updates (engine/sleep_mode.py), loading LoRA adapters
(engine/lora_loading.py), and releasing the final outputs held for the KV connector's report
(engine/held_finals.py).
"""

from __future__ import annotations

import bisect
import logging
import random
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, wait
from pathlib import Path

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.generation_defaults import load_generation_defaults
from engine.held_finals import HeldFinals
from engine.image_processor import ImageProcessor, probe_image
from engine.kv_budget import logit_rows
from engine.kv_connector import build_kv_connector
from engine.lora import LoRACache
from engine.lora_loading import LoRALoading
from engine.model_runner import ModelOutput, ModelRunner
from engine.models.config import ModelConfig
from engine.models.loader import resolve_model_dir
from engine.models.quant_config import check_quantization
from engine.outputs import RequestOutput
from engine.pooler import needs_every_row, resolve_matryoshka, resolve_pooling_type
from engine.postprocess import Postprocessor
from engine.request_builder import RequestBuilder
from engine.sampler import Sampler, SamplingRow
from engine.scheduler import Scheduler, SchedulerConfig
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Request, RequestStatus
from engine.sleep_mode import EngineSleep, SleepState
from engine.spec_decode import NgramProposer
from engine.spec_step import SpecDecodeStep
from engine.stats import ITERATION_TOKEN_BUCKETS, EngineStats, ModelInfo
from engine.structured_output import GrammarCompiler
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The most a step that finds only the KV tier to wait on (loads, lookups, a producer's writes)
# waits before returning; a new command cuts it short (``step_interrupt``).
TIER_IDLE_WAIT_S = 0.05

LogitsObserver = Callable[[list[str], torch.Tensor], None]


class LLMEngine(EngineSleep, RequestBuilder, SpecDecodeStep, LoRALoading, HeldFinals):
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

    # -- requests ------------------------------------------------------------------------------------

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

    # -- the step ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        released = self._release_finals() if self._held_finals else []
        if self.sleep_state.is_sleeping:
            if not self.has_held_outputs and not released:
                raise RuntimeError("the engine is asleep: wake_up() before stepping")
            sched = SchedulerOutput()  # asleep: only finished requests' held outputs go out
        else:
            self.connector.step()
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

    @property
    def has_idle_work(self) -> bool:
        """No request needs a step, but the KV connector has work of its own (re-publishing to the
        tier after it came back): an idle async engine runs ``idle_step`` meanwhile."""
        return not self.sleep_state.is_sleeping and self.connector.has_work()

    @property
    def idle_wake_in(self) -> float | None:
        """How long an idle loop may sleep before the connector's next own work is due (None: until
        a command): its periodic checks of the tier run with no traffic, without polling."""
        return None if self.sleep_state.is_sleeping else self.connector.next_work_in()

    def idle_step(self) -> None:
        """The connector's bounded share of its own work, then a wait of at most
        ``TIER_IDLE_WAIT_S`` (cut short by a new command) so that an idle loop does not spin."""
        self.connector.step()
        wait([self.step_interrupt], timeout=TIER_IDLE_WAIT_S)

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
                        thinking=req.thinking,
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
