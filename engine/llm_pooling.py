"""The offline ``LLM``'s pooling APIs, as vLLM's and in its result shapes: ``embed`` (each prompt's
embedding: ``.outputs.embedding``, L2-normalised unless ``PoolingParams(normalize=False)``),
``classify`` (a ``*ForSequenceClassification`` model's labels: ``.outputs.probs``), ``score`` (text
pairs, by a cross-encoder or by the cosine of two embeddings: ``.outputs.score``) and ``encode``
(either task's values as a tensor: ``.outputs.data``). ``LLM`` inherits ``LLMPooling``; generation,
chat and the engine's lifetime stay in ``engine/llm.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.classifier import ClassifierInfo, pair_prompt
from engine.llm_prompts import Prompt, _as_prompt_list
from engine.lora_request import LoRARequest
from engine.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from engine.pooler import resolve_matryoshka
from engine.pooling import activate, normalized, truncated
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.sequence import Request

PoolingParamsArg = PoolingParams | Sequence[PoolingParams] | None
LoRAArg = LoRARequest | Sequence[LoRARequest | None] | None
POOLING_TASKS = ("embed", "classify")


class LLMPooling:
    """``LLM``'s ``embed``, ``classify``, ``score`` and ``encode``. Uses its ``engine``,
    ``tokenizer``, ``config``, ``_ids`` and ``_check_ready``. ``use_tqdm`` is taken, as ``generate``
    takes it, and shows nothing."""

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParamsArg = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable = False,
        lora_request: LoRAArg = None,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's pooled values as a float32 tensor, in prompt order (vLLM's ``LLM.encode``):
        ``pooling_task="embed"`` its embedding (as ``embed``), ``"classify"`` its label probabilities
        (as ``classify``); None: the model's task (``classify`` on a sequence classifier, else
        ``embed``)."""
        if pooling_task is None:
            pooling_task = "embed" if self.engine.model_runner.classifier is None else "classify"
        if pooling_task not in POOLING_TASKS:
            raise ValueError(f"pooling_task must be one of {', '.join(POOLING_TASKS)}, got {pooling_task!r}")
        run = self._embed_values if pooling_task == "embed" else self._class_values
        return [
            PoolingRequestOutput(
                req.request_id,
                req.prompt_token_ids,
                PoolingOutput(torch.from_numpy(values.astype(np.float32))),
                req.num_cached_tokens,
            )
            for req, values in run(prompts, pooling_params, truncate_prompt_tokens, lora_request)
        ]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable = False,
        pooling_params: PoolingParamsArg = None,
        lora_request: LoRAArg = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding, in prompt order (vLLM's ``LLM.embed``): its pooled hidden state
        (after the final norm; by default the last token's, the embedding of decoder models such as
        Qwen3-Embedding: ``pooling_type``, engine/pooler.py), L2-normalised as vLLM's (the state
        itself with ``PoolingParams(normalize=False)``), float32 values as vLLM's."""
        return [
            EmbeddingRequestOutput(
                req.request_id,
                req.prompt_token_ids,
                EmbeddingOutput(values.astype(np.float32).tolist()),
                req.num_cached_tokens,
            )
            for req, values in self._embed_values(
                prompts, pooling_params, truncate_prompt_tokens, lora_request
            )
        ]

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        pooling_params: PoolingParamsArg = None,
        use_tqdm: bool | Callable = False,
        lora_request: LoRAArg = None,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's classification by a ``*ForSequenceClassification`` model, in prompt order
        (vLLM's ``LLM.classify``): ``.outputs.probs`` (softmax over the labels, or the sigmoid for
        one label, as the config says: engine/classifier.py; the logits with
        ``PoolingParams(use_activation=False)``) and ``.outputs.logits`` (the head's)."""
        return [
            ClassificationRequestOutput(
                req.request_id,
                req.prompt_token_ids,
                ClassificationOutput(values.tolist(), req.embedding),  # type: ignore[arg-type]
                req.num_cached_tokens,
            )
            for req, values in self._class_values(prompts, pooling_params, None, lora_request)
        ]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable = False,
        *,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        chat_template: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """Relevance of each (``data_1``, ``data_2``) pair (vLLM's ``LLM.score``): one text against
        each of the other side (1:N) or N against N in order. A one-label classifier reads each pair
        as one input (a cross-encoder: engine/classifier.py ``pair_prompt``, rendered with
        ``chat_template`` when given, else the model's score template; ``truncate_prompt_tokens``
        cuts the pair as transformers' truncation does, -1: to the model's context) and scores it
        with the config's activation (the sigmoid by default; the logit with
        ``PoolingParams(use_activation=False)``); any other model scores the cosine similarity of
        the two texts' embeddings."""
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        if not first or not second or (len(first) > 1 and len(first) != len(second)):
            raise ValueError(
                f"score takes 1:N or N:N texts, not {len(first)}:{len(second)} (and never an empty side)"
            )
        pairs = list(zip(first * len(second) if len(first) == 1 else first, second, strict=True))
        params = pooling_params or PoolingParams()
        if self.engine.model_runner.classifier is None:  # a bi-encoder: each distinct text embedded once
            if chat_template is not None:
                raise ValueError("chat_template is taken by cross-encoder models only")
            texts = list(dict.fromkeys([*first, *second]))
            unit = {
                text: (req, values)
                for text, (req, values) in zip(
                    texts,
                    self._embed_values(texts, params, truncate_prompt_tokens, lora_request),
                    strict=True,
                )
            }
            out = []
            for i, (a, b) in enumerate(pairs):
                (req_a, va), (req_b, vb) = unit[a], unit[b]
                out.append(
                    ScoringRequestOutput(
                        f"score-{i}",
                        req_a.prompt_token_ids + req_b.prompt_token_ids,
                        ScoringOutput(float(normalized(va) @ normalized(vb))),
                        req_a.num_cached_tokens + req_b.num_cached_tokens,
                    )
                )
            return out
        info = self._classifier("LLM.score", pairs=True)
        max_length = self.engine.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        prompts = [
            pair_prompt(
                self.tokenizer,
                a,
                b,
                use_sep_token=info.use_sep_token,
                template=chat_template if chat_template is not None else self.config.chat_template,
                max_length=max_length,
            )
            for a, b in pairs
        ]
        use_activation = params.use_activation is not False
        return [
            ScoringRequestOutput(
                req.request_id,
                req.prompt_token_ids,
                ScoringOutput(
                    float(activate(req.embedding, info.score_activation)[0])  # type: ignore[arg-type]
                    if use_activation
                    else float(req.embedding[0])  # type: ignore[index]
                ),
                req.num_cached_tokens,
            )
            for req in self._pool(prompts, [PoolingParams()] * len(prompts), lora_request)  # type: ignore[arg-type]
        ]

    def _embed_values(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParamsArg,
        truncate: int | None,
        lora_request: LoRAArg,
    ) -> list[tuple[Request, np.ndarray]]:
        """Each prompt's request and float64 embedding, cut and normalised as its params say."""
        if self.engine.model_runner.classifier is not None:
            raise ValueError("this model is a sequence classifier: use LLM.classify or LLM.score")
        prompt_list = _as_prompt_list(prompts)
        params = self._params_list(pooling_params, len(prompt_list), truncate)
        for p in params:
            if p.dimensions is not None:
                self._check_dimensions(p.dimensions)
        reqs = self._pool(prompt_list, params, lora_request)
        return [
            (req, (truncated if p.normalize is False else normalized)(req.embedding, p.dimensions))  # type: ignore[arg-type]
            for req, p in zip(reqs, params, strict=True)
        ]

    def _class_values(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParamsArg,
        truncate: int | None,
        lora_request: LoRAArg,
    ) -> list[tuple[Request, np.ndarray]]:
        """Each prompt's request and float64 label probabilities (its logits when the params say
        ``use_activation=False``)."""
        info = self._classifier("LLM.classify")
        prompt_list = _as_prompt_list(prompts)
        params = self._params_list(pooling_params, len(prompt_list), truncate)
        reqs = self._pool(prompt_list, params, lora_request)
        return [
            (
                req,
                truncated(req.embedding)  # type: ignore[arg-type]
                if p.use_activation is False
                else activate(req.embedding, info.classify_activation),  # type: ignore[arg-type]
            )
            for req, p in zip(reqs, params, strict=True)
        ]

    @staticmethod
    def _params_list(pooling_params: PoolingParamsArg, n: int, truncate: int | None) -> list[PoolingParams]:
        """One PoolingParams per prompt (one given for all, or one each); ``truncate`` (the call's
        ``truncate_prompt_tokens``) fills in where a params object names none."""
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            given = [pooling_params or PoolingParams()] * n
        else:
            given = list(pooling_params)
            if len(given) != n:
                raise ValueError(f"{len(given)} pooling params for {n} prompts")
        if truncate is None:
            return given
        return [
            p
            if p.truncate_prompt_tokens is not None
            else PoolingParams(**{**vars(p), "truncate_prompt_tokens": truncate})
            for p in given
        ]

    def _check_dimensions(self, dimensions: int) -> None:
        """``dimensions`` as vLLM allows it: on a Matryoshka model only, at a size it lists (when it
        lists them), never more than its hidden size."""
        engine = self.engine
        matryoshka = resolve_matryoshka(engine.model_config, engine.model_dir)
        if matryoshka is None:
            raise ValueError(
                "this model does not support matryoshka representation: its embeddings cannot be cut "
                "to fewer dimensions"
            )
        if matryoshka.dimensions is not None and dimensions not in matryoshka.dimensions:
            raise ValueError(
                f"this model supports only the matryoshka dimensions "
                f"{', '.join(map(str, matryoshka.dimensions))}, not {dimensions}"
            )
        if not 1 <= dimensions <= engine.model_config.hidden_size:
            raise ValueError(
                f"dimensions={dimensions} is not in 1..{engine.model_config.hidden_size} (the model's size)"
            )

    def _classifier(self, api: str, pairs: bool = False) -> ClassifierInfo:
        info = self.engine.model_runner.classifier
        if info is None:
            raise ValueError(f"{api} needs a sequence-classification model (*ForSequenceClassification)")
        if pairs and not info.scores_pairs:
            raise ValueError(
                f"{api} scores pairs with one-label classifiers only; this one has {info.num_labels}"
            )
        return info

    def _pool(
        self, prompts: list[Prompt], params: list[PoolingParams], lora_request: LoRAArg
    ) -> list[Request]:
        """Run each prompt (its last ``truncate_prompt_tokens`` tokens, when its params name them)
        as a pooling request to its end, with its LoRA adapter (one for all, or one per prompt);
        the requests, in prompt order."""
        self._check_ready()
        engine = self.engine
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        reqs = [
            engine.make_request(
                f"llm-{next(self._ids)}",
                self._truncated(p, pp.truncate_prompt_tokens),
                SamplingParams(max_tokens=1),
                pooling=True,
                lora_request=lora,
            )
            for p, pp, lora in zip(prompts, params, loras, strict=True)
        ]
        for req in reqs:
            engine.add_request(req)
        while engine.has_unfinished_requests():
            engine.step()
        return reqs

    def _truncated(self, prompt: Prompt, keep: int | None) -> Prompt:
        """``prompt``'s last ``keep`` tokens, as vLLM's ``truncate_prompt_tokens`` (-1: the model's
        context length); the prompt as given when ``keep`` is None."""
        if keep is None:
            return prompt
        limit = self.engine.max_model_len
        if keep == -1:
            keep = limit
        if not 1 <= keep <= limit:
            raise ValueError(
                f"truncate_prompt_tokens must be -1 or in 1..{limit} (the model's context), got {keep}"
            )
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return ids[-keep:]
