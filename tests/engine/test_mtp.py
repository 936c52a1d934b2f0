"""Speculative decoding with DeepSeek-V3's multi-token-prediction layer (engine/mtp.py) on a tiny
DeepSeek-V3 checkpoint given an MTP layer (``engine.demo.add_mtp_layer``; transformers builds none).

The layer computes what a reference computes (transformers' DeepSeek-V3 decoder layer, fed by plain
torch ops); every draft the engine proposes, step by step, is the reference's for that history,
through chunked prefill, prefix-cache hits, preemption and KV loaded from a tier; outputs equal
decoding without drafts bit for bit; an MTP layer built to predict exactly what the target will
say has every draft accepted (exact counts).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.demo import add_mtp_layer
from engine.runner_parts import build_batch, split_batch
from engine.sampling_params import StructuredOutputsParams
from engine.spec_decode import SpeculativeConfig
from tests.engine.test_draft_model import _counts, _drained
from tests.engine.test_kv_connector_hooks import CopyConnector, _attach

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[7, 8, 9, 10, 11] * 8, [5, 6], list(range(20, 70)), [3, 4] * 10 + [50, 51, 52]]


def _spec(k: int) -> dict:
    return {"method": "deepseek_mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def mtp_model(tiny_deepseek: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_mtp_layer(tmp_path_factory.mktemp("mtp") / "own_head", tiny_deepseek, seed=3)


@pytest.fixture(scope="module")
def shared_head_model(tiny_deepseek: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The MTP layer without embed_tokens and shared_head.head: the target's serve."""
    return add_mtp_layer(
        tmp_path_factory.mktemp("mtp") / "shared_head", tiny_deepseek, seed=4, own_head=False
    )


