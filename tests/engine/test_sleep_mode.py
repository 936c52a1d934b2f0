"""Sleep mode and weight updates, offline (``LLM``): the KV cache really freed, weights offloaded or
dropped, exact tokens after waking, new weights giving exactly a fresh engine's tokens, and
checkpoints of another shape refused with the old weights serving on."""

from __future__ import annotations

import gc
import shutil
import weakref
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.demo import build_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# Two full blocks and a partial one (block size 16): the prefix cache and partial blocks get filled.
PROMPTS = [list(range(3, 43)), [7, 8, 9, 10, 11]]


def _tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def other_llama(models_root: Path) -> Path:
    """tiny_llama's shapes with other weights (another seed)."""
    return build_model(models_root / "sleep_other_llama", "llama", seed=101)


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, other_llama: Path) -> dict[str, list[list[int]]]:
    """Greedy tokens of fresh engines on each checkpoint."""
    return {
        "tiny": _tokens(LLM(str(tiny_llama), num_kv_blocks=64)),
        "other": _tokens(LLM(str(other_llama), num_kv_blocks=64)),
    }


def _assert_released(llm: LLM, cache_ref: weakref.ref) -> None:
    runner, bm = llm.engine.model_runner, llm.engine.block_manager
    gc.collect()
    assert runner.kv_caches == []
    assert cache_ref() is None  # nobody (tier connector included) keeps the tensors alive
    assert bm.num_cached_blocks == 0 and bm.num_partial_blocks == 0
    assert bm.num_free_blocks == bm.num_blocks == 64
    bm.check_integrity()


def test_level1_frees_kv_keeps_weights_on_cpu_and_wakes_exact(tiny_llama, reference, hf_reference) -> None:
    import torch

    llm = LLM(str(tiny_llama), enable_sleep_mode=True, num_kv_blocks=64)
    assert _tokens(llm) == reference["tiny"]
    assert llm.engine.block_manager.num_cached_blocks > 0
    cache_ref = weakref.ref(llm.engine.model_runner.kv_caches[0][0])
    runner = llm.engine.model_runner
    embed = runner.model.embed
    llm.sleep(level=1)
    assert llm.is_sleeping()
    _assert_released(llm, cache_ref)
    if runner.device.type == "cpu":  # the weights already live in host memory: left in place
        assert runner.model.embed is embed
    else:  # moved to host memory
        assert runner.model.embed.device.type == "cpu" and torch.equal(runner.model.embed, embed.cpu())
    assert llm.engine.stats().sleep_level == 0  # engine stats carry it through the async engine only
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, GREEDY)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert [t.numel() for t in llm.engine.model_runner.kv_caches[0]] == [64 * 16 * 2 * 16] * 2
    assert runner.model.embed.device == embed.device  # back on the device
    assert _tokens(llm) == reference["tiny"]
    assert reference["tiny"][0] == hf_reference(tiny_llama, PROMPTS[0], 10)[0]


def test_level2_discards_weights_and_wake_reads_the_checkpoint(tiny_llama, reference) -> None:
    llm = LLM(str(tiny_llama), enable_sleep_mode=True, num_kv_blocks=64)
    _tokens(llm)
    cache_ref = weakref.ref(llm.engine.model_runner.kv_caches[1][1])
    llm.sleep(level=2)
    _assert_released(llm, cache_ref)
    assert llm.engine.model_runner.model is None
    llm.wake_up(tags=["kv_cache"])
    assert llm.is_sleeping() and llm.engine.model_runner.model is None  # weights still asleep
    llm.wake_up(tags=["weights"])
    assert not llm.is_sleeping()
    assert _tokens(llm) == reference["tiny"]


