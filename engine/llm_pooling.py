"""The offline ``LLM``'s pooling APIs, as vLLM's: ``embed`` (each prompt's pooled hidden state),
``classify`` (a ``*ForSequenceClassification`` model's labels) and ``score`` (text pairs, by a
cross-encoder or by the cosine of two embeddings). ``LLM`` inherits ``LLMPooling``; generation,
chat and the engine's lifetime stay in ``engine/llm.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.classifier import ClassifierInfo, pair_prompt
from engine.llm_prompts import Prompt, _as_prompt_list
from engine.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from engine.pooling import activate, normalized
from engine.sampling_params import SamplingParams
from engine.sequence import Request


class LLMPooling:
    """``LLM``'s ``embed``, ``classify`` and ``score``. Uses its ``engine``, ``tokenizer``,
    ``config``, ``_ids`` and ``_check_ready``."""

    def embed(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = False) -> list[list[float]]:
        """Each prompt's pooled hidden state (after the final norm, fp32, not normalised), in prompt
        order: by default the last token's, the embedding of decoder models such as Qwen3-Embedding
        (``pooling_type``: engine/pooler.py)."""
        if self.engine.model_runner.classifier is not None:
            raise ValueError("this model is a sequence classifier: use LLM.classify or LLM.score")
        return [req.embedding for req in self._pool(_as_prompt_list(prompts))]  # type: ignore[misc]

    def classify(
        self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = False
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's classification by a ``*ForSequenceClassification`` model, in prompt order
        (vLLM's ``LLM.classify``): ``.outputs.probs`` (softmax over the labels, or the sigmoid for
        one label, as the config says: engine/classifier.py) and ``.outputs.logits`` (the head's)."""
        info = self._classifier("LLM.classify")
        return [
            ClassificationRequestOutput(
                req.request_id,
                req.prompt_token_ids,
                ClassificationOutput(
                    activate(req.embedding, info.classify_activation).tolist(), req.embedding
                ),  # type: ignore[arg-type]
            )
            for req in self._pool(_as_prompt_list(prompts))
        ]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[ScoringRequestOutput]:
        """Relevance of each (``data_1``, ``data_2``) pair (vLLM's ``LLM.score``): one text against
        each of the other side (1:N) or N against N in order. A one-label classifier reads each pair
        as one input (a cross-encoder: engine/classifier.py ``pair_prompt``; ``truncate_prompt_tokens``
        cuts the pair as transformers' truncation does, -1: to the model's context) and scores it
        with the config's activation (the sigmoid by default); any other model scores the cosine
        similarity of the two texts' embeddings."""
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        if not first or not second or (len(first) > 1 and len(first) != len(second)):
            raise ValueError(
                f"score takes 1:N or N:N texts, not {len(first)}:{len(second)} (and never an empty side)"
            )
        pairs = list(zip(first * len(second) if len(first) == 1 else first, second, strict=True))
        info = self.engine.model_runner.classifier
        if info is None:  # a bi-encoder: each distinct text embedded once
            texts = list(dict.fromkeys([*first, *second]))
            unit = dict(zip(texts, (normalized(e) for e in self.embed(texts)), strict=True))
            return [
                ScoringRequestOutput(f"score-{i}", [], ScoringOutput(float(unit[a] @ unit[b])))
                for i, (a, b) in enumerate(pairs)
            ]
        info = self._classifier("LLM.score", pairs=True)
        max_length = self.engine.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        prompts = [
            pair_prompt(
                self.tokenizer,
                a,
                b,
                use_sep_token=info.use_sep_token,
                template=self.config.chat_template,
                max_length=max_length,
            )
            for a, b in pairs
        ]
        return [
            ScoringRequestOutput(
                req.request_id,
                req.prompt_token_ids,
                ScoringOutput(float(activate(req.embedding, info.score_activation)[0])),  # type: ignore[arg-type]
            )
            for req in self._pool(prompts)  # type: ignore[arg-type]
        ]

    def _classifier(self, api: str, pairs: bool = False) -> ClassifierInfo:
        info = self.engine.model_runner.classifier
        if info is None:
            raise ValueError(f"{api} needs a sequence-classification model (*ForSequenceClassification)")
        if pairs and not info.scores_pairs:
            raise ValueError(
                f"{api} scores pairs with one-label classifiers only; this one has {info.num_labels}"
            )
        return info

    def _pool(self, prompts: list[Prompt]) -> list[Request]:
        """Run each prompt as a pooling request to its end; the requests, in prompt order."""
        self._check_ready()
        engine = self.engine
        reqs = [
            engine.make_request(f"llm-{next(self._ids)}", p, SamplingParams(max_tokens=1), pooling=True)
            for p in prompts
        ]
        for req in reqs:
            engine.add_request(req)
        while engine.has_unfinished_requests():
            engine.step()
        return reqs
