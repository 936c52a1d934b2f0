"""LoRA adapters (engine/lora.py): the same tokens and logprobs as transformers running the
adapter merged into the weights (``W + scale * B @ A``), whether a request runs alone or beside
the base model and other adapters in one step; blocks keyed apart per adapter; ``max_loras``
held by the scheduler; adapters ferry cannot apply exactly refused by name."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, LoRARequest, SamplingParams
from engine.demo import build_lora_adapter
from engine.lora import adapter_weights_id
from kvcache.keys import block_hashes, lora_extra

MAX_NEW = 10
FUSED_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Phi-3's checkpoint names


def merged_checkpoint(model_dir: Path, adapter_dir: Path, out: Path) -> Path:
    """A copy of the model with the adapter merged into its weights, as PEFT's ``merge_and_unload``."""
    if out.exists():
        return out
    shutil.copytree(model_dir, out)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    lora = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for path in out.glob("*.safetensors"):
        weights = load_file(str(path))
        for key, a in lora.items():
            if not key.endswith(".lora_A.weight"):
                continue
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            if name in weights:
                b = lora[key.replace("lora_A", "lora_B")]
                r = a.shape[0]
                scale = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
                weights[name] = (weights[name].double() + scale * (b.double() @ a.double())).to(
                    weights[name].dtype
                )
        save_file(weights, str(path), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "a": build_lora_adapter(root / "a", tiny_llama, seed=1, rank=8, alpha=16),
        # rsLoRA, attention only, another rank
        "b": build_lora_adapter(
            root / "b", tiny_llama, seed=2, rank=4, alpha=8, targets=("q_proj", "v_proj"), use_rslora=True
        ),
    }


def _run(llm: LLM, prompts, params, loras):
    return [o.outputs[0] for o in llm.generate(prompts, params, lora_request=loras)]


@pytest.mark.parametrize(
    ("model_fixture", "targets"),
    [
        ("tiny_qwen2", None),  # q/k/v bias
        ("tiny_phi3", FUSED_TARGETS),  # fused qkv_proj / gate_up_proj
        ("tiny_granite", None),  # multipliers around the projections
        ("tiny_qwen3_moe", None),  # experts take none: attention everywhere, the MLP of the dense layer
        ("tiny_gemma3", None),  # sandwich norms, GELU MLP, sliding and global layers
        ("tiny_olmo2", None),  # norms after each block
        ("tiny_gpt_oss", ("q_proj", "k_proj", "v_proj", "o_proj")),  # attention with sinks; experts take none
    ],
)
def test_adapter_matches_transformers_merged(
    model_fixture, targets, prompts, hf_reference, request, tmp_path
):
    path = request.getfixturevalue(model_fixture)
    kwargs = {} if targets is None else {"targets": targets}
    adapter = build_lora_adapter(tmp_path / "adapter", path, seed=7, rank=8, alpha=32, **kwargs)
    merged = merged_checkpoint(path, adapter, tmp_path / "merged")
    llm = LLM(str(path), enable_lora=True, num_kv_blocks=256, max_num_batched_tokens=512)
    lora = LoRARequest("x", 1, str(adapter))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    chosen = prompts[:6]
    refs = [hf_reference(merged, p, MAX_NEW) for p in chosen]
    base_refs = [hf_reference(path, p, MAX_NEW)[0] for p in chosen]
    # Every other prompt runs the adapter, the rest the base model, all in one batch.
    loras = [lora if i % 2 == 0 else None for i in range(len(chosen))]
    outs = _run(llm, chosen, params, loras)
    for i, out in enumerate(outs):
        if loras[i] is None:
            assert out.token_ids == base_refs[i]
            continue
        ref_tokens, ref_logits = refs[i]
        assert out.token_ids == ref_tokens
        lp = torch.log_softmax(ref_logits, dim=-1)
        for step, (tok, entry) in enumerate(zip(ref_tokens, out.logprobs, strict=True)):
            assert abs(entry[tok].logprob - lp[step, tok].item()) < 1e-4
    # The adapter changed what the model says.
    assert sum(refs[i][0] != base_refs[i] for i in range(0, len(chosen), 2)) >= 2
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_used_blocks == 0