def test_staged_wake_with_new_weights_gives_a_fresh_engines_tokens(
    tiny_llama, other_llama, reference
) -> None:
    """The RL loop: sleep(2), wake the weights, load the trained ones, then wake the KV cache."""
    assert reference["other"] != reference["tiny"]
    llm = LLM(str(tiny_llama), enable_sleep_mode=True, num_kv_blocks=64)
    assert _tokens(llm) == reference["tiny"]
    fingerprint = llm.engine.model_fingerprint
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    assert llm.engine.model_runner.kv_caches == []
    llm.reload_weights(str(other_llama))
    assert llm.is_sleeping()  # the KV cache is still released
    llm.wake_up(tags=["kv_cache"])
    assert _tokens(llm) == reference["other"]
    assert llm.engine.model_fingerprint != fingerprint
    # vLLM's spelling, as TRL calls it after a level-2 wake: reads the current checkpoint again.
    assert llm.collective_rpc("reload_weights") == [None]
    assert _tokens(llm) == reference["other"]


def test_reload_while_awake_resets_the_prefix_cache(tiny_llama, other_llama, reference) -> None:
    llm = LLM(str(tiny_llama), num_kv_blocks=64)  # weight updates need no sleep mode
    _tokens(llm)
    assert llm.engine.block_manager.num_cached_blocks > 0
    model = llm.engine.model_runner.model
    pointers = (model.embed.data_ptr(), model.layers[1]["qkv"].data_ptr(), model.lm_head.data_ptr())
    llm.reload_weights(str(other_llama))
    assert llm.engine.block_manager.num_cached_blocks == 0
    assert _tokens(llm) == reference["other"]
    # Written over the serving tensors: the device never held two models.
    assert llm.engine.model_runner.model is model
    assert (model.embed.data_ptr(), model.layers[1]["qkv"].data_ptr(), model.lm_head.data_ptr()) == pointers
    with pytest.raises(ValueError, match="sleep mode is not enabled"):
        llm.sleep()


