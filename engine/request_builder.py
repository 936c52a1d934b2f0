"""A request's admission check: prompt and parameters checked against the served model and turned
into a ``Request`` (``LLMEngine`` inherits ``RequestBuilder``).

Everything here raises ValueError for input the engine cannot serve (the API server answers 400):
ids outside the tokenizer's vocabulary, a prompt and ``max_tokens`` past ``max_model_len`` or the
KV cache, images for a text-only model, a PD consumer's listed block hashes that do not lead the
prompt's own. It runs on the submitter's thread (the async engine calls ``make_request`` on the
API's event loop while the engine loop steps), so it must never queue a request or touch the
scheduler's or the block manager's state: ``LLMEngine.add_request`` queues what it built, on the
engine's thread.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.lora_request import LoRARequest
from engine.prompt_embeds import PreparedEmbeds, prepare_prompt_embeds
from engine.sampling_params import SamplingParams, bad_word_sequences
from engine.sequence import Request
from engine.thinking_budget import THINK_END, THINK_START, ThinkingTracker
from kvcache.keys import salt_extra


class RequestBuilder:
    """``LLMEngine``'s ``make_request`` and ``prepare_prompt_embeds``. Uses its ``config``,
    ``model_config``, ``model_runner``, ``tokenizer``, ``image_processor``, ``grammars``,
    ``block_manager``, the limits it set at start (``max_model_len``, ``kv_capacity_tokens``,
    ``sampling_vocab_size``, ``sliding_window``, ``eos_token_ids``), ``requests``, ``_seed_rng``,
    ``load_lora`` and ``_window_peak_blocks``."""

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
        if params.bad_words:  # vLLM's words: their token sequences join bad_words_token_ids
            words = bad_word_sequences(
                params.bad_words, lambda t: self.tokenizer.encode(t, add_special_tokens=False)
            )
            params = replace(
                params, bad_words=None, bad_words_token_ids=[*(params.bad_words_token_ids or ()), *words]
            )
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
            *(params.logprob_token_ids or ()),
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
        if params.thinking_token_budget is not None and not pooling:
            start, end = self.thinking_markers()
            req.thinking = ThinkingTracker(
                params.thinking_token_budget, start, end, req.prompt_token_ids, req.output_token_ids
            )
        if resumed:
            # The text of resumed tokens was delivered by whoever produced them.
            req.detokenizer.append(resumed)
        return req

    def thinking_markers(self) -> tuple[list[int], list[int]]:
        """The token ids of ``<think>`` and ``</think>`` (``thinking_token_budget``'s markers), as the
        tokenizer writes them (vLLM's reasoning config tokenizes the parser's start and end strings)."""
        markers = self.__dict__.get("_thinking_markers")
        if markers is None:
            encode = self.tokenizer.encode
            markers = (
                encode(THINK_START, add_special_tokens=False),
                encode(THINK_END, add_special_tokens=False),
            )
            self.__dict__["_thinking_markers"] = markers
        return markers

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
