"""Sequence-classification models (``engine/classifier.py``): ``LLM.classify``'s logits equal
transformers' ``AutoModelForSequenceClassification`` (Llama, three labels; Gemma 2, two; a Qwen3
cross-encoder, one), chunked and batched; probs are the config's activation; ``LLM.score`` on a
one-label model reads each pair as transformers' pair encoding (truncated as transformers truncates);
generation, embeddings and pair scoring are refused where they do not apply; what config.json says
about activations and labels. vLLM's call forms run unchanged: ``encode``, ``PoolingParams``
(``use_activation=False``: the logits), ``num_cached_tokens``, ``score(chat_template=)``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, PoolingParams
from engine.classifier import ClassifierInfo

TEXTS = ["def parse_args(argv):", "import os\nimport sys\n\nprint(sys.argv)", "x = 1"]
DOCS = ["import argparse\nparser = argparse.ArgumentParser()", "x = 1", "def parse(argv):"]
SCORE_TEMPLATE = (
    "{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] + '</' + m['role'] + '>' }}{% endfor %}"
)
LOGITS = PoolingParams(use_activation=False)


def _hf_logits(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in prompts]


def _close(got: list[float], want: torch.Tensor, tol: float = 1e-4) -> bool:
    return len(got) == want.shape[0] and float((torch.tensor(got) - want).abs().max()) < tol


@pytest.mark.parametrize(
    ("model_fixture", "num_labels"),
    [("tiny_llama_cls", 3), ("tiny_gemma2_cls", 2), ("tiny_cross_encoder", 1)],
)
def test_classify_equals_transformers(model_fixture: str, num_labels: int, prompts, request) -> None:
    path = request.getfixturevalue(model_fixture)
    chosen = prompts[2:9]  # 5..160 tokens: the long ones are prefilled in chunks of 48
    want = _hf_logits(path, chosen)
    llm = LLM(str(path), num_kv_blocks=128, max_num_batched_tokens=48)
    info = llm.engine.model_info.classifier
    assert info is not None and info.num_labels == num_labels
    outs = llm.classify(chosen)
    assert [o.prompt_token_ids for o in outs] == chosen
    for out, w in zip(outs, want, strict=True):
        assert out.outputs.num_classes == num_labels and _close(out.outputs.logits, w)
        probs = torch.softmax(w, -1) if num_labels > 1 else torch.sigmoid(w)
        assert _close(out.outputs.probs, probs, 1e-5)
    again = llm.classify([chosen[0], *chosen])  # a prefix-cache hit, and a repeated prompt in one batch
    assert _close(again[0].outputs.logits, want[0]) and _close(again[1].outputs.logits, want[0])
    assert llm.engine.block_manager.num_used_blocks == 0


def test_classify_takes_text_and_labels_come_from_the_config(tiny_llama_cls: Path) -> None:
    llm = LLM(str(tiny_llama_cls), num_kv_blocks=64)
    info = llm.engine.model_info.classifier
    assert info == ClassifierInfo(3, ("negative", "neutral", "positive"), "softmax", "sigmoid", True)
    outs = llm.classify(TEXTS)
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    assert [o.prompt_token_ids for o in outs] == ids
    for out, w in zip(outs, _hf_logits(tiny_llama_cls, ids), strict=True):
        assert _close(out.outputs.logits, w)
        assert abs(sum(out.outputs.probs) - 1.0) < 1e-9
    # 48 tokens, unseen; then the first two of its three blocks are served from the prefix cache (the
    # last holds the token that must be computed).
    long = "class A:\n    pass\n" * 6
    first, again = llm.classify([long], use_tqdm=True, lora_request=None), llm.classify(long)
    assert len(first[0].prompt_token_ids) == 48 and first[0].num_cached_tokens == 0
    assert again[0].num_cached_tokens == 32
    (raw,) = llm.classify(long, pooling_params=LOGITS)
    assert raw.outputs.probs == raw.outputs.logits == again[0].outputs.logits
    for task in ("classify", None):  # None: the model's task
        (enc,) = llm.encode([long], pooling_task=task)
        assert enc.outputs.data.dtype == torch.float32
        assert enc.outputs.data.tolist() == torch.tensor(again[0].outputs.probs, dtype=torch.float32).tolist()
    assert llm.encode([long], LOGITS, pooling_task="classify")[0].outputs.data.tolist() == pytest.approx(
        raw.outputs.logits, abs=1e-6
    )
    with pytest.raises(ValueError, match="use LLM.classify or LLM.score"):
        llm.encode([long], pooling_task="embed")


def test_cross_encoder_scores_the_pair_encoding(tiny_cross_encoder: Path) -> None:
    """A pair is transformers' ``tokenizer(text=query, text_pair=doc)`` (here ``q <|im_start|> d
    <|im_end|>``), its score the sigmoid of the logit; ``truncate_prompt_tokens`` cuts as
    transformers' ``truncation=True, max_length=N`` does (the longer text first)."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast.from_pretrained(str(tiny_cross_encoder))
    llm = LLM(str(tiny_cross_encoder), num_kv_blocks=64)
    query = TEXTS[0]
    pair_ids = [hf_tok(text=query, text_pair=d)["input_ids"] for d in DOCS]
    assert all(ids[-1] == 2 and 1 in ids for ids in pair_ids)  # the special tokens are there
    want = [torch.sigmoid(w)[0].item() for w in _hf_logits(tiny_cross_encoder, pair_ids)]
    one_to_n = llm.score(query, DOCS)
    assert [o.prompt_token_ids for o in one_to_n] == pair_ids
    assert all(abs(o.outputs.score - w) < 1e-5 for o, w in zip(one_to_n, want, strict=True))
    n_to_n = llm.score([query] * 3, DOCS)
    assert [o.outputs.score for o in n_to_n] == pytest.approx([o.outputs.score for o in one_to_n], abs=1e-6)
    for n in (3, 6, 9, 12, 40):
        cut = llm.score(query, DOCS, truncate_prompt_tokens=n)
        assert [o.prompt_token_ids for o in cut] == [
            hf_tok(text=query, text_pair=d, truncation=True, max_length=n)["input_ids"] for d in DOCS
        ], n
    with pytest.raises(ValueError, match="1:N or N:N"):
        llm.score([query, query], DOCS)
    # vLLM's keyword arguments: the logit itself, a score template for this call, the cache count.
    logits = llm.score(query, DOCS, pooling_params=LOGITS, use_tqdm=False)
    assert [torch.sigmoid(torch.tensor(o.outputs.score)).item() for o in logits] == pytest.approx(
        want, abs=1e-5
    )
    assert [o.num_cached_tokens for o in logits] == [16 if len(ids) > 16 else 0 for ids in pair_ids]
    (templated,) = llm.score(query, DOCS[0], chat_template=SCORE_TEMPLATE)
    assert templated.prompt_token_ids == llm.tokenizer.encode(
        f"<query>{query}</query><document>{DOCS[0]}</document>"
    )


