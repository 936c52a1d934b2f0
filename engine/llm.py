"""The offline API: ``LLM(model_dir, **engine_options).generate(prompts, params)``.

``LLM`` inherits its pooling APIs (``embed``, ``classify``, ``score``, ``encode``) from
``engine/llm_pooling.py``; the prompt forms it accepts (vLLM's prompt dicts, ``ImagePrompt``) are
``engine/llm_prompts.py``, the vLLM constructor options it accepts without an ``EngineConfig``
field ``engine/llm_options.py``.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any

from engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from engine.chat_template import template_message
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.llm_options import take_vllm_options
from engine.llm_pooling import LLMPooling
from engine.llm_prompts import ImagePrompt, Prompt, _as_prompt_list
from engine.lora_request import LoRARequest
from engine.media import MediaOptions, load_image, message_image_parts
from engine.multimodal import expand_image_tokens
from engine.outputs import (
    RequestOutput,
)
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer


class LLM(LLMPooling):
    """Runs the engine loop in the caller's thread until every prompt is done.

    With a KV tier, block writes are queued on a background writer: call ``close()`` (or use the
    LLM as a context manager) to write them out. A finalizer closes it at garbage collection or
    interpreter exit as a safety net.
    """

    def __init__(self, model: str | None = None, **engine_options: object) -> None:
        """``model``: a Hugging Face directory or hub id (``model_dir=`` is accepted too); None serves
        the built-in demo model. ``engine_options`` are ``EngineConfig`` fields, and vLLM's
        constructor options ferry has no use for (``tensor_parallel_size=1``, ``enforce_eager``,
        ``trust_remote_code``, …: engine/llm_options.py), logged and otherwise ignored."""
        if "model_dir" in engine_options:
            if model is not None:
                raise TypeError("pass the model once: either positionally or as model_dir=")
            model = engine_options.pop("model_dir")  # type: ignore[assignment]
        take_vllm_options(engine_options)
        self.config = EngineConfig.from_options(model=None if model is None else str(model), **engine_options)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        # Holds the connector, not the LLM, so it never keeps the LLM alive; runs at most once,
        # and at interpreter exit if nothing ran it before.
        self._finalizer = weakref.finalize(self, self.engine.connector.close)

    def close(self) -> None:
        """Flush queued KV tier writes and close the tier connection. Idempotent."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _check_ready(self) -> None:
        if self.closed:
            raise RuntimeError("this LLM is closed")
        if self.engine.is_sleeping:
            # The offline engine has nobody to wake it while a call waits: refuse instead of holding.
            raise RuntimeError("the engine is asleep: call LLM.wake_up() first")

    # -- sleep mode and weight updates (vLLM's; engine/sleep_mode.py, engine/weight_update.py) -------

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (the prefix cache emptied) and offload the weights to host memory
        (``level=1``; on a CPU device they stay where they are) or discard them (``level=2``: waking
        reads the checkpoint again, or ``reload_weights`` brings new ones). Needs
        ``enable_sleep_mode=True``."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore ``tags`` (``["weights"]``, ``["kv_cache"]``; None: both). A trainer wakes the
        weights, loads new ones (``reload_weights``), then wakes the KV cache."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """True until both the weights and the KV cache are awake."""
        return self.engine.is_sleeping

    def reload_weights(self, path: str | None = None, load_format: str | None = None) -> None:
        """Serve the weights of checkpoint ``path`` (None: the current checkpoint's directory, read
        again), which must be the same architecture and shapes (ValueError otherwise, the old
        weights kept). The prefix cache is emptied and the model fingerprint (KV tier keys) changes."""
        engine = self.engine
        engine.load_checkpoint(engine.read_checkpoint(path, load_format))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached KV block from the prefix cache (vLLM's ``LLM.reset_prefix_cache``): the
        next prompts are computed whole. Nothing runs between calls, so it always succeeds."""
        self.engine.block_manager.reset_prefix_cache()
        return True

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        """vLLM's ``collective_rpc`` for the one method RL frameworks call on it after a level-2
        wake: ``"reload_weights"``. One worker here, so one result."""
        if method != "reload_weights":
            raise ValueError(f"collective_rpc supports only 'reload_weights', got {method!r}")
        self.reload_weights(*args, **(kwargs or {}))
        return [None]

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's defaults (its ``generation_config.json``, or as the
        ``generation_config`` and ``override_generation_config`` options say), as vLLM's; what
        ``generate`` uses when given none."""
        return SamplingParams(**self.engine.generation_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool | Callable = False,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order; ``n > 1`` gives n completions (child i
        seeded ``seed + i`` when a seed is given). ``lora_request``: the LoRA adapter every prompt
        runs with, or one per prompt (needs ``enable_lora=True``). ``priority``: one per prompt, lower
        first (needs ``scheduling_policy="priority"``). Prompts may be vLLM's prompt dicts;
        ``use_tqdm`` (a bool or vLLM's tqdm factory) is accepted for vLLM's callers and shows
        nothing. Each output carries the ``lora_request`` its prompt ran with, as vLLM's."""
        self._check_ready()
        prompt_list = _as_prompt_list(prompts, images=True)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompt_list)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list = [lora_request] * len(prompt_list)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompt_list):
                raise ValueError(f"{len(lora_list)} LoRA requests for {len(prompt_list)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"{len(priorities)} priorities for {len(prompt_list)} prompts")
        engine = self.engine
        groups: list[list] = []
        for prompt, params, lora, prio in zip(prompt_list, params_list, lora_list, priorities, strict=True):
            params.validate()
            images: list[Any] = []
            if isinstance(prompt, ImagePrompt):
                prompt, images = prompt.prompt, list(prompt.images)
            children = []
            for i in range(params.n):
                seed = None if params.seed is None else params.seed + i
                child = replace(params, n=1, seed=seed)
                children.append(
                    engine.make_request(
                        f"llm-{next(self._ids)}",
                        prompt,
                        child,
                        lora_request=lora,
                        priority=prio,
                        images=images,
                    )
                )
            groups.append(children)
        for children in groups:
            for req in children:
                engine.add_request(req)
        while engine.has_unfinished_requests():
            engine.step()
        results = []
        for children, lora in zip(groups, lora_list, strict=True):
            outs = [engine.post.final(req) for req in children]
            first = outs[0]
            first.lora_request = lora
            for i, o in enumerate(outs):
                o.outputs[0].index = i
            first.outputs = [o.outputs[0] for o in outs]
            results.append(first)
        return results

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool | Callable = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt, as vLLM's ``LLM.beam_search`` (``engine/beam_search.py``):
        one ``BeamSearchOutput`` per prompt, its ``params.beam_width`` sequences best first, each
        with ``tokens`` (prompt and output), ``cum_logprob``, ``text`` (the output's text: vLLM's
        offline API puts the prompt's text in front), ``finish_reason`` and ``stop_reason``. Every
        prompt's live beams run together, one engine step per beam search step; with
        ``concurrency_limit``, that many prompts at a time (vLLM's). ``lora_request``: one adapter
        for every prompt, or one per prompt."""
        self._check_ready()
        engine = self.engine
        prompt_list = _as_prompt_list(prompts, images=True)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompt_list):
                raise ValueError(f"{len(loras)} LoRA requests for {len(prompt_list)} prompts")
        if concurrency_limit is not None and concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be at least 1, got {concurrency_limit}")
        # Each search with its images (processed once for all its steps) and its adapter.
        searches: list[tuple[BeamSearch, list[Any], LoRARequest | None]] = []
        for prompt, lora in zip(prompt_list, loras, strict=True):
            given: list[Any] = []
            if isinstance(prompt, ImagePrompt):
                prompt, given = prompt.prompt, list(prompt.images)
            if not isinstance(prompt, (str, list)):
                raise ValueError("prompt_embeds is taken by LLM.generate only")
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if given or engine.image_processor is not None:
                ids, given = self._with_images(ids, given)
            if len(ids) + params.max_tokens > engine.max_model_len:
                raise ValueError(
                    f"the prompt ({len(ids)} tokens) and max_tokens ({params.max_tokens}) exceed the "
                    f"model's context ({engine.max_model_len} tokens)"
                )
            searches.append((BeamSearch(ids, params, engine.eos_token_ids, self.tokenizer), given, lora))
        size = concurrency_limit or max(len(searches), 1)
        for start in range(0, len(searches), size):
            self._run_searches(searches[start : start + size])
        return [search.finish() for search, _, _ in searches]

    def _run_searches(self, searches: list[tuple[BeamSearch, list[Any], LoRARequest | None]]) -> None:
        """Step these searches together until each is done: every live beam one request a step."""
        engine = self.engine
        while True:
            running = [entry for entry in searches if not entry[0].done]
            if not running:
                return
            steps = []
            for search, given, lora in running:
                step = search.step_params()
                reqs = [
                    engine.make_request(
                        f"llm-{next(self._ids)}", beam.tokens, step, lora_request=lora, images=given
                    )
                    for beam in search.live
                ]
                steps.append((search, reqs))
            for _, reqs in steps:
                for req in reqs:
                    engine.add_request(req)
            while engine.has_unfinished_requests():
                engine.step()
            for search, reqs in steps:
                search.advance([engine.post.final(req).outputs[0].logprobs[0] for req in reqs])

    def _with_images(self, ids: list[int], images: list[Any]) -> tuple[list[int], list[Any]]:
        """A beam search prompt's ids with each image's placeholder run, and its images processed
        (every step's requests take them as they are)."""
        processor = self.engine.image_processor
        if processor is None:
            raise ValueError(
                f"this model ({self.engine.model_config.architecture}) takes text only, not images"
            )
        return expand_image_tokens(ids, processor.spec, len(images)), processor.process(images)

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (with its chat template), as vLLM's ``LLM.get_tokenizer``."""
        return self.tokenizer

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or several (a list of them),
        as vLLM's ``LLM.chat``: each rendered with the model's chat template (or ``chat_template``,
        a template's text or the name of one of the model's), as ``/v1/chat/completions`` renders
        it, then generated as ``generate`` does. A vision-language model takes image parts too:
        ``image_url`` with a data: or http(s) URL, or ``{"type": "image_pil", "image_pil": image}``.
        Raises ``ChatTemplateError`` (a ValueError) for messages the template cannot take, and
        ``MediaError`` (a ValueError) for an image that cannot be read."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        # vLLM's merge: the arguments over ``chat_template_kwargs``' spelling of them (``tools`` and
        # ``chat_template`` only when given), as the server merges a request's fields.
        kwargs = {
            **(chat_template_kwargs or {}),
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        if tools is not None:
            kwargs["tools"] = tools
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        prompts: list[Prompt] = []
        for conversation in conversations:
            # Image parts (data: or http(s) URLs, or PIL images as "image_pil") are read first, so a
            # bad one fails before anything runs.
            images = [load_image(src, MediaOptions()) for src in message_image_parts(conversation)]
            text = self.tokenizer.apply_chat_template(
                [template_message(m) for m in conversation],  # type: ignore[arg-type]
                **kwargs,
            )
            # The template holds every special token: none are added (as the server encodes it).
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append(ImagePrompt(ids, tuple(images)) if images else ids)  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, lora_request)
