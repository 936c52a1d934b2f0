"""Sliding-window attention (Mistral; Qwen2 with use_sliding_window) against transformers.

The tiny checkpoints reuse the session's Llama and Qwen2 weights with a window of ``WINDOW``
tokens written into config.json; prompts run past the window, and every engine check compares
with transformers ``generate`` on the windowed model, whose answer differs from the same weights
under full attention (``test_window_changes_the_transformers_answer``), so ignoring the window
would fail them. Kernel-level checks compare both attention backends with a float64 reference.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

from conftest_helpers import record_logits  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.attention.base import AttentionMetadata  # noqa: E402
from engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from tests.engine.attention_reference import reference_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WINDOW = 10
BLOCK = 4  # windows start inside blocks and leave whole blocks behind
LENGTHS = [3, 10, 11, 26, 47, 70]
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)


def _rewrite(src: Path, dst: Path, drop: tuple[str, ...] = (), **changes: object) -> Path:
    """A copy of checkpoint ``src`` with config.json entries changed (``drop``: removed)."""
    if not dst.exists():
        shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    for key in drop:
        cfg.pop(key, None)
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def mistral(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama's weights as a Mistral with a WINDOW-token window on every layer."""
    dst = tmp_path_factory.mktemp("sw") / "mistral"
    return _rewrite(
        tiny_llama, dst, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=WINDOW
    )


@pytest.fixture(scope="module")
def sw_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(21)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def refs(mistral: Path, sw_prompts, hf_reference) -> list[tuple[list[int], torch.Tensor]]:
    return [hf_reference(mistral, p, MAX_NEW) for p in sw_prompts]


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    """Outputs plus each output's stacked logits ``[steps, vocab]``."""
    seen = record_logits(llm)
    outs = llm.generate(prompts, params)
    llm.engine.logits_observers.clear()
    return outs, [torch.stack(seen[o.request_id]) for o in outs]


def _assert_matches(outs, logits, refs) -> None:  # noqa: ANN001
    """Same greedy tokens as transformers, sampled logprobs and whole log-softmax rows within 1e-4."""
    for out, rows, (ref_tokens, ref_logits) in zip(outs, logits, refs, strict=True):
        o = out.outputs[0]
        assert o.token_ids == ref_tokens
        ref_lp = torch.log_softmax(ref_logits, dim=-1)
        for step, (tok, entry) in enumerate(zip(ref_tokens, o.logprobs, strict=True)):
            assert abs(entry[tok].logprob - ref_lp[step, tok].item()) < 1e-4
        assert (torch.log_softmax(rows.cpu(), dim=-1) - ref_lp).abs().max().item() < 1e-4


# --------------------------------------------------------------------------- config


