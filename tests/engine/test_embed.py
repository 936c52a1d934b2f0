"""Pooling requests (``LLM.embed``, ``make_request(pooling=True)``): the prompt's last hidden state,
equal to transformers' ``last_hidden_state``, whether chunked, mixed into a step with generating
requests, or served from the prefix cache; the request then frees its blocks. ``LLM.embed`` and
``LLM.encode`` answer in vLLM's shapes, normalised unless ``PoolingParams(normalize=False)``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, EmbeddingRequestOutput, PoolingParams, PoolingRequestOutput, SamplingParams

RAW = PoolingParams(normalize=False)


def raw_embed(llm: LLM, prompts: list) -> list[list[float]]:
    """The pooled hidden states themselves (not normalised), as vLLM's ``.outputs.embedding``."""
    return [o.outputs.embedding for o in llm.embed(prompts, pooling_params=RAW)]


def _hf_last_hidden(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts]


@pytest.mark.parametrize("model_fixture", ["tiny_qwen3", "tiny_deepseek"])
def test_embed_equals_transformers_chunked_mixed_and_cached(model_fixture, prompts, request) -> None:
    path = request.getfixturevalue(model_fixture)
    want = _hf_last_hidden(path, prompts)
    llm = LLM(str(path), num_kv_blocks=256, max_num_batched_tokens=48)  # 100+ token prompts are chunked
    engine = llm.engine
    gen = [
        engine.make_request(f"g{i}", p, SamplingParams(max_tokens=5, ignore_eos=True))
        for i, p in enumerate(prompts[:3])
    ]
    pool = [
        engine.make_request(f"e{i}", p, SamplingParams(max_tokens=1), pooling=True)
        for i, p in enumerate(prompts)
    ]
    for req in gen + pool:
        engine.add_request(req)
    mixed = False
    while engine.has_unfinished_requests():
        outs = engine.step()
        kinds = {o.embedding is not None for o in outs}
        mixed |= kinds == {True, False}  # a step that both pooled and sampled
    assert mixed
    assert all(len(r.output_token_ids) == 5 for r in gen)
    for req, w in zip(pool, want, strict=True):
        assert req.embedding is not None and len(req.embedding) == w.shape[0]
        assert float((torch.tensor(req.embedding) - w).abs().max()) < 1e-5
        assert req.output_token_ids == []  # nothing sampled
    again = raw_embed(llm, prompts)  # prefix-cache hits: only the last block is computed
    for e, w in zip(again, want, strict=True):
        assert float((torch.tensor(e) - w).abs().max()) < 1e-5
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0


def test_pooling_input_limit_is_the_context_not_context_minus_one(tiny_qwen3) -> None:
    llm = LLM(str(tiny_qwen3), num_kv_blocks=64, max_model_len=32)
    assert llm.embed([[5] * 32])[0].outputs.hidden_size == 64
    with pytest.raises(ValueError, match="the input has 33 tokens, more than max_model_len=32"):
        llm.embed([[5] * 33])
    vllm_shapes(llm)


def vllm_shapes(llm: LLM) -> None:
    """A vLLM script's use of ``embed`` and ``encode`` runs unchanged: EmbeddingRequestOutput /
    PoolingRequestOutput, unit vectors by default (vLLM's), the raw state with ``normalize=False``,
    ``num_cached_tokens``, ``truncate_prompt_tokens`` (the last N tokens) and per-prompt params."""
    ids = list(range(5, 25))  # 20 tokens: one full block of 16 is cached after the first run
    (raw,) = raw_embed(llm, [ids])
    unit = torch.tensor(raw, dtype=torch.float64) / torch.tensor(raw, dtype=torch.float64).norm()
    (out,) = llm.embed([{"prompt_token_ids": ids}], use_tqdm=True)
    assert isinstance(out, EmbeddingRequestOutput) and out.finished and out.prompt_token_ids == ids
    assert out.num_cached_tokens == 16  # the prefix cache served the first block
    assert float((torch.tensor(out.outputs.embedding, dtype=torch.float64) - unit).abs().max()) < 1e-7
    (enc,) = llm.encode([ids], pooling_task="embed")
    assert isinstance(enc, PoolingRequestOutput) and enc.outputs.data.dtype == torch.float32
    assert enc.outputs.data.tolist() == out.outputs.embedding
    assert llm.encode(ids)[0].outputs.data.tolist() == out.outputs.embedding  # the model's task: embed
    cut = llm.embed([ids, ids], truncate_prompt_tokens=4, pooling_params=[PoolingParams(), RAW])
    assert [o.prompt_token_ids for o in cut] == [ids[-4:]] * 2
    assert cut[1].outputs.embedding == raw_embed(llm, [ids[-4:]])[0]
    assert cut[0].outputs.embedding == llm.embed(ids[-4:])[0].outputs.embedding
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or in 1..32"):
        llm.embed([ids], truncate_prompt_tokens=33)
    with pytest.raises(ValueError, match="does not support matryoshka"):
        llm.embed([ids], pooling_params=PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="pooling_task must be one of embed, classify"):
        llm.encode([ids], pooling_task="token_embed")
    # A bi-encoder's score: the cosine of the two embeddings, with both texts' tokens and cache hits.
    a, b = llm.embed(["x = 1", "def f(): pass"])
    (score,) = llm.score("x = 1", "def f(): pass")
    cosine = sum(x * y for x, y in zip(a.outputs.embedding, b.outputs.embedding, strict=True))
    assert score.outputs.score == pytest.approx(cosine, abs=1e-6)
    assert score.prompt_token_ids == a.prompt_token_ids + b.prompt_token_ids
    assert score.num_cached_tokens == a.num_cached_tokens + b.num_cached_tokens
    with pytest.raises(ValueError, match="chat_template is taken by cross-encoder models only"):
        llm.score("a", "b", chat_template="{{ messages }}")