def test_two_adapters_and_the_base_in_one_step_match_each_alone(
    tiny_llama, adapters, prompts, hf_reference, tmp_path
):
    llm = LLM(str(tiny_llama), enable_lora=True, max_loras=2, num_kv_blocks=256, max_num_batched_tokens=512)
    la, lb = LoRARequest("a", 1, str(adapters["a"])), LoRARequest("b", 2, str(adapters["b"]))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    chosen = prompts[:6]
    loras = [la, lb, None, la, lb, None]
    batched = _run(llm, chosen, params, loras)
    alone = [_run(llm, [p], params, lo)[0] for p, lo in zip(chosen, loras, strict=True)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    for name, lo in (("a", la), ("b", lb)):
        merged = merged_checkpoint(tiny_llama, adapters[name], tmp_path / f"merged-{name}")
        for p, out, used in zip(chosen, batched, loras, strict=True):
            if used is lo:
                assert out.token_ids == hf_reference(merged, p, MAX_NEW)[0]
    assert len({tuple(o.token_ids) for o in batched[:3]}) == 3  # a, b and the base differ
    # vLLM's offline shapes: each output names its adapter; pooling calls take adapters too.
    one = SamplingParams(max_tokens=1)
    assert [o.lora_request for o in llm.generate(chosen[:3], one, lora_request=loras[:3])] == loras[:3]
    assert llm.generate(chosen[0], one, lora_request=la)[0].lora_request is la
    each = [o.outputs.embedding for o in llm.embed(chosen[:3], lora_request=loras[:3])]
    assert each[0] == pytest.approx(llm.embed(chosen[0], lora_request=la)[0].outputs.embedding, abs=1e-5)
    assert each[2] == pytest.approx(llm.embed(chosen[2])[0].outputs.embedding, abs=1e-5)
    assert each[0] != pytest.approx(llm.embed(chosen[0])[0].outputs.embedding, abs=1e-3)  # a is used


def test_deterministic_mode_is_batch_invariant_with_adapters(tiny_llama, adapters, prompts) -> None:
    llm = LLM(str(tiny_llama), enable_lora=True, max_loras=2, deterministic=True, num_kv_blocks=256)
    la, lb = LoRARequest("a", 1, str(adapters["a"])), LoRARequest("b", 2, str(adapters["b"]))
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    chosen = prompts[:6]
    loras = [la, lb, None, lb, la, None]
    batched = _run(llm, chosen, params, loras)
    for p, lo, out in zip(chosen, loras, batched, strict=True):
        solo = _run(llm, [p], params, lo)[0]
        assert solo.token_ids == out.token_ids
        assert [{t: e.logprob for t, e in s.items()} for s in solo.logprobs] == [
            {t: e.logprob for t, e in s.items()} for s in out.logprobs
        ]


def test_blocks_are_keyed_per_adapter(tiny_llama, adapters, prompts) -> None:
    llm = LLM(str(tiny_llama), enable_lora=True, num_kv_blocks=256)
    engine = llm.engine
    prompt = prompts[7]  # 100 tokens: 6 full blocks
    la = LoRARequest("a", 1, str(adapters["a"]))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def run(lora):
        req = engine.make_request(
            f"r{engine.scheduler.prefix_cache_queries}", prompt, params, lora_request=lora
        )
        engine.add_request(req)
        while engine.has_unfinished_requests():
            engine.step()
        return req

    base = run(None)
    first = run(la)
    assert first.num_cached_tokens == 0  # the base model's blocks are not the adapter's
    again = run(la)
    assert again.num_cached_tokens == 96
    assert again.output_token_ids == first.output_token_ids
    base_again = run(None)
    assert base_again.num_cached_tokens == 96 and base_again.output_token_ids == base.output_token_ids
    wid = adapter_weights_id(adapters["a"])
    assert first.block_hashes[:6] == block_hashes(prompt, 16, lora_extra("a", wid))
    assert base.block_hashes[:6] == block_hashes(prompt, 16)
    # Another adapter under the same name (other weights) keys its blocks apart too.
    assert lora_extra("a", wid) != lora_extra("a", adapter_weights_id(adapters["b"]))


def test_max_loras_bounds_the_adapters_running_at_once(tiny_llama, adapters, prompts) -> None:
    llm = LLM(str(tiny_llama), enable_lora=True, max_loras=1, max_num_seqs=8, num_kv_blocks=256)
    engine = llm.engine
    la, lb = LoRARequest("a", 1, str(adapters["a"])), LoRARequest("b", 2, str(adapters["b"]))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    order = [la, lb, None, la, lb, None]
    reqs = [engine.make_request(f"q{i}", prompts[i], params, lora_request=lo) for i, lo in enumerate(order)]
    for req in reqs:
        engine.add_request(req)
    seen: list[set[str]] = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats()
        seen.append(set(stats.running_loras))
        assert len(stats.running_loras) <= 1
    assert {"a"} in seen and {"b"} in seen
    # Nothing starved, and each ran as it would alone.
    for req, lo in zip(reqs, order, strict=True):
        assert req.finish_reason == "length"
        assert _run(llm, [req.prompt_token_ids], params, lo)[0].token_ids == req.output_token_ids
    # The base-model request behind the first b went ahead of it (b waited for a to finish).
    assert reqs[2].metrics.first_scheduled_time < reqs[1].metrics.first_scheduled_time


def test_a_waiting_adapter_is_not_starved_by_later_requests_for_a_running_one(
    tiny_llama, adapters, prompts
) -> None:
    llm = LLM(str(tiny_llama), enable_lora=True, max_loras=1, max_num_seqs=8, num_kv_blocks=256)
    engine = llm.engine
    la, lb = LoRARequest("a", 1, str(adapters["a"])), LoRARequest("b", 2, str(adapters["b"]))

    def add(rid: str, lora, max_tokens: int):
        req = engine.make_request(
            rid, prompts[2], SamplingParams(max_tokens=max_tokens, ignore_eos=True), lora_request=lora
        )
        engine.add_request(req)
        return req

    first, waiting = add("a0", la, 3), add("b", lb, 2)
    later = []
    for i in range(6):  # a stream of requests for the running adapter, arriving while b waits
        engine.step()
        later.append(add(f"a{i + 1}", la, 3))
        later.append(add(f"base{i}", None, 1))
    while engine.has_unfinished_requests():
        engine.step()
    assert waiting.metrics.first_scheduled_time > first.metrics.finished_time  # max_loras=1
    for req in later:
        if req.lora is not None:  # queued behind b: they wait for it
            assert req.metrics.first_scheduled_time > waiting.metrics.first_scheduled_time
    # Requests without an adapter are not held back by the wait.
    assert (
        min(r.metrics.first_scheduled_time for r in later if r.lora is None)
        < waiting.metrics.first_scheduled_time
    )


def test_evicted_adapter_reloads_and_running_requests_keep_theirs(tiny_llama, adapters, prompts) -> None:
    llm = LLM(str(tiny_llama), enable_lora=True, max_loras=1, max_cpu_loras=1, num_kv_blocks=256)
    engine = llm.engine
    la, lb = LoRARequest("a", 1, str(adapters["a"])), LoRARequest("b", 2, str(adapters["b"]))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want_a = _run(llm, [prompts[3]], params, la)[0].token_ids
    running = engine.make_request("keep", prompts[3], params, lora_request=la)
    engine.add_request(running)
    engine.step()
    engine.make_request("evicts-a", prompts[4], params, lora_request=lb)  # loads b: a leaves the cache
    assert "a" not in engine.loras and "b" in engine.loras
    while engine.has_unfinished_requests():
        engine.step()
    assert running.output_token_ids == want_a
    assert _run(llm, [prompts[3]], params, la)[0].token_ids == want_a  # read again from its directory
    assert engine.remove_lora("a") and not engine.remove_lora("a")


def _adapter(tmp_path: Path, tiny_llama: Path, name: str, **kwargs) -> Path:
    return build_lora_adapter(tmp_path / name, tiny_llama, seed=3, **kwargs)


def _edit(adapter: Path, config: dict | None = None, tensors=None) -> None:
    if config is not None:
        current = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps({**current, **config}))
    if tensors is not None:
        weights = load_file(str(adapter / "adapter_model.safetensors"))
        save_file(tensors(weights), str(adapter / "adapter_model.safetensors"))


