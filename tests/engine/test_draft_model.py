"""Speculative decoding with a draft model (engine/draft_model.py): outputs token for token those of
decoding without drafts, whatever the draft; a draft that is a copy of the target has every draft
accepted (exact counts), which holds only if its KV is right for every position it attends to:
through chunked prefill, preemption, prefix-cache and partial-block hits, and KV loaded from a tier.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.demo import build_layer_draft, build_lora_adapter, build_model
from engine.sampling_params import StructuredOutputsParams
from engine.spec_decode import SpeculativeConfig
from tests.engine.test_kv_connector_hooks import AsyncCopyConnector, CopyConnector, _attach

K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
PROMPTS = [[7, 8, 9, 10, 11] * 12, [5, 6, 7], list(range(20, 120)), [3, 4] * 30 + [50, 51, 52]]


def _spec(draft: Path, k: int = K) -> dict:
    return {"model": str(draft), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def copy_draft(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("draft") / "copy"
    shutil.copytree(tiny_llama, out)
    return out


@pytest.fixture(scope="module")
def layer_draft(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's first layer alone, with its embeddings and head: a smaller model that agrees
    with the target on some tokens."""
    return build_layer_draft(tmp_path_factory.mktemp("draft") / "one_layer", tiny_llama, 1)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another random model with the same vocabulary: half the width, one layer."""
    out = tmp_path_factory.mktemp("draft") / "random"
    return build_model(
        out, "llama", seed=41, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), num_kv_blocks=256, deterministic=True)


def _ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def _same(a, b) -> None:
    assert _ids(a) == _ids(b)
    for x, y in zip(a, b, strict=True):
        for cx, cy in zip(x.outputs, y.outputs, strict=True):
            assert (cx.text, cx.finish_reason) == (cy.text, cy.finish_reason)


def _counts(llm: LLM) -> tuple[int, int, int, tuple[int, ...]]:
    s = llm.engine.stats()
    return (
        s.spec_decode_num_drafts,
        s.spec_decode_num_draft_tokens,
        s.spec_decode_num_accepted_tokens,
        s.spec_decode_accepted_per_position,
    )


def _copy_kv_is_the_targets(llm: LLM) -> None:
    """With a copy of the target as draft, every slot holds the same KV in both caches: the draft
    computed each position the target did (and only drafts the target then computed too)."""
    runner = llm.engine.model_runner
    for target, draft in zip(runner.kv_caches, runner.draft.kv_caches, strict=True):
        for t, d in zip(target, draft, strict=True):
            assert t.abs().sum() > 0 and torch.equal(t, d)


def _drained(llm: LLM) -> None:
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_used_blocks == 0


def test_config_parses_as_vllm() -> None:
    parse = SpeculativeConfig.parse
    want = SpeculativeConfig("draft_model", 4, model="/d")
    assert parse({"model": "/d", "num_speculative_tokens": 4}) == want
    assert parse(json.dumps({"method": "draft_model", "model": "/d", "num_speculative_tokens": 4})) == want
    assert parse(
        {"model": "/d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1, "max_model_len": 64}
    ) == SpeculativeConfig("draft_model", 2, model="/d", max_model_len=64)
    for bad, match in (
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
        ({"model": "/d"}, "needs num_speculative_tokens"),
        ({"model": "/d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "must be 1"),
        ({"model": "/d", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "only for method 'ngram'"),
        ({"model": "/d", "num_speculative_tokens": 2, "quantization": "int3"}, "quantization must be"),
        ({"model": "/d", "num_speculative_tokens": 2, "max_model_len": 0}, "integer >= 1"),
        ({"model": "/d", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown field"),
    ):
        with pytest.raises(ValueError, match=match):
            parse(bad)


def test_a_copy_of_the_target_has_every_draft_accepted(tiny_llama, copy_draft, reference) -> None:
    spec = LLM(str(tiny_llama), num_kv_blocks=256, deterministic=True, speculative_config=_spec(copy_draft))
    _same(reference.generate(PROMPTS, GREEDY), spec.generate(PROMPTS, GREEDY))
    # Each request: its first token from the prefill, then 7 steps of 3 drafts all accepted (4
    # tokens each: 29), then one step without room for drafts (30).
    n = len(PROMPTS)
    assert _counts(spec) == (7 * n, 21 * n, 21 * n, (7 * n,) * K)
    assert spec.engine.generation_tokens_total == 30 * n
    _copy_kv_is_the_targets(spec)
    _drained(spec)


def test_a_different_draft_changes_nothing(tiny_llama, random_draft, layer_draft, reference) -> None:
    free = reference.generate(PROMPTS[:1], GREEDY)[0].outputs[0]
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=30, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.7, seed=6, max_tokens=30, ignore_eos=True, n=2),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[free.text[-8:-3]]),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[free.token_ids[12]]),
    ]
    prompts = [p for p in PROMPTS for _ in params]
    mixed = params * len(PROMPTS)
    want = reference.generate(prompts, mixed)
    for draft in (random_draft, layer_draft):
        spec = LLM(str(tiny_llama), num_kv_blocks=256, deterministic=True, speculative_config=_spec(draft, 4))
        got = spec.generate(prompts, mixed)
        _same(want, got)
        assert [c.logprobs is None for o in want for c in o.outputs] == [
            c.logprobs is None for o in got for c in o.outputs
        ]
        drafts, drafted, accepted, per_position = _counts(spec)
        assert drafts > 0 and drafted > accepted and sum(per_position) == accepted
        _drained(spec)
    assert accepted > 0  # the one-layer draft agrees with the target now and then


def test_chunks_preemption_and_prefix_hits_keep_the_drafts_kv(tiny_llama, copy_draft, layer_draft) -> None:
    # 32 tokens a step (prompts in chunks), 18 blocks of 16 for 4 sequences at once (preempted and
    # recomputed), then the same prompts again (prefix-cache hits).
    options = {"deterministic": True, "max_num_batched_tokens": 32, "num_kv_blocks": 18, "max_num_seqs": 4}
    # Beside them a structured-outputs request, never drafted for: the draft computes its KV too.
    choice = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    prompts, params = [*PROMPTS, list(range(40, 90))], [GREEDY] * len(PROMPTS) + [choice]
    base = LLM(str(tiny_llama), **options)
    want = base.generate(prompts, params)
    for draft in (copy_draft, layer_draft):
        spec = LLM(str(tiny_llama), speculative_config=_spec(draft), **options)
        _same(want, spec.generate(prompts, params))
        assert spec.engine.scheduler.num_preemptions > 0
        _same(want, spec.generate(prompts, params))
        stats = spec.engine.stats()
        assert stats.prefix_cache_hits > 0
        _drained(spec)
        if draft is copy_draft:
            _, drafted, accepted, _ = _counts(spec)
            assert drafted == accepted > 0
            _copy_kv_is_the_targets(spec)


def test_a_partial_block_hit_copies_the_drafts_kv(tiny_llama, copy_draft, reference) -> None:
    spec = LLM(str(tiny_llama), num_kv_blocks=64, deterministic=True, speculative_config=_spec(copy_draft))
    prompt = list(range(300, 340))
    first = spec.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    # The next turn: its third block starts with the 12 tokens of the first one's cached partial block.
    turn = prompt + first[0].outputs[0].token_ids + [7, 8, 9]
    _same(reference.generate([turn], GREEDY), spec.generate([turn], GREEDY))
    assert spec.engine.stats().partial_prefix_hits == 12
    _copy_kv_is_the_targets(spec)
    assert _counts(spec)[1:3] == (3 + 21, 3 + 21)
    _drained(spec)


def test_priority_scheduling_and_lora_on_the_target(tiny_llama, layer_draft, tmp_path) -> None:
    adapter = build_lora_adapter(tmp_path / "a", tiny_llama, seed=1, rank=8, alpha=16)
    lora = LoRARequest("a", 1, str(adapter))
    options = {
        "deterministic": True,
        "num_kv_blocks": 12,
        "max_num_seqs": 2,
        "enable_lora": True,
        "scheduling_policy": "priority",
    }
    loras = [lora, None, lora, None]
    priority = [3, 2, 1, 0]  # later arrivals preempt earlier ones
    base = LLM(str(tiny_llama), **options)
    spec = LLM(str(tiny_llama), speculative_config=_spec(layer_draft), **options)
    want = base.generate(PROMPTS, GREEDY, lora_request=loras, priority=priority)
    _same(want, spec.generate(PROMPTS, GREEDY, lora_request=loras, priority=priority))
    assert spec.engine.scheduler.num_preemptions > 0
    _drained(spec)


@pytest.mark.parametrize("connector", [CopyConnector, AsyncCopyConnector])
def test_kv_loaded_from_a_tier_is_recomputed_for_the_draft(tiny_llama, copy_draft, connector) -> None:
    prompt = list(range(1, 200))
    source = LLM(str(tiny_llama), num_kv_blocks=64, deterministic=True)
    want = source.generate([prompt], GREEDY)
    spec = LLM(str(tiny_llama), num_kv_blocks=64, deterministic=True, speculative_config=_spec(copy_draft))
    conn = connector(source)
    if isinstance(conn, AsyncCopyConnector):
        conn.release.set()
    _attach(spec, conn)  # the tier holds the target's KV only: the draft's blocks stay zero
    got = spec.generate([prompt], GREEDY)
    _same(want, got)
    assert got[0].num_cached_tokens == 192
    assert _counts(spec)[1:3] == (21, 21)
    _copy_kv_is_the_targets(spec)  # the draft recomputed the 192 loaded positions
    _drained(spec)


def test_drafts_that_cannot_run_are_refused_at_startup(tiny_llama, tmp_path) -> None:
    small_vocab = build_model(tmp_path / "v", "llama", hidden_size=32, tokenizer_vocab_size=900)
    with pytest.raises(ValueError, match="has vocab_size .* the target 1"):
        LLM(str(tiny_llama), speculative_config=_spec(small_vocab))
    alien = tmp_path / "alien"
    alien.mkdir()
    (alien / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "vocab_size": 8}))
    with pytest.raises(ValueError, match="unsupported architecture 'FooForCausalLM'"):
        LLM(str(tiny_llama), speculative_config=_spec(alien))
    with pytest.raises(
        ValueError, match="speculative_config model .*: --quantization awq: the checkpoint is not quantized"
    ):
        LLM(str(tiny_llama), speculative_config={**_spec(tiny_llama), "quantization": "awq"})
    with pytest.raises(ValueError, match="max_model_len=4096 is more than the 1024 positions of the draft"):
        LLM(str(tiny_llama), speculative_config={**_spec(tiny_llama), "max_model_len": 4096})


def test_the_drafts_kv_takes_its_share_of_every_block(tiny_llama, layer_draft) -> None:
    # A block of the target's KV: 2 layers x 16 slots x (k, v) x 2 heads x 16 dims x 4 bytes; the
    # one-layer draft's: half that.
    budget = 10 * (8192 + 4096) + 4095
    plain = LLM(str(tiny_llama), kv_cache_memory_bytes=budget)
    spec = LLM(str(tiny_llama), kv_cache_memory_bytes=budget, speculative_config=_spec(layer_draft))
    assert plain.engine.model_runner.bytes_per_block == spec.engine.model_runner.bytes_per_block == 8192
    assert spec.engine.model_runner.kv_bytes_per_block == 8192 + 4096
    assert (plain.engine.block_manager.num_blocks, spec.engine.block_manager.num_blocks) == (15, 10)
    assert [c.shape[0] for c in spec.engine.model_runner.draft.kv_caches[0]] == [10, 10]


def test_sequences_past_the_drafts_max_model_len_get_no_drafts(tiny_llama, copy_draft, reference) -> None:
    spec = LLM(
        str(tiny_llama),
        num_kv_blocks=64,
        deterministic=True,
        speculative_config={**_spec(copy_draft), "max_model_len": 66},
    )
    _same(reference.generate(PROMPTS[:1], GREEDY), spec.generate(PROMPTS[:1], GREEDY))
    # 61 tokens: 3 drafts (positions 60..62 fed); 65 tokens: 2 (64, 65); 68 tokens: none fit.
    assert _counts(spec) == (2, 5, 5, (2, 2, 1))


def test_a_tier_loads_recompute_is_cut_to_the_step_budget(tiny_llama, copy_draft) -> None:
    """The 192 positions loaded from the tier are recomputed for the draft in forwards of at most
    ``max_num_batched_tokens`` (the activation reserve's bound), with the same KV as one forward."""
    prompt = list(range(1, 200))
    source = LLM(str(tiny_llama), num_kv_blocks=64, deterministic=True)
    want = source.generate([prompt], GREEDY)
    spec = LLM(
        str(tiny_llama),
        num_kv_blocks=64,
        deterministic=True,
        max_num_batched_tokens=48,
        speculative_config=_spec(copy_draft),
    )
    _attach(spec, CopyConnector(source))
    draft = spec.engine.model_runner.draft.model
    sizes: list[int] = []
    forward = draft.forward

    def observe(input_ids, *args):  # noqa: ANN001, ANN202
        sizes.append(len(input_ids))
        return forward(input_ids, *args)

    draft.forward = observe
    got = spec.generate([prompt], GREEDY)
    _same(want, got)
    assert got[0].num_cached_tokens == 192
    assert max(sizes) == 48 and sizes[:4] == [48, 48, 48, 48]  # the loaded 192, then the prompt's rest
    _copy_kv_is_the_targets(spec)
    _drained(spec)


def test_a_draft_kept_on_the_host_through_level_2_comes_back_with_the_weights(tiny_llama, copy_draft) -> None:
    """Level 2 drops the target's weights and keeps the draft's in host memory; installing weights
    again (waking) brings the draft back to the device too, or its first forward would mix devices.
    ``meta`` stands for the accelerator (a CPU device keeps everything where it is)."""
    import gc

    llm = LLM(str(tiny_llama), num_kv_blocks=32, enable_sleep_mode=True, speculative_config=_spec(copy_draft))
    runner = llm.engine.model_runner

    def draft_devices() -> set[str]:
        found, seen, stack = set(), set(), [runner.draft.model]
        while stack:  # every tensor the draft holds, by the garbage collector's referents
            obj = stack.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                found.add(obj.device.type)
            elif isinstance(obj, (list, tuple, dict)) or type(obj).__module__.startswith("engine.models"):
                stack.extend(gc.get_referents(obj))
        return found

    weights = runner.read_weights(tiny_llama, torch.device("cpu"))
    runner.device = torch.device("meta")
    runner.discard_weights()
    assert runner.model is None and draft_devices() == {"cpu"}
    runner.install_weights(weights)
    assert draft_devices() == {"meta"}