def build_echo_mtp(out_dir: Path, model_dir: Path) -> Path:
    """A DeepSeek-V3 checkpoint whose layers add nothing to the residual stream (o_proj and every
    down projection zero), so the target's next token is a function of its current token alone,
    and an MTP layer that computes that function of the token after (eh_proj takes the embedding
    half only, its decoder adds nothing, the head is the target's): every draft is the token the
    target then draws."""
    out = add_mtp_layer(out_dir, model_dir, seed=5)
    weights = load_file(out / "model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]
    for name, t in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t.zero_()
    n = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    eh = torch.zeros(hidden, 2 * hidden)
    eh[:, :hidden] = torch.eye(hidden)
    weights[f"model.layers.{n}.eh_proj.weight"] = eh.to(weights["model.embed_tokens.weight"].dtype)
    weights[f"model.layers.{n}.shared_head.norm.weight"] = weights["model.norm.weight"].clone()
    save_file(weights, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def echo_model(tiny_deepseek: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_echo_mtp(tmp_path_factory.mktemp("mtp") / "echo", tiny_deepseek)


def _ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def _record_drafts(llm: LLM) -> dict[tuple[int, ...], list[int]]:
    """Every proposal from now on: the request's tokens then -> its drafts (an observer around the
    engine's proposer; nothing replaced)."""
    engine, seen = llm.engine, {}
    propose = engine._propose

    def observe(requests) -> None:  # noqa: ANN001
        propose(requests)
        for req in requests:
            if req.spec_token_ids:
                seen[tuple(req.token_ids)] = list(req.spec_token_ids)

    engine._propose = observe
    return seen


class Reference:
    """The MTP layer over a whole history without a paged cache: the target's hidden states from
    transformers' DeepseekV3ForCausalLM, the layer's front (enorm, hnorm, eh_proj) in plain torch,
    and its decoder layer, norm and head as a one-layer transformers DeepseekV3ForCausalLM."""

    def __init__(self, model_dir: Path) -> None:
        import transformers

        config = json.loads((model_dir / "config.json").read_text())
        n = config["num_hidden_layers"]
        self.target = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        w = load_file(model_dir / "model.safetensors")
        p = f"model.layers.{n}."
        self.enorm, self.hnorm, self.eh = (
            w[p + "enorm.weight"],
            w[p + "hnorm.weight"],
            w[p + "eh_proj.weight"],
        )
        self.embed = w.get(p + "embed_tokens.weight", w["model.embed_tokens.weight"])
        self.eps = config["rms_norm_eps"]
        front = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
        state = {
            "model.layers.0." + k[len(p) :]: v
            for k, v in w.items()
            if k.startswith(p) and not k[len(p) :].startswith(front)
        }
        state["model.norm.weight"] = w[p + "shared_head.norm.weight"]
        state["lm_head.weight"] = w.get(p + "shared_head.head.weight", w["lm_head.weight"])
        state["model.embed_tokens.weight"] = w["model.embed_tokens.weight"]
        with tempfile.TemporaryDirectory() as tmp:  # transformers converts the experts' layout on load
            one = {
                **config,
                "num_hidden_layers": 1,
                "first_k_dense_replace": 0,
                "num_nextn_predict_layers": 0,
            }
            (Path(tmp) / "config.json").write_text(json.dumps(one))
            save_file(state, Path(tmp) / "model.safetensors")
            self.block = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        self.outputs: list[torch.Tensor] = []
        self.block.model.layers[0].register_forward_hook(
            lambda m, i, o: self.outputs.append(o[0] if isinstance(o, tuple) else o)
        )

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def front(self, tokens: torch.Tensor, previous: torch.Tensor, first: int) -> torch.Tensor:
        """eh_proj(enorm(embedding) ++ hnorm(previous)) for entries from position ``first`` on."""
        e = self.embed[tokens]
        if first == 0:
            e[0] = 0  # the entry at position 0 reads no embedding
        return torch.cat([self._norm(e, self.enorm), self._norm(previous, self.hnorm)], -1) @ self.eh.T

    @torch.no_grad()
    def entries(self, history: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(front inputs, layer outputs before the norm, logits) of entries 0 .. len - 2."""
        ids = torch.tensor([history])
        hidden = self.target.model(ids).last_hidden_state[0]
        x = self.front(ids[0, 1:], hidden[:-1], 0)
        self.outputs.clear()
        logits = self.block(inputs_embeds=x[None]).logits[0]
        return x, self.outputs[-1][0], logits

    @torch.no_grad()
    def drafts(self, history: list[int], k: int) -> list[int]:
        """The greedy drafts after ``history``: the last entry's, then each chained entry's (its own
        output and draft fed at the next position)."""
        x, out, logits = self.entries(history)
        drafts = [int(logits[-1].argmax())]
        for _ in range(k - 1):
            chained = self.front(torch.tensor(drafts[-1:]), out[-1:], len(history) - 1)
            x = torch.cat([x, chained])
            self.outputs.clear()
            logits = self.block(inputs_embeds=x[None]).logits[0]
            out = self.outputs[-1][0]
            drafts.append(int(logits[-1].argmax()))
        return drafts


def test_config_parses_as_vllm() -> None:
    parse = SpeculativeConfig.parse
    assert (
        parse(_spec(2))
        == parse({"method": "mtp", "num_speculative_tokens": 2})
        == SpeculativeConfig("mtp", 2)
    )
    for bad, match in (
        ({"method": "mtp"}, "needs num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_tokens": 1, "model": "/d"}, "only for method 'draft_model'"),
        ({"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 2}, "only for method 'ngram'"),
        ({"method": "eagle", "num_speculative_tokens": 1}, "not supported .*ngram, draft_model, mtp"),
    ):
        with pytest.raises(ValueError, match=match):
            parse(bad)


def test_the_layer_computes_what_the_reference_does(mtp_model) -> None:
    ref = Reference(mtp_model)
    history = [5, 9, 31, 7, 7, 64, 2, 18, 40, 11]
    x, want_out, want_logits = ref.entries(history)
    llm = LLM(str(mtp_model), num_kv_blocks=8, speculative_config=_spec(1))
    runner = llm.engine.model_runner
    mtp = runner.draft
    ids, positions, meta = build_batch([(history[:-1], 0, [0])], 16, runner.device)
    target = runner.model.forward(ids, positions, runner.kv_caches, meta)
    ids, positions, meta = build_batch([(history[1:], 0, [0])], 16, runner.device)
    out = mtp.model.forward_mtp(ids, positions, target, mtp.kv_caches[0][0], meta, mtp.model.embed)
    torch.testing.assert_close(out.cpu(), want_out, atol=1e-5, rtol=1e-5)  # the reference runs on CPU
    logits = mtp.model.mtp_logits(out, mtp.model.lm_head)
    torch.testing.assert_close(logits.cpu(), want_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model", ["mtp_model", "shared_head_model"])
def test_every_draft_is_the_references(model, request) -> None:
    model_dir = request.getfixturevalue(model)
    llm = LLM(str(model_dir), num_kv_blocks=64, deterministic=True, speculative_config=_spec(2))
    seen = _record_drafts(llm)
    llm.generate(PROMPTS[:2], GREEDY)
    assert len(seen) >= 2 * 4
    _the_references(seen, Reference(model_dir))
    _drained(llm)


def _the_references(seen: dict[tuple[int, ...], list[int]], ref: Reference) -> None:
    assert seen
    for history, drafts in seen.items():
        assert drafts == ref.drafts(list(history), len(drafts)), len(history)


def test_chunks_hits_preemption_and_tier_loads_keep_the_layers_kv(mtp_model) -> None:
    """The drafts proposed for each history are the reference's whether the engine computed the
    prompt in chunks, after a prefix-cache hit, after preemption, or loaded its KV from a tier (the
    MTP layer's entries recomputed from the target's hidden states)."""
    ref = Reference(mtp_model)
    plain = LLM(str(mtp_model), num_kv_blocks=64, deterministic=True)
    want = _ids(plain.generate(PROMPTS, GREEDY))
    # 16 tokens a step, 10 blocks of 16 for 4 sequences (preempted and recomputed), then again (hits).
    small = LLM(
        str(mtp_model), deterministic=True, max_num_batched_tokens=16, num_kv_blocks=10, max_num_seqs=4,
        speculative_config=_spec(2),
    )  # fmt: skip
    drafts = _record_drafts(small)
    assert _ids(small.generate(PROMPTS, GREEDY)) == want
    assert small.engine.scheduler.num_preemptions > 0
    assert _ids(small.generate(PROMPTS, GREEDY)) == want
    assert small.engine.stats().prefix_cache_hits > 0
    _the_references(drafts, ref)
    _drained(small)
    # A tier that holds the target's KV of the prompts' full blocks: the first step of each
    # recomputes the layer's entries for them.
    # 16 tokens a step: the recompute runs in forwards of 16.
    loaded = LLM(
        str(mtp_model), num_kv_blocks=64, deterministic=True, max_num_batched_tokens=16,
        speculative_config=_spec(2),
    )  # fmt: skip
    _attach(loaded, LatentCopyConnector(plain))
    drafts = _record_drafts(loaded)
    got = loaded.generate(PROMPTS, GREEDY)
    assert _ids(got) == want
    assert [o.num_cached_tokens for o in got] == [32, 0, 48, 16]
    _the_references(drafts, ref)
    _drained(loaded)


def test_a_partial_block_hit_keeps_the_layers_kv(mtp_model) -> None:
    ref = Reference(mtp_model)
    spec = LLM(str(mtp_model), num_kv_blocks=64, deterministic=True, speculative_config=_spec(2))
    drafts = _record_drafts(spec)
    prompt = list(range(300, 340))
    first = spec.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    # The next turn: its third block starts with the 12 tokens of the first one's cached partial block.
    spec.generate([prompt + first[0].outputs[0].token_ids + [7, 8, 9]], GREEDY)
    assert spec.engine.stats().partial_prefix_hits == 12
    _the_references(drafts, ref)
    _drained(spec)


def test_recomputes_are_cut_into_forwards_of_the_step_budget() -> None:
    segments = [([1, 2, 3], 5, [0]), ([4, 5, 6, 7, 8], 0, [1]), ([9], 2, [2])]
    assert list(split_batch(segments, 4)) == [
        ([([1, 2, 3], 5, [0]), ([4], 0, [1])], 0, 4),
        ([([5, 6, 7, 8], 1, [1])], 4, 8),
        ([([9], 2, [2])], 8, 9),
    ]


class LatentCopyConnector(CopyConnector):
    """CopyConnector for an MLA model's one latent cache per layer."""

    def load_blocks(self, request, block_ids, block_hashes) -> int:  # noqa: ANN001
        for bid, h in zip(block_ids, block_hashes, strict=True):
            for (src,), (dst,) in zip(self.src_caches, self.dst_caches, strict=True):
                dst[bid].copy_(src[self.src_blocks[h]])
        return len(block_ids)


def test_outputs_equal_decoding_without_drafts(mtp_model) -> None:
    choice = SamplingParams(
        temperature=0.0, max_tokens=6, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.7, seed=6, max_tokens=12, ignore_eos=True, n=2),
        choice,
    ]
    prompts = [p for p in PROMPTS[:3] for _ in params]
    mixed = params * 3
    base = LLM(str(mtp_model), num_kv_blocks=64, deterministic=True)
    want = base.generate(prompts, mixed)
    for k in (1, 3):
        spec = LLM(str(mtp_model), num_kv_blocks=64, deterministic=True, speculative_config=_spec(k))
        got = spec.generate(prompts, mixed)
        assert _ids(got) == _ids(want)
        assert [c.text for o in got for c in o.outputs] == [c.text for o in want for c in o.outputs]
        drafts, drafted, accepted, per_position = _counts(spec)
        assert drafts > 0 and drafted >= accepted and sum(per_position) == accepted
        _drained(spec)


def test_a_layer_that_predicts_the_target_has_every_draft_accepted(echo_model) -> None:
    base = LLM(str(echo_model), num_kv_blocks=64, deterministic=True)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = _ids(base.generate(PROMPTS, params))
    spec = LLM(str(echo_model), num_kv_blocks=64, deterministic=True, speculative_config=_spec(3))
    assert _ids(spec.generate(PROMPTS, params)) == want
    # Each request: its first token from the prefill, then 7 steps of 3 drafts all accepted (4
    # tokens each: 29), then one step without room for drafts (30).
    n = len(PROMPTS)
    assert _counts(spec) == (7 * n, 21 * n, 21 * n, (7 * n,) * 3)
    _drained(spec)


def test_models_without_an_mtp_layer_are_refused_at_startup(tiny_deepseek, tiny_llama, tmp_path) -> None:
    # transformers writes num_nextn_predict_layers: 1 and no layer (as checkpoints stripped of theirs).
    with pytest.raises(ValueError, match=r"has no multi-token-prediction layer \(config.json says"):
        LLM(str(tiny_deepseek), speculative_config=_spec(1))
    none = add_mtp_layer(tmp_path / "none", tiny_deepseek)
    config = json.loads((none / "config.json").read_text())
    (none / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0 or absent"):
        LLM(str(none), speculative_config=_spec(1))
    with pytest.raises(ValueError, match="DeepSeek-V2/V3-style MTP layers only"):
        LLM(str(tiny_llama), speculative_config=_spec(1))


def test_the_layers_kv_takes_its_share_of_every_block(tiny_deepseek, mtp_model) -> None:
    # A block of the target's latent cache: 2 layers x 16 slots x (16 + 8) dims x 4 bytes; the MTP
    # layer's: half that.
    budget = 10 * (3072 + 1536) + 1000
    plain = LLM(str(tiny_deepseek), kv_cache_memory_bytes=budget)
    spec = LLM(str(mtp_model), kv_cache_memory_bytes=budget, speculative_config=_spec(1))
    assert plain.engine.model_runner.bytes_per_block == spec.engine.model_runner.bytes_per_block == 3072
    assert spec.engine.model_runner.kv_bytes_per_block == 3072 + 1536
    assert (plain.engine.block_manager.num_blocks, spec.engine.block_manager.num_blocks) == (15, 10)
    assert [c.shape for c in spec.engine.model_runner.draft.kv_caches[0]] == [(10, 16, 1, 24)]


def test_sleep_releases_the_layers_kv_and_wakes_to_the_same_drafts(echo_model) -> None:
    llm = LLM(str(echo_model), num_kv_blocks=32, enable_sleep_mode=True, speculative_config=_spec(3))
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = _ids(llm.generate(PROMPTS[:1], params))
    mtp = llm.engine.model_runner.draft
    for level in (1, 2):
        llm.sleep(level=level)
        assert mtp.kv_caches == []
        llm.wake_up()
        before = _counts(llm)
        assert _ids(llm.generate(PROMPTS[:1], params)) == want
        assert _counts(llm)[2] - before[2] == 21


def test_weight_updates_reach_the_layer(echo_model, tiny_deepseek, tmp_path) -> None:
    """``reload_weights`` replaces the MTP layer with the target: the echo layer swapped for one
    whose ``eh_proj`` is random (the target's weights unchanged) stops having its drafts accepted,
    and swapping back accepts all again; the outputs never change. A checkpoint without the layer
    is refused before anything changed."""
    scrambled = tmp_path / "scrambled"
    scrambled.mkdir()
    for f in echo_model.iterdir():
        (scrambled / f.name).write_bytes(f.read_bytes())
    weights = load_file(scrambled / "model.safetensors")
    n = json.loads((scrambled / "config.json").read_text())["num_hidden_layers"]
    eh = weights[f"model.layers.{n}.eh_proj.weight"]
    weights[f"model.layers.{n}.eh_proj.weight"] = torch.randn(
        eh.shape, generator=torch.Generator().manual_seed(9)
    )
    save_file(weights, scrambled / "model.safetensors")

    llm = LLM(str(echo_model), num_kv_blocks=32, speculative_config=_spec(3))
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = _ids(llm.generate(PROMPTS[:1], params))
    eh_proj = llm.engine.model_runner.draft.model.eh_proj

    def accepted_of_one_run() -> tuple[int, int]:
        before = _counts(llm)
        assert _ids(llm.generate(PROMPTS[:1], params)) == want
        after = _counts(llm)
        return after[1] - before[1], after[2] - before[2]

    llm.reload_weights(str(scrambled))
    drafted, accepted = accepted_of_one_run()
    assert drafted > 0 and accepted < drafted // 2
    llm.reload_weights(str(echo_model))
    assert accepted_of_one_run() == (21, 21)
    assert llm.engine.model_runner.draft.model.eh_proj is eh_proj  # written in place, not replaced
    with pytest.raises(ValueError, match="has no multi-token-prediction layer"):
        llm.reload_weights(str(tiny_deepseek))
    assert accepted_of_one_run() == (21, 21)
    _drained(llm)


def test_waking_from_level2_brings_the_layer_back_to_the_device(echo_model) -> None:
    """Level 2 sends the MTP layer to host memory and drops the target's weights; waking builds the
    target on the device and must bring the layer back beside it. A CPU engine keeps everything in
    place, so ``meta`` stands in for an accelerator from the wake on (nothing runs after it)."""
    llm = LLM(str(echo_model), num_kv_blocks=32, enable_sleep_mode=True, speculative_config=_spec(3))
    runner = llm.engine.model_runner
    llm.sleep(level=2)
    runner.device = torch.device("meta")
    llm.wake_up(tags=["weights"])
    devices = {t.device for t in vars(runner.draft.model).values() if isinstance(t, torch.Tensor)}
    devices |= {t.device for t in runner.draft.model.layers[0].values() if isinstance(t, torch.Tensor)}
    assert devices == {torch.device("meta")}
    assert runner.model.embed.device == torch.device("meta")