def _hf_layer_windows(raw: dict) -> list[int | None]:
    """Each layer's window as transformers' modeling code reads it from the config."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    if raw["model_type"] == "qwen2":
        return [cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types]
    if raw["model_type"] in ("olmo3", "exaone4"):
        return [cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types]
    if raw["model_type"] == "smollm3":  # SmolLM3Attention: windowed only under use_sliding_window
        slides = [cfg.use_sliding_window and t == "sliding_attention" for t in cfg.layer_types]
        return [cfg.sliding_window if s else None for s in slides]
    if raw["model_type"] == "mistral":
        return [cfg.sliding_window] * cfg.num_hidden_layers
    return [None] * cfg.num_hidden_layers  # LlamaAttention has no window


BASE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
QWEN2 = {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
MISTRAL = {**BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
LLAMA = {**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
OLMO3 = {**BASE, "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3"}
SMOLLM3 = {**BASE, "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3"}
EXAONE4 = {**BASE, "architectures": ["Exaone4ForCausalLM"], "model_type": "exaone4"}
SLIDE = "sliding_attention"
FULL = "full_attention"


@pytest.mark.parametrize(
    "raw,expected",
    [
        ({**MISTRAL, "sliding_window": 4096}, (4096,) * 4),
        ({**MISTRAL, "sliding_window": None}, (None,) * 4),
        (MISTRAL, (4096,) * 4),  # MistralConfig's default window
        ({**LLAMA, "sliding_window": 64}, (None,) * 4),  # transformers' Llama ignores it
        ({**QWEN2, "sliding_window": 64, "use_sliding_window": False, "max_window_layers": 0}, (None,) * 4),
        ({**QWEN2, "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2}, (None, None, 64, 64)),
        ({**QWEN2, "use_sliding_window": True, "max_window_layers": 3}, (None, None, None, 4096)),
        ({**QWEN2, "sliding_window": 64, "use_sliding_window": True}, (None,) * 4),  # max_window_layers 28
        (
            {**QWEN2, "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 3,
             "layer_types": [SLIDE, FULL, SLIDE, FULL]},
            (64, None, 64, None),
        ),
        (
            {**QWEN2, "sliding_window": 64, "use_sliding_window": False, "layer_types": [FULL] * 4},
            (None,) * 4,
        ),
        (OLMO3, (4096, 4096, 4096, None)),  # Olmo3Config: every fourth layer full
        ({**OLMO3, "sliding_window": 64, "layer_types": [FULL, SLIDE, FULL, SLIDE]}, (None, 64, None, 64)),
        ({**SMOLLM3, "sliding_window": 64}, (None,) * 4),  # use_sliding_window defaults off
        ({**SMOLLM3, "sliding_window": 64, "use_sliding_window": True}, (None, None, None, 64)),  # NoPE layer
        (
            {**SMOLLM3, "sliding_window": 64, "use_sliding_window": True, "layer_types": [SLIDE, FULL] * 2},
            (64, None, 64, None),
        ),
        (EXAONE4, (4096, 4096, 4096, None)),  # Exaone4Config: every fourth layer full
        ({**EXAONE4, "sliding_window": None, "layer_types": [FULL] * 4}, (None,) * 4),
    ],
)  # fmt: skip
def test_layer_windows_follow_transformers(raw: dict, expected: tuple) -> None:
    cfg = ModelConfig.from_dict(raw)
    assert cfg.layer_windows == expected
    assert list(cfg.layer_windows) == _hf_layer_windows(raw)
    for w in cfg.layer_windows:
        assert w is None or w == cfg.sliding_window


def test_layer_types_of_the_wrong_length_are_refused() -> None:
    raw = {**QWEN2, "sliding_window": 8, "use_sliding_window": True, "layer_types": [SLIDE] * 3}
    with pytest.raises(ValueError, match="layer_types has 3 entries for 4 layers"):
        ModelConfig.from_dict(raw)


# --------------------------------------------------------------------------- Mistral end to end


def test_window_changes_the_transformers_answer(tiny_llama, sw_prompts, refs, hf_reference) -> None:
    """The same weights under full attention answer differently once a prompt passes the window,
    so matching ``refs`` below means the engine applied the window."""
    for prompt, (_, windowed) in zip(sw_prompts, refs, strict=True):
        if len(prompt) <= WINDOW:
            continue
        _, full = hf_reference(tiny_llama, prompt, MAX_NEW)
        first_step = torch.log_softmax(full[0], -1) - torch.log_softmax(windowed[0], -1)
        assert first_step.abs().max().item() > 1e-2


@pytest.mark.parametrize("block_size", [BLOCK, 16])
def test_mistral_greedy_matches_transformers_solo_and_batched(mistral, sw_prompts, refs, block_size) -> None:
    llm = LLM(str(mistral), block_size=block_size, num_kv_blocks=256)
    assert llm.engine.max_model_len == 1024  # max_position_embeddings, no longer capped at the window
    assert llm.engine.model_runner.model.windows == (WINDOW, WINDOW)
    assert all(len(p) + MAX_NEW > WINDOW for p in sw_prompts)
    solo = [_generate(llm, [p]) for p in sw_prompts]
    _assert_matches([o[0] for o, _ in solo], [lg[0] for _, lg in solo], refs)
    _assert_matches(*_generate(llm, sw_prompts), refs)
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("chunk", [7, 16])
def test_mistral_chunked_prefill_and_prefix_hits_match_transformers(mistral, sw_prompts, refs, chunk) -> None:
    """Chunks shorter and longer than the window, then the same prompts over a warm prefix cache."""
    llm = LLM(str(mistral), block_size=BLOCK, num_kv_blocks=256, max_num_batched_tokens=chunk)
    _assert_matches(*_generate(llm, sw_prompts), refs)
    llm.engine.block_manager.check_integrity()
    again, logits = _generate(llm, sw_prompts)
    _assert_matches(again, logits, refs)
    assert again[LENGTHS.index(70)].num_cached_tokens == 68  # a hit far longer than the window


def test_mistral_prefix_hit_longer_than_the_window(mistral, sw_prompts, refs) -> None:
    llm = LLM(str(mistral), block_size=BLOCK, num_kv_blocks=256)
    target = LENGTHS.index(47)
    llm.generate([sw_prompts[target][:33]], SamplingParams(max_tokens=1))
    outs, logits = _generate(llm, [sw_prompts[target]])
    assert outs[0].num_cached_tokens == 32
    _assert_matches(outs, logits, [refs[target]])


def test_mistral_deterministic_is_bit_identical_and_matches_transformers(mistral, sw_prompts, refs) -> None:
    opts = dict(block_size=BLOCK, num_kv_blocks=512, deterministic=True)
    target = LENGTHS.index(70)
    solo_out, solo = _generate(LLM(str(mistral), **opts), [sw_prompts[target]])
    _assert_matches(solo_out, solo, [refs[target]])
    batched_out, batched = _generate(LLM(str(mistral), **opts), sw_prompts)
    _assert_matches(batched_out, batched, refs)
    _, chunked = _generate(LLM(str(mistral), max_num_batched_tokens=7, **opts), sw_prompts)
    warm = LLM(str(mistral), **opts)
    warm.generate([sw_prompts[target][:50]], SamplingParams(max_tokens=1))
    cached_out, cached = _generate(warm, [sw_prompts[target]])
    assert cached_out[0].num_cached_tokens == 48
    for name, rows in [("batched", batched[target]), ("chunked", chunked[target]), ("cached", cached[0])]:
        assert torch.equal(rows, solo[0]), name


def _peak_used_blocks(llm: LLM) -> list[int]:
    """Records the blocks in use at every sampling step (released blocks are not in use)."""
    peaks: list[int] = []
    llm.engine.logits_observers.append(
        lambda ids, logits: peaks.append(llm.engine.block_manager.num_used_blocks)
    )
    return peaks


def test_mistral_gives_back_blocks_behind_the_window(mistral, tiny_llama, sw_prompts, refs) -> None:
    """With a window on every layer a request holds only the blocks its window reaches: a 70-token
    prompt + 10 tokens (20 blocks of 4) runs exactly in an 8-block cache, holding at most 5 at once
    (window 10 behind the next query + an 8-token chunk); full attention refuses it."""
    target = LENGTHS.index(70)
    opts = dict(block_size=BLOCK, num_kv_blocks=8, max_num_batched_tokens=8)
    llm = LLM(str(mistral), **opts)
    assert llm.engine.sliding_window == WINDOW
    peaks = _peak_used_blocks(llm)
    outs, logits = _generate(llm, [sw_prompts[target]])
    _assert_matches(outs, logits, [refs[target]])
    assert max(peaks) == 5
    assert peaks[-1] == 3  # decoding at position 79: blocks 16..19 minus the passed one
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_used_blocks == 0
    with pytest.raises(ValueError, match="needs 20 KV blocks but the cache has only 8"):
        LLM(str(tiny_llama), **opts).generate([sw_prompts[target]], GREEDY)


def test_mistral_released_blocks_survive_preemption(mistral, sw_prompts, refs) -> None:
    """Two long prompts that do not fit side by side: one is preempted and recomputed, and both
    still match transformers; the bookkeeping of released slots stays consistent."""
    long = [LENGTHS.index(70), LENGTHS.index(47)]
    llm = LLM(str(mistral), block_size=BLOCK, num_kv_blocks=8, max_num_batched_tokens=8)
    outs, logits = _generate(llm, [sw_prompts[i] for i in long])
    _assert_matches(outs, logits, [refs[i] for i in long])
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.timeout(60)
def test_mistral_prefix_hit_longer_than_the_cache_leaves_room_for_a_step(mistral, sw_prompts, refs) -> None:
    """A window model admits sequences longer than its cache, so a cached prefix can fill the whole
    cache: the scheduler uses only as much of it as leaves a step's blocks (13 of 16 here) instead of
    waiting forever for an allocation that cannot succeed."""
    target = LENGTHS.index(70)
    llm = LLM(str(mistral), block_size=BLOCK, num_kv_blocks=16, max_num_batched_tokens=8)
    llm.generate([sw_prompts[target][:60]], SamplingParams(max_tokens=1))
    assert llm.engine.block_manager.num_cached_blocks == 15  # the 60-token prefix, whole
    outs, logits = _generate(llm, [sw_prompts[target]])
    assert outs[0].num_cached_tokens == 13 * BLOCK  # 16 blocks - 2 for an 8-token step - 1
    _assert_matches(outs, logits, [refs[target]])
    llm.engine.block_manager.check_integrity()


@pytest.mark.timeout(120)
def test_mistral_small_cache_under_load_matches_a_large_one(mistral, vocab_size) -> None:
    """Shared prefixes, chunked prefill, preemption and released blocks together: 24 requests in a
    cache far smaller than their sequences give the tokens a roomy cache gives, and every block
    comes back."""
    rng = random.Random(3)
    stems = [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(20, 60))] for _ in range(4)]
    prompts = [
        rng.choice(stems)[: rng.randrange(5, 60)]
        + [rng.randrange(3, vocab_size) for _ in range(rng.randrange(1, 30))]
        for _ in range(24)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    roomy = LLM(str(mistral), block_size=BLOCK, num_kv_blocks=512).generate(prompts, params)
    small = LLM(str(mistral), block_size=BLOCK, num_kv_blocks=10, max_num_batched_tokens=8, max_num_seqs=4)
    outs = small.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    assert max(len(p) for p in prompts) + 12 > 10 * BLOCK  # some sequences outgrow the whole cache
    assert small.engine.scheduler.num_preemptions > 0
    small.engine.block_manager.check_integrity()
    assert small.engine.block_manager.num_used_blocks == 0


# --------------------------------------------------------------------------- Qwen2: some layers windowed


@pytest.fixture(scope="module")
def qwen2_variants(tiny_qwen2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tiny_qwen2 (2 layers) with the window on its second layer, its first, or both."""
    root = tmp_path_factory.mktemp("sw_qwen2")
    common = dict(use_sliding_window=True, sliding_window=WINDOW)
    return {
        "second": _rewrite(tiny_qwen2, root / "second", drop=("layer_types",), max_window_layers=1, **common),
        "first": _rewrite(
            tiny_qwen2, root / "first", max_window_layers=1, layer_types=[SLIDE, FULL], **common
        ),
        "both": _rewrite(tiny_qwen2, root / "both", drop=("layer_types",), max_window_layers=0, **common),
    }