def test_rewritten_directory_gets_a_new_fingerprint(tmp_path, tiny_llama, other_llama, reference) -> None:
    """A trainer overwrites the same directory with same-shaped weights: the headers match, the
    bytes do not, and the KV tier must never serve the old weights' blocks for the new ones."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, ckpt)
    tier = "memory://sleep-mode-rewrite"
    llm = LLM(str(ckpt), num_kv_blocks=64, kv_tier=tier)
    assert _tokens(llm) == reference["tiny"]
    llm.engine.connector.flush(5.0)
    llm.engine.block_manager.reset_prefix_cache()
    loaded = llm.engine.connector.stats().blocks_loaded
    assert _tokens(llm) == reference["tiny"]  # the prompt's two blocks came from the tier
    assert llm.engine.connector.stats().blocks_loaded == loaded + 2
    fingerprint = llm.engine.model_fingerprint
    for f in other_llama.glob("*.safetensors"):
        shutil.copy(f, ckpt / f.name)
    llm.reload_weights()
    assert llm.engine.model_fingerprint != fingerprint
    assert llm.engine.model_info.model_fingerprint == llm.engine.model_fingerprint
    assert _tokens(llm) == reference["other"]
    assert llm.engine.connector.stats().blocks_loaded == loaded + 2  # no stale block read
    llm.close()


def test_sleep_with_a_tier_rebinds_the_caches(tiny_llama, reference) -> None:
    llm = LLM(str(tiny_llama), enable_sleep_mode=True, num_kv_blocks=64, kv_tier="memory://sleep-mode-rebind")
    assert _tokens(llm) == reference["tiny"]
    llm.engine.connector.flush(5.0)
    cache_ref = weakref.ref(llm.engine.model_runner.kv_caches[0][0])
    llm.sleep(level=1)
    _assert_released(llm, cache_ref)
    llm.wake_up()
    loaded = llm.engine.connector.stats().blocks_loaded
    assert _tokens(llm) == reference["tiny"]  # loaded from the tier into the new cache tensors
    assert llm.engine.connector.stats().blocks_loaded == loaded + 2
    llm.close()


def test_mismatched_checkpoints_are_refused_and_old_weights_serve(
    tmp_path, tiny_llama, tiny_qwen3, models_root, reference
) -> None:
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    wider = build_model(models_root / "sleep_wide_llama", "llama", seed=3, intermediate_size=96)
    cases = {
        str(wider): "intermediate_size: 128 -> 96",
        str(tiny_qwen3): "architecture",
        str(tmp_path / "missing"): "is not a directory",
        str(tiny_llama / "config.json"): "is not a directory",
    }
    for path, message in cases.items():
        with pytest.raises(ValueError, match=message):
            llm.reload_weights(path)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(tiny_llama / "config.json", no_weights / "config.json")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        llm.reload_weights(str(no_weights))
    with pytest.raises(ValueError, match="load_format 'dummy'"):
        llm.reload_weights(str(tiny_llama), load_format="dummy")
    assert _tokens(llm) == reference["tiny"]


def test_bad_levels_and_tags_are_refused(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), enable_sleep_mode=True, num_kv_blocks=64)
    for level in (0, 3, True, "1"):
        with pytest.raises(ValueError, match="sleep level"):
            llm.sleep(level)  # type: ignore[arg-type]
    for tags in ([], "weights", ["weights", "gpu"]):
        with pytest.raises(ValueError, match="tag"):
            llm.wake_up(tags)  # type: ignore[arg-type]
    assert not llm.is_sleeping()
    llm.sleep(1)
    llm.sleep(2)  # deeper: the weights go too
    assert llm.engine.model_runner.model is None
    llm.sleep(1)  # shallower than now: nothing comes back
    assert llm.engine.model_runner.model is None
    llm.wake_up()
    assert not llm.is_sleeping()


def _held_tensors(model) -> list:
    """Every tensor ``model`` holds, found by the garbage collector's referents (not by the walks
    under test)."""
    import torch

    found, seen, stack = [], set(), [model]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, (list, tuple, dict, torch.nn.Module)) or type(obj).__module__.startswith(
            "engine.models"
        ):
            stack.extend(gc.get_referents(obj))
    return found


@pytest.mark.parametrize(
    "name",
    ["tiny_llama_tied", "tiny_deepseek", "tiny_gemma3", "tiny_gpt_oss", "tiny_llama_cls", "tiny_llava"],
)
def test_offload_moves_every_tensor_of_every_model_family(name, request) -> None:
    """Level 1 on an accelerator moves the model's tensors with ``move_tensors``: none may stay
    behind (found here by the garbage collector's referents, not by the same walk), and tied
    tensors stay one tensor. Moving to ``meta`` shows it without a GPU."""
    import torch

    from engine.sleep_mode import move_tensors

    llm = LLM(str(request.getfixturevalue(name)), num_kv_blocks=8)
    model = llm.engine.model_runner.model
    tied = model.embed is model.lm_head
    move_tensors(model, torch.device("meta"))
    found = _held_tensors(model)
    assert len(found) > 10
    assert all(t.device.type == "meta" for t in found)
    assert (model.embed is model.lm_head) == tied


@pytest.mark.parametrize(
    "name",
    ["tiny_llama_tied", "tiny_deepseek", "tiny_gemma3", "tiny_gpt_oss", "tiny_llama_cls", "tiny_llava"],
)
def test_in_place_update_reaches_every_tensor_of_every_model_family(name, request) -> None:
    """``replace_weights`` pairs each serving tensor with the rebuilt model's: every tensor the
    model holds (found by the garbage collector's referents, not by the same walk) is written, tied
    ones once, and none is replaced by another object."""
    import torch

    from engine.weight_update import tensor_pairs

    model_dir = request.getfixturevalue(name)
    llm = LLM(str(model_dir), num_kv_blocks=8)
    runner = llm.engine.model_runner
    model = runner.model
    held = {id(t): t.data_ptr() for t in _held_tensors(model)}
    rebuilt, _ = runner._build(runner.read_weights(model_dir, torch.device("cpu")), torch.device("cpu"))
    pairs = tensor_pairs(model, rebuilt)
    assert pairs is not None
    written = {id(dst) for dst, _ in pairs}
    assert len(written) == len(pairs)  # tied tensors once
    # Parameters of a torch module are reached through their .data views (other objects, same memory).
    assert {t.data_ptr() for t, _ in pairs} >= set(held.values())
    head = runner.score_head  # a classifier's: written in place too
    out = (
        (lambda: llm.classify([[5, 6, 7, 8]])[0].outputs.probs)
        if head is not None
        else (lambda: _tokens(llm, [[5, 6, 7, 8]]))
    )
    before = out()
    assert runner.replace_weights(runner.read_weights(model_dir, torch.device("cpu")))
    assert runner.model is model and runner.score_head is head and out() == before


def test_a_weight_update_moves_tier_keys_and_events_to_the_new_fingerprint(
    redis_url, tiny_llama, other_llama, reference
) -> None:
    """With a Redis tier and KV events: blocks written before the update keep the old weights'
    keys, those after land under the new fingerprint, and each model's events go to its own stream."""
    import redis

    from kvcache.events import KVEventReader

    llm = LLM(str(tiny_llama), num_kv_blocks=64, kv_tier=redis_url, kv_events=True, kv_events_replica_id="r1")
    assert _tokens(llm) == reference["tiny"]
    old = llm.engine.model_fingerprint
    llm.reload_weights(str(other_llama))
    new = llm.engine.model_fingerprint
    assert _tokens(llm) == reference["other"]
    llm.close()
    keys = {k.decode() for k in redis.Redis.from_url(redis_url).scan_iter("ferry:kv:*")}
    # The first request's three full blocks (40 prompt + 9 computed output tokens) under each
    # fingerprint, and one events stream each.
    assert sum(k.startswith(f"ferry:kv:{old}:") for k in keys) == 3
    assert sum(k.startswith(f"ferry:kv:{new}:") for k in keys) == 3
    assert {k for k in keys if ":events:" in k} == {f"ferry:kv:events:{old}", f"ferry:kv:events:{new}"}
    old_events = KVEventReader(redis_url, old).read()
    new_events = KVEventReader(redis_url, new).read()
    assert {e.kind for e in old_events} == {"stored", "removed"}  # removed: the update emptied the cache
    assert {e.kind for e in new_events} == {"stored"}


def test_sleep_releases_a_draft_models_kv_too(tiny_llama, reference) -> None:
    """With a draft model (a copy of the target), sleep frees both caches and wake-up restores
    both: every draft is accepted again afterwards, and the tokens are the fresh engine's."""
    spec = {"model": str(tiny_llama), "num_speculative_tokens": 3}
    llm = LLM(str(tiny_llama), enable_sleep_mode=True, num_kv_blocks=64, speculative_config=spec)
    assert _tokens(llm) == reference["tiny"]
    draft = llm.engine.model_runner.draft
    draft_ref = weakref.ref(draft.kv_caches[0][0])
    llm.sleep(level=1)
    gc.collect()
    assert draft.kv_caches == [] and draft_ref() is None
    llm.wake_up()
    assert [t.numel() for t in draft.kv_caches[0]] == [64 * 16 * 2 * 16] * 2
    before = llm.engine.spec_accepted_tokens, llm.engine.spec_draft_tokens
    assert _tokens(llm) == reference["tiny"]
    accepted = llm.engine.spec_accepted_tokens - before[0]
    assert accepted == llm.engine.spec_draft_tokens - before[1] > 0


def test_sleep_drops_lora_device_copies(tiny_llama, tmp_path) -> None:
    """LoRA adapters copied to the device for a step are let go with the weights at either level;
    the host copies stay loaded and serve after waking. (The copies are made on ``meta`` here, as a
    CPU device runs the host copies themselves; the steps after waking make them on the device.)"""
    import torch

    from engine.demo import build_lora_adapter
    from engine.lora_request import LoRARequest

    path = build_lora_adapter(tmp_path / "a", tiny_llama, seed=1, rank=8, alpha=16)
    lora = LoRARequest("a", 1, str(path))
    llm = LLM(str(tiny_llama), num_kv_blocks=64, enable_sleep_mode=True, enable_lora=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=lora)]
    copies = llm.engine.model_runner.lora_adapters
    adapter = llm.engine.load_lora(lora)
    device = copies.device
    for level in (1, 2):
        copies.device = torch.device("meta")
        copies.batch([(0, 2, adapter)], llm.engine.model_runner.model.linear)
        assert copies.num_copies == 1
        llm.sleep(level=level)
        assert copies.num_copies == 0
        copies.device = device
        llm.wake_up()
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=lora)] == want