def test_adapters_that_cannot_run_exactly_are_refused_by_name(tiny_llama, tiny_qwen3_moe, tmp_path) -> None:
    llm = LLM(str(tiny_llama), enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    engine = llm.engine

    def refused(path: Path, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            engine.read_lora(LoRARequest("bad", 1, str(path)))

    refused(tmp_path / "missing", "no such directory")
    refused(_adapter(tmp_path, tiny_llama, "rank16", rank=16), "rank 16, more than max_lora_rank=8")
    dora = _adapter(tmp_path, tiny_llama, "dora")
    _edit(dora, {"use_dora": True})
    refused(dora, "DoRA")
    saved = _adapter(tmp_path, tiny_llama, "saved")
    _edit(saved, {"modules_to_save": ["lm_head"]})
    refused(saved, "modules_to_save")
    bias = _adapter(tmp_path, tiny_llama, "bias")
    _edit(bias, {"bias": "lora_only"})
    refused(bias, "biases")
    head = _adapter(tmp_path, tiny_llama, "head")
    _edit(head, tensors=lambda w: {**w, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)})
    refused(head, "embeddings or the LM head")
    shape = _adapter(tmp_path, tiny_llama, "shape")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    _edit(shape, tensors=lambda w: {**w, key: torch.zeros(32, 8)})
    refused(
        shape, r"q_proj has lora_A \(8, 64\) and lora_B \(32, 8\); this model needs \[r, 64\] and \[64, r\]"
    )
    half = _adapter(tmp_path, tiny_llama, "half")
    _edit(half, tensors=lambda w: {k: v for k, v in w.items() if k != key})
    refused(half, "q_proj has lora_A but no lora_B")
    (bin_only := _adapter(tmp_path, tiny_llama, "bin")).joinpath("adapter_model.safetensors").rename(
        bin_only / "adapter_model.bin"
    )
    refused(bin_only, "only .bin weights")
    garbled = _adapter(tmp_path, tiny_llama, "garbled")
    (garbled / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    refused(garbled, "not a valid safetensors file")
    moe = _adapter(tmp_path, tiny_llama, "moe")
    experts = "base_model.model.model.layers.1.mlp.experts.0.gate_proj.lora_{}.weight"
    _edit(
        moe,
        tensors=lambda w: {
            **w,
            experts.format("A"): torch.zeros(8, 64),
            experts.format("B"): torch.zeros(128, 8),
        },
    )
    moe_llm = LLM(str(tiny_qwen3_moe), enable_lora=True, num_kv_blocks=64)
    with pytest.raises(ValueError, match="mixture-of-experts layer"):
        moe_llm.engine.read_lora(LoRARequest("moe", 1, str(moe)))
    # Requests name their adapter: a bad one fails the request, before it is queued.
    with pytest.raises(ValueError, match="DoRA"):
        engine.make_request(
            "r", [5, 6, 7], SamplingParams(max_tokens=2), lora_request=LoRARequest("d", 1, str(dora))
        )
    assert not engine.requests and not engine.has_unfinished_requests()


def test_lora_needs_enable_lora_and_a_supported_model(tiny_llama, tiny_deepseek, adapters) -> None:
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    with pytest.raises(ValueError, match="start it with --enable-lora"):
        llm.generate(
            [[5, 6]], SamplingParams(max_tokens=2), lora_request=LoRARequest("a", 1, str(adapters["a"]))
        )
    with pytest.raises(ValueError, match="not supported for DeepseekV3ForCausalLM"):
        LLM(str(tiny_deepseek), enable_lora=True, num_kv_blocks=64)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(str(tiny_llama), enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")