QWEN2_WINDOWS = {"second": (None, WINDOW), "first": (WINDOW, None), "both": (WINDOW, WINDOW)}


@pytest.mark.parametrize("variant", ["second", "first"])
def test_qwen2_mixed_full_and_sliding_layers_match_transformers(
    variant: str, qwen2_variants, tiny_qwen2, sw_prompts, hf_reference
) -> None:
    from transformers import AutoModelForCausalLM

    path = qwen2_variants[variant]
    expected = QWEN2_WINDOWS[variant]
    assert ModelConfig.from_dir(path).layer_windows == expected
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert tuple(layer.self_attn.sliding_window for layer in hf.model.layers) == expected
    prompts = [p for p in sw_prompts if len(p) > WINDOW]
    refs = [hf_reference(path, p, MAX_NEW) for p in prompts]
    # Full attention, and the window on every layer, both answer differently.
    for other in (tiny_qwen2, qwen2_variants["both"]):
        _, logits = hf_reference(other, prompts[-1], MAX_NEW)
        diff = torch.log_softmax(logits[0], -1) - torch.log_softmax(refs[-1][1][0], -1)
        assert diff.abs().max().item() > 1e-2
    llm = LLM(str(path), block_size=BLOCK, num_kv_blocks=256, max_num_batched_tokens=16)
    assert llm.engine.model_runner.model.windows == expected
    _assert_matches(*_generate(llm, prompts), refs)
    _assert_matches(*_generate(llm, prompts), refs)  # prefix-cached
    llm.engine.block_manager.check_integrity()