def test_a_base_model_saved_alone_serves_embeddings(tiny_qwen3, tmp_path: Path, prompts) -> None:
    """Qwen3-Embedding's layout: ``Qwen3Model``, tensors without the ``model.`` prefix, no lm_head."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    bare = tmp_path / "qwen3_embedding"
    shutil.copytree(tiny_qwen3, bare)
    weights = load_file(str(bare / "model.safetensors"))
    save_file(
        {k.removeprefix("model."): v for k, v in weights.items() if k != "lm_head.weight"},
        str(bare / "model.safetensors"),
    )
    cfg = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3Model"]}))
    want = _hf_last_hidden(tiny_qwen3, prompts[:4])
    for e, w in zip(raw_embed(LLM(str(bare), num_kv_blocks=64), prompts[:4]), want, strict=True):
        assert float((torch.tensor(e) - w).abs().max()) < 1e-5


def _hf_hidden_states(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


@pytest.mark.parametrize("pooling_type", ["mean", "cls"])
def test_mean_and_cls_pooling_equal_transformers_chunked_and_repeated(
    tiny_qwen3, prompts, pooling_type: str
) -> None:
    """Every prompt row counts (mean) or the first (cls), across chunks, and a repeated prompt is
    computed again rather than served from the prefix cache (its rows are not kept there)."""
    states = _hf_hidden_states(tiny_qwen3, prompts)
    want = [h.mean(dim=0) if pooling_type == "mean" else h[0] for h in states]
    llm = LLM(str(tiny_qwen3), num_kv_blocks=256, max_num_batched_tokens=48, pooling_type=pooling_type)
    assert llm.engine.model_info.pooling_type == pooling_type
    for _ in range(2):  # the second time every full block is in the prefix cache
        for e, w in zip(raw_embed(llm, prompts), want, strict=True):
            assert float((torch.tensor(e) - w).abs().max()) < 1e-5
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits == 0
    assert llm.engine.block_manager.num_used_blocks == 0


def test_pooling_type_auto_reads_the_sentence_transformers_config(
    tiny_qwen3, tmp_path: Path, prompts
) -> None:
    import json
    import shutil

    model = tmp_path / "st_model"
    shutil.copytree(tiny_qwen3, model)
    (model / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ]
        )
    )
    (model / "1_Pooling").mkdir()
    pooling = {
        "word_embedding_dimension": 64,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
    }
    (model / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    llm = LLM(str(model), num_kv_blocks=64)
    assert llm.engine.model_info.pooling_type == "mean"
    (state,) = _hf_hidden_states(tiny_qwen3, prompts[:1])
    assert float((torch.tensor(raw_embed(llm, prompts[:1])[0]) - state.mean(dim=0)).abs().max()) < 1e-5
    # A flag overrides the model's choice; a mode ferry lacks (max) falls back to the last token.
    assert LLM(str(model), num_kv_blocks=64, pooling_type="last").engine.model_info.pooling_type == "last"
    (model / "1_Pooling" / "config.json").write_text(
        json.dumps({**pooling, "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True})
    )
    assert LLM(str(model), num_kv_blocks=64).engine.model_info.pooling_type == "last"
    with pytest.raises(ValueError, match="pooling_type must be auto, last, mean or cls"):
        LLM(str(model), num_kv_blocks=64, pooling_type="max")
