"""Sequence-classification models (``*ForSequenceClassification``): what their outputs mean.

Such a checkpoint is a decoder (``model.*``) plus a ``score`` linear head ``[num_labels, hidden]``
and no ``lm_head``. The engine serves it as a pooling model whose result is the head's fp32 logits
over the pooled (by default the last token's) final-norm hidden state (``engine/model_runner.py``);
it never generates. This module, torch-free so that API server processes and the offline API share
it, says what those logits become (``engine/pooling.py`` ``activate`` applies it), as vLLM does (``vllm/model_executor/layers/pooler.py``):

* ``/classify`` (``LLM.classify``): by ``config.json``'s ``problem_type``: ``regression`` keeps the
  logits, ``multi_label_classification`` takes each one's sigmoid, anything else a softmax over the
  labels, or the sigmoid when there is one label. The label is ``id2label`` of the argmax.
* ``/score`` and ``/rerank`` (``LLM.score``), only for one-label models (cross-encoders): the
  sentence-transformers activation the config names (``sentence_transformers.activation_fn`` or
  ``sbert_ce_default_activation_function``; ``Identity`` keeps the logit), else the sigmoid.
  A pair is one input: the tokenizer's pair encoding of (query, document) (transformers'
  ``tokenizer(text=query, text_pair=document)``: its post-processor places the special tokens),
  or with ``use_sep_token: false`` (the older ``use_pad_token``) in the config, the two texts
  concatenated and encoded as one (vLLM's "LLM as reranker" models); or, when the server was
  given a ``--chat-template``, that template rendered over ``[{"role": "query", …}, {"role":
  "document", …}]`` (vLLM's score template).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ACTIVATIONS = ("softmax", "sigmoid", "identity")
# sentence-transformers' activation names (torch.nn.modules only, as vLLM allows) -> ours; softmax
# over one label is vLLM's PoolerClassify, the sigmoid.
_ST_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.Softmax": "sigmoid",
}


def is_classifier(architecture: str) -> bool:
    """transformers' naming: the decoder plus a ``score`` head."""
    return architecture.endswith("ForSequenceClassification")


@dataclass(frozen=True)
class ClassifierInfo:
    """What a classifier model's logits mean; carried in ``ModelInfo.classifier``."""

    num_labels: int
    labels: tuple[str, ...]  # config.json id2label by index (LABEL_i where it names none)
    classify_activation: str  # one of ACTIVATIONS
    score_activation: str
    use_sep_token: bool = True  # a scored pair: the tokenizer's pair encoding (else the texts joined)

    @property
    def scores_pairs(self) -> bool:
        """vLLM serves ``/score`` and ``/rerank`` on a classifier only when it has one label."""
        return self.num_labels == 1

    @property
    def routes(self) -> str:
        """The routes that serve it, for the 400 of one that does not."""
        return "/classify, /score or /rerank" if self.scores_pairs else "/classify"

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], num_labels: int) -> ClassifierInfo:
        """From ``config.json`` and the head's row count (ValueError where they disagree)."""
        id2label = raw.get("id2label") or {}
        if id2label and len(id2label) != num_labels:
            raise ValueError(
                f"config.json id2label names {len(id2label)} labels but the score head has {num_labels} rows"
            )
        labels = tuple(_label(id2label, i) for i in range(num_labels))
        problem = raw.get("problem_type") or ""
        if problem == "regression":
            classify = "identity"
        elif problem == "multi_label_classification" or num_labels < 2:
            classify = "sigmoid"
        else:
            classify = "softmax"
        st = raw.get("sentence_transformers")
        name = (st.get("activation_fn") if isinstance(st, Mapping) else None) or raw.get(
            "sbert_ce_default_activation_function"
        )
        score = "sigmoid"
        if name is not None:
            if name not in _ST_ACTIVATIONS:
                raise ValueError(
                    f"config.json names the cross-encoder activation {name!r}; ferry applies "
                    f"{', '.join(sorted(_ST_ACTIVATIONS))}"
                )
            score = _ST_ACTIVATIONS[name]
        sep = raw.get("use_pad_token", raw.get("use_sep_token", True))
        return cls(num_labels, labels, classify, score, bool(sep))


def _label(id2label: Mapping[Any, Any], i: int) -> str:
    """``id2label``'s name of label ``i``, else transformers' default ``LABEL_{i}`` (its configs name
    every label so, and a two-label config saved with those defaults writes no ``id2label``)."""
    value = id2label.get(str(i), id2label.get(i))
    return f"LABEL_{i}" if value is None else str(value)


def pair_prompt(
    tokenizer: Any,
    first: str,
    second: str,
    *,
    use_sep_token: bool = True,
    template: str | None = None,
    max_length: int | None = None,
) -> list[int]:
    """The token ids of one scored pair (see the module docstring). ``max_length`` truncates as
    transformers' ``truncation=True, max_length=…`` does (vLLM passes ``truncate_prompt_tokens`` so):
    from the right, the longer text first for a pair (the tokenizers library's ``longest_first``),
    special tokens included in the count."""
    if template is not None:
        messages = [{"role": "query", "content": first}, {"role": "document", "content": second}]
        return _cut(
            tokenizer.encode(tokenizer.apply_chat_template(messages, chat_template=template)), max_length
        )
    if not use_sep_token:
        return _cut(tokenizer.encode(first + second), max_length)
    backend = tokenizer.backend
    a = backend.encode(first, add_special_tokens=False)
    b = backend.encode(second, add_special_tokens=False)
    if max_length is not None:
        processor = backend.post_processor
        budget = max_length - (processor.num_special_tokens_to_add(True) if processor is not None else 0)
        if budget < 0:
            raise ValueError(f"max_length={max_length} leaves no room for the pair's special tokens")
        n1, n2 = _longest_first(len(a.ids), len(b.ids), budget)
        a.truncate(n1)
        b.truncate(n2)
    return list(backend.post_process(a, b, add_special_tokens=True).ids)


def _cut(ids: list[int], max_length: int | None) -> list[int]:
    return ids if max_length is None else ids[:max_length]


def _longest_first(n1: int, n2: int, budget: int) -> tuple[int, int]:
    """Lengths the two texts keep under ``budget`` tokens, as the tokenizers library's
    ``LongestFirst`` truncation: the shorter kept whole when it fits in half, else both cut to
    about half."""
    if n1 + n2 <= budget:
        return n1, n2
    swap = n1 > n2
    short, long_ = (n2, n1) if swap else (n1, n2)
    long_ = short if short > budget else max(short, budget - short)
    if short + long_ > budget:
        short = budget // 2
        long_ = short + budget % 2
    return (long_, short) if swap else (short, long_)