# --------------------------------------------------------------------------- attention backends


def _paged_batch(seqs: list[tuple[int, int]], *, hkv: int = 2, group: int = 2, head_dim: int = 16,
                 block_size: int = BLOCK, seed: int = 0):  # fmt: skip
    """``seqs`` = [(context_len, query_len)] over caches already holding every K/V (blocks
    scattered at random); returns q, the new K/V (equal to the cached values), caches, metadata."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(need) + 2
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need) + 1
    tables, used = [], 0
    for n in need:
        tables.append(perm[used : used + n] + [0] * (width - n))
        used += n
    meta = AttentionMetadata.for_chunks(seqs, tables, block_size, DEVICE)
    slot_t = meta.slot_mapping.cpu()
    q = torch.randn(sum(n for _, n in seqs), hkv * group, head_dim, generator=gen)
    k = k_cache.view(-1, hkv, head_dim)[slot_t].clone()
    v = v_cache.view(-1, hkv, head_dim)[slot_t].clone()
    return tuple(t.to(DEVICE) for t in (q, k, v, k_cache, v_cache)) + (meta,)


# Decode rows inside, at and far past the window (one group of mixed lengths), a first chunk longer
# than the window, chunks whose context runs past it, and a one-token prompt.
SEQS = [(0, 1), (5, 1), (9, 1), (10, 1), (47, 1), (70, 1), (0, 23), (3, 12), (30, 9), (66, 4), (0, 1)]


@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_backend_windows_match_reference(deterministic: bool) -> None:
    q, k, v, kc, vc, meta = _paged_batch(SEQS, seed=3)
    backend = TorchAttentionBackend(deterministic=deterministic)
    # One step's metadata through layers with different windows (and again: plans are reused).
    for window in (None, WINDOW, 3, 1, 40, WINDOW):
        out = backend.forward(q, k, v, kc, vc, meta, 0.3, window)
        assert (
            out.double().cpu() - reference_attention(q, kc, vc, meta, 0.3, window)
        ).abs().max().item() < 1e-5
    assert set(meta.backend_state.windows) == {(w, None) for w in (None, WINDOW, 3, 1, 40)}  # (window, chunk)
    if deterministic:
        # The windowed rows of a long sequence are the same bits alone, chunked, or as decode rows.
        q1, k1, v1, kc1, vc1, meta1 = _paged_batch([(0, 70)], seed=4)
        alone = backend.forward(q1, k1, v1, kc1, vc1, meta1, 0.3, WINDOW)
        for ctx, n in [(0, 33), (33, 31), (64, 6), (69, 1), (41, 1)]:
            meta_c = _sub_meta(meta1, ctx, n)
            rows = slice(ctx, ctx + n)
            got = backend.forward(q1[rows], k1[rows], v1[rows], kc1, vc1, meta_c, 0.3, WINDOW)
            assert torch.equal(got, alone[rows]), (ctx, n)


def _sub_meta(meta: AttentionMetadata, ctx: int, n: int) -> AttentionMetadata:
    """Sequence 0 of ``meta`` with only positions ctx..ctx+n-1 new."""
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[ctx : ctx + n],
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([ctx + n], dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor([ctx], dtype=torch.int32, device=DEVICE),
        block_tables=meta.block_tables,
        max_query_len=n,
        max_seq_len=ctx + n,
        query_lens_host=[n],
        seq_lens_host=[ctx + n],
        context_lens_host=[ctx],
        block_tables_host=meta.block_tables_host,
        block_size=meta.block_size,
    )


# --------------------------------------------------------------------------- Triton (interpreter on CPU)


def test_triton_kernels_window_match_reference() -> None:
    pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")
    from engine.kernels.triton_attention import unified_attention
    from engine.kernels.triton_decode import split_kv_decode_attention

    q, _, _, kc, vc, meta = _paged_batch(SEQS, seed=5)
    for window in (None, WINDOW, 1, 40):
        out = unified_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.3,
                                window=window, block_n=16)  # fmt: skip
        assert (
            out.double().cpu() - reference_attention(q, kc, vc, meta, 0.3, window)
        ).abs().max().item() < 1e-5
    dec = [(n - 1, 1) for n in (1, 9, 40, 41, 70, 100)]
    q, _, _, kc, vc, meta = _paged_batch(dec, seed=6)
    for window in (None, WINDOW, 40):
        out = split_kv_decode_attention(q, kc, vc, meta.seq_lens, meta.block_tables, 0.3, meta.max_seq_len,
                                        window=window, split_size=32, block_n=16)  # fmt: skip
        assert (
            out.double().cpu() - reference_attention(q, kc, vc, meta, 0.3, window)
        ).abs().max().item() < 1e-5
    # Deterministic promise with a window: a prompt's rows are the same bits however it is chunked.
    q, _, _, kc, vc, meta = _paged_batch([(0, 70)], seed=7)
    full = unified_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.3,
                             window=WINDOW, block_n=16)  # fmt: skip
    for ctx, n in [(0, 20), (20, 29), (49, 21), (69, 1)]:
        m = _sub_meta(meta, ctx, n)
        got = unified_attention(q[ctx : ctx + n], kc, vc, m.query_start_loc, m.seq_lens, m.block_tables, 0.3,
                                window=WINDOW, block_n=16)  # fmt: skip
        assert torch.equal(got, full[ctx : ctx + n]), (ctx, n)


def test_triton_backend_split_kv_decode_with_a_window() -> None:
    """A decode step whose window spans several splits takes the split-KV path."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")
    from engine.attention.triton_backend import TritonAttentionBackend
    from engine.kernels.triton_decode import split_kv_decode_attention

    q, k, v, kc, vc, meta = _paged_batch([(129, 1), (4, 1), (69, 1)], seed=8)
    backend = TritonAttentionBackend(split_size=64)
    out = backend.forward(q, k, v, kc, vc, meta, 0.3, 80)
    assert (out.double().cpu() - reference_attention(q, kc, vc, meta, 0.3, 80)).abs().max().item() < 1e-5
    split = split_kv_decode_attention(q, kc, vc, meta.seq_lens, meta.block_tables, 0.3, meta.max_seq_len,
                                      window=80, split_size=64)  # fmt: skip
    assert torch.equal(out, split)


def test_triton_engine_matches_transformers(mistral, sw_prompts, refs) -> None:
    pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")
    opts = dict(attention_backend="triton", block_size=BLOCK, num_kv_blocks=128, max_num_batched_tokens=16)
    llm = LLM(str(mistral), **opts)
    assert llm.engine.model_runner.model.attention.name == "triton"
    _assert_matches(*_generate(llm, sw_prompts[2:5]), refs[2:5])  # 11, 26 and 47 tokens
    # Deterministic: the long prompt's logits are the same bits alone, batched and after a prefix hit.
    det = LLM(str(mistral), deterministic=True, **opts)
    target = LENGTHS.index(70)
    solo_out, solo = _generate(det, [sw_prompts[target]])
    _assert_matches(solo_out, solo, [refs[target]])
    cached_out, cached = _generate(det, [sw_prompts[target]])
    assert cached_out[0].num_cached_tokens == 68
    _, batched = _generate(LLM(str(mistral), deterministic=True, **opts), sw_prompts[4:])
    assert torch.equal(cached[0], solo[0]) and torch.equal(batched[target - 4], solo[0])