def test_use_sep_token_false_joins_the_texts(tiny_cross_encoder: Path, tmp_path: Path) -> None:
    import json
    import shutil

    joined = tmp_path / "llm_reranker"
    shutil.copytree(tiny_cross_encoder, joined)
    cfg = json.loads((joined / "config.json").read_text())
    (joined / "config.json").write_text(json.dumps({**cfg, "use_sep_token": False}))
    llm = LLM(str(joined), num_kv_blocks=64)
    (out,) = llm.score(TEXTS[0], DOCS[0])
    assert out.prompt_token_ids == llm.tokenizer.encode(TEXTS[0] + DOCS[0])


def test_what_a_classifier_refuses(tiny_llama_cls: Path, tiny_qwen3: Path) -> None:
    llm = LLM(str(tiny_llama_cls), num_kv_blocks=64)
    with pytest.raises(ValueError, match="is a sequence classifier and does not generate text"):
        llm.generate("x = 1")
    with pytest.raises(ValueError, match="use LLM.classify or LLM.score"):
        llm.embed("x = 1")
    with pytest.raises(ValueError, match="one-label classifiers only; this one has 3"):
        llm.score("a", "b")
    with pytest.raises(ValueError, match="needs a sequence-classification model"):
        LLM(str(tiny_qwen3), num_kv_blocks=64).classify("x = 1")


@pytest.mark.parametrize(
    ("extra", "labels", "classify", "score"),
    [
        ({}, 3, "softmax", "sigmoid"),
        ({}, 1, "sigmoid", "sigmoid"),
        ({"problem_type": "regression"}, 1, "identity", "sigmoid"),
        ({"problem_type": "multi_label_classification"}, 3, "sigmoid", "sigmoid"),
        ({"problem_type": "single_label_classification"}, 2, "softmax", "sigmoid"),
        (
            {"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}},
            1,
            "sigmoid",
            "identity",
        ),
        (
            {"sbert_ce_default_activation_function": "torch.nn.modules.activation.Sigmoid"},
            1,
            "sigmoid",
            "sigmoid",
        ),
    ],
)
def test_activations_follow_the_config(extra: dict, labels: int, classify: str, score: str) -> None:
    info = ClassifierInfo.from_config(extra, labels)
    assert (info.classify_activation, info.score_activation) == (classify, score)
    assert info.labels == tuple(f"LABEL_{i}" for i in range(labels)) and info.use_sep_token


def test_config_mistakes_are_refused() -> None:
    with pytest.raises(ValueError, match="id2label names 2 labels but the score head has 3 rows"):
        ClassifierInfo.from_config({"id2label": {"0": "a", "1": "b"}}, 3)
    with pytest.raises(ValueError, match="cross-encoder activation 'torch.nn.modules.activation.Tanh'"):
        ClassifierInfo.from_config(
            {"sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"}, 1
        )
    assert not ClassifierInfo.from_config({"use_pad_token": False}, 1).use_sep_token


def test_a_chat_template_is_the_score_template(tiny_cross_encoder: Path) -> None:
    """vLLM's score template: the ``chat_template`` option rendered over a query and a document
    message (Qwen3-Reranker's prompt format is served so), then encoded as one text."""
    llm = LLM(str(tiny_cross_encoder), num_kv_blocks=64, chat_template=SCORE_TEMPLATE)
    (out,) = llm.score(TEXTS[0], DOCS[0])
    text = f"<query>{TEXTS[0]}</query><document>{DOCS[0]}</document>"
    assert out.prompt_token_ids == llm.tokenizer.encode(text)
    (logit,) = _hf_logits(tiny_cross_encoder, [out.prompt_token_ids])
    assert abs(out.outputs.score - torch.sigmoid(logit)[0].item()) < 1e-5


def test_a_two_label_config_without_id2label_names_transformers_defaults(tmp_path: Path) -> None:
    """transformers writes no ``id2label`` for a two-label model with its default names, and reads
    it back as ``LABEL_0`` / ``LABEL_1`` (which vLLM answers): so does ``/classify``'s label."""
    import json

    from transformers import AutoConfig

    from engine.demo import build_model
    from engine.models.config import read_hf_config

    path = build_model(tmp_path / "two", "llama", seed=8, num_labels=2)
    assert "id2label" not in json.loads((path / "config.json").read_text())
    info = ClassifierInfo.from_config(read_hf_config(path, None), 2)
    assert (
        info.labels
        == ("LABEL_0", "LABEL_1")
        == tuple(AutoConfig.from_pretrained(str(path)).id2label.values())
    )
