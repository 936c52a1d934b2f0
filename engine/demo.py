"""Reproducible tiny checkpoints in Hugging Face format, built locally (never downloaded).

Used for the built-in demo model (`ferry serve` with no --model) and by the tests. The
tokenizer is a byte-level BPE trained on the Python standard library's own sources, so
everything here is deterministic for a given Python version and seed, and offline.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _training_files(limit: int = 60) -> list[str]:
    import string as _string  # a module that is always there, to locate the stdlib

    libdir = Path(_string.__file__).parent
    files = sorted(str(p) for p in libdir.glob("*.py"))
    return files[:limit]


def build_tokenizer(
    out_dir: str | os.PathLike, vocab_size: int = 1000, extra_tokens: Sequence[str] = ()
) -> None:
    """Train a byte-level BPE on stdlib sources and save it with a ChatML chat template.

    ``extra_tokens`` are added whole (not special), as reasoning models add ``<think>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_training_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    if extra_tokens:
        fast.add_tokens(list(extra_tokens))
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out_dir))
    # transformers 5 writes the template to chat_template.jinja; keep it in tokenizer_config.json
    # too, where older loaders and DESIGN.md's model format expect it.
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHATML_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def build_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 1024,
    dtype: str = "float32",
    rope_scaling: dict | None = None,
    tokenizer_vocab_size: int = 1000,
    extra_tokens: Sequence[str] = (),
    num_labels: int | None = None,
    id2label: dict[int, str] | None = None,
) -> Path:
    """Write a random-weight HF checkpoint (config, safetensors, tokenizer) for ``arch``; with
    ``num_labels``, its ``*ForSequenceClassification`` (a ``score`` head, labels ``id2label``).

    ``arch`` is "llama", "qwen2" (attention q/k/v bias), "deepseek_v3" (MLA + MoE: 8 routed
    experts in 2 groups, 2 per token, 1 shared; layer 0 dense; ``rope_scaling`` may be YaRN),
    "deepseek_v2" (softmax router, group-limited), "deepseek_v2_lite" (no q_lora_rank, greedy),
    "qwen3" (per-head q/k norm), "qwen3_moe" (8 experts, 2 per token; layer 0 dense), "mixtral"
    (4 experts, 2 per token), "qwen2_moe" (a gated shared expert too), "phi3" (fused weights,
    partial rotary 0.75), "gemma3" (text; local/global layers, soft-capped logits) or "gemma3_mm"
    (the same text model inside a Gemma3ForConditionalGeneration checkpoint), "gemma2" (soft-capped
    attention), "glm4_moe" (GLM-4.5),
    "granite" (Llama with embedding, attention, residual and logit multipliers), "olmo2" or
    "gpt_oss" (attention sinks, sliding (window 8) and full layers, q/k/v/o biases, YaRN, a biased
    router over 4 biased experts, 2 per token, with a clamped SwiGLU).
    The model's eos is ``<|im_end|>``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, vocab_size=tokenizer_vocab_size, extra_tokens=extra_tokens)
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    vocab = len(tok)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=None,
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        rms_norm_eps=1e-6,
    )
    if arch == "llama":
        cfg = LlamaConfig(**common)
        if rope_scaling:
            cfg.rope_parameters = {"rope_theta": 10000.0, **rope_scaling}
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        cfg = Qwen2Config(**common)
        cls = Qwen2ForCausalLM
    elif arch in ("gemma3", "gemma3_mm"):
        import transformers

        # A sliding (window 8) and a full layer, each with its rope; linear scaling on the full one.

        cfg = transformers.Gemma3TextConfig(
            **common,
            head_dim=hidden_size // num_attention_heads,
            query_pre_attn_scalar=hidden_size // num_attention_heads,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * (num_hidden_layers // 2),
            final_logit_softcapping=30.0,
        )
        cfg.rope_parameters = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 2.0},
        }
        cls = transformers.Gemma3ForCausalLM
        if arch == "gemma3_mm":  # the multimodal checkpoint's layout, a tiny SigLIP vision tower
            vision = transformers.SiglipVisionConfig(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            )
            special = {
                "image_token_index": vocab - 1,
                "boi_token_index": vocab - 3,
                "eoi_token_index": vocab - 2,
            }
            cfg = transformers.Gemma3Config(
                text_config=cfg.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4, **special
            )
            cls = transformers.Gemma3ForConditionalGeneration
    elif arch == "glm4_moe":  # GLM-4.5: q/k/v bias, half-rotary heads, q/k norm; V3-style MoE, layer 0 dense
        import transformers

        cfg = transformers.Glm4MoeConfig(
            **common,
            head_dim=hidden_size // num_attention_heads,
            partial_rotary_factor=0.5,
            attention_bias=True,
            use_qk_norm=True,
            moe_intermediate_size=intermediate_size // 4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.0,
        )
        cls = transformers.Glm4MoeForCausalLM
    elif arch == "gemma2":  # sliding (window 8) and full layers; small caps so the soft-capping matters
        import transformers

        cfg = transformers.Gemma2Config(
            **common,
            head_dim=hidden_size // num_attention_heads,
            query_pre_attn_scalar=hidden_size // num_attention_heads,
            sliding_window=8,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
        )
        cls = transformers.Gemma2ForCausalLM
    elif arch == "gpt_oss":  # sinks, sliding (window 8) and full layers, biased MoE (4 experts, 2 per token)
        import transformers

        cfg = transformers.GptOssConfig(
            **{**common, "rms_norm_eps": 1e-5},
            head_dim=hidden_size // num_attention_heads,
            sliding_window=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            swiglu_limit=_gpt_oss_swiglu_limit(0.5),  # small enough that random weights hit the clamps
        )
        cfg.rope_parameters = rope_scaling or {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 256,
        }
        cls = transformers.GptOssForCausalLM
    elif arch == "olmo2":  # norms after attention and MLP, q/k normalised over whole projections
        import transformers

        cfg, cls = transformers.Olmo2Config(**common), transformers.Olmo2ForCausalLM
    elif arch == "granite":  # Llama with Granite's four multipliers, none of them 1
        import transformers

        scalings = dict(
            embedding_multiplier=2.0, attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=1.5
        )
        cfg, cls = transformers.GraniteConfig(**common, **scalings), transformers.GraniteForCausalLM
    elif arch == "phi3":  # fused qkv_proj / gate_up_proj, a quarter of each head not rotated
        import transformers

        cfg = transformers.Phi3Config(**common, partial_rotary_factor=0.75)
        cls = transformers.Phi3ForCausalLM
    elif arch == "qwen2_moe":  # 8 experts, 2 per token, a gated shared expert; layer 0 dense
        import transformers

        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=intermediate_size // 4)
        shared = dict(shared_expert_intermediate_size=intermediate_size // 2, mlp_only_layers=[0])
        cfg, cls = transformers.Qwen2MoeConfig(**common, **moe, **shared), transformers.Qwen2MoeForCausalLM
    elif arch == "mixtral":  # 4 experts, 2 per token
        import transformers

        moe = dict(num_local_experts=4, num_experts_per_tok=2)
        cfg, cls = transformers.MixtralConfig(**common, **moe), transformers.MixtralForCausalLM
    elif arch in ("qwen3", "qwen3_moe"):
        import transformers

        head_dim = hidden_size // num_attention_heads  # Qwen3Config's default is 128
        if arch == "qwen3":
            cfg, cls = transformers.Qwen3Config(**common, head_dim=head_dim), transformers.Qwen3ForCausalLM
        else:  # 8 experts, 2 per token, normalised; layer 0 dense (mlp_only_layers)
            moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=intermediate_size // 4)
            cfg = transformers.Qwen3MoeConfig(
                **common, head_dim=head_dim, **moe, norm_topk_prob=True, mlp_only_layers=[0]
            )
            cls = transformers.Qwen3MoeForCausalLM
    elif arch.startswith("deepseek"):
        import transformers

        mla_moe = dict(
            moe_intermediate_size=intermediate_size // 4,
            q_lora_rank=hidden_size // 2,
            kv_lora_rank=hidden_size // 4,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
        )
        if arch == "deepseek_v3":
            version = "V3"
        elif arch == "deepseek_v2":
            version, mla_moe["topk_method"] = "V2", "group_limited_greedy"
        elif arch == "deepseek_v2_lite":  # V2-Lite's shape: no query compression, plain top-k
            version, mla_moe["topk_method"], mla_moe["q_lora_rank"] = "V2", "greedy", None
        else:
            raise ValueError(f"unknown tiny architecture {arch!r}")
        cfg = getattr(transformers, f"Deepseek{version}Config")(
            **{**common, "num_key_value_heads": num_attention_heads}, **mla_moe
        )
        if rope_scaling:
            cfg.rope_parameters = {"rope_theta": 10000.0, **rope_scaling}
        cls = getattr(transformers, f"Deepseek{version}ForCausalLM")
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    if num_labels is not None:
        import transformers

        cfg.num_labels = num_labels
        if id2label is not None:
            cfg.id2label, cfg.label2id = dict(id2label), {v: k for k, v in id2label.items()}
        cls = getattr(transformers, cls.__name__.replace("ForCausalLM", "ForSequenceClassification"))
    torch.manual_seed(seed)
    model = cls(cfg)
    # Larger-than-default init so random models produce varied, non-degenerate tokens.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if "embed" not in name else 0.5)
            elif "norm" in name and arch.startswith("gemma"):  # offsets from 1, zero at init
                p.normal_(0.0, 0.1)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
            elif name.endswith("sinks"):  # large enough to take a visible share of attention
                p.normal_(0.0, 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero at init: make it matter (DeepSeek, GLM)
                b.normal_(0.0, 0.1)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    return out


DEMO_SPEC = dict(
    arch="llama",
    seed=1234,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tokenizer_vocab_size=2000,
)


def demo_model_path() -> Path:
    """Where the built-in demo model lives (it may not be built yet: see ``demo_model_dir``)."""
    spec_id = hashlib.sha256(json.dumps(DEMO_SPEC, sort_keys=True).encode()).hexdigest()[:12]
    base = Path(os.environ.get("FERRY_CACHE_DIR") or Path.home() / ".cache" / "ferry")
    return base / f"demo-{spec_id}-py{sys.version_info[0]}{sys.version_info[1]}"


def demo_model_dir() -> Path:
    """Path of the built-in demo model, generated on first use into a per-user cache directory."""
    target = demo_model_path()
    base = target.parent
    if (target / "config.json").exists():
        return target
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="demo-", dir=base))
    try:
        build_model(tmp, **DEMO_SPEC)
    except BaseException:  # a failed or interrupted (Ctrl-C) build leaves nothing behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, target)  # atomic: concurrent first starts never see a half-written model
    except OSError:  # another start's model won the rename
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_layer_draft(out_dir: str | os.PathLike, model_dir: str | os.PathLike, num_layers: int) -> Path:
    """A draft model for speculative decoding cut from a decoder-only checkpoint: its first
    ``num_layers`` layers with its embeddings, final norm and head (same vocabulary, config
    otherwise unchanged). It agrees with the whole model on some tokens, as a smaller model would."""
    from safetensors.torch import load_file, save_file

    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    keep = {}
    for shard in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            parts = name.split(".")
            layer = parts[parts.index("layers") + 1] if "layers" in parts else None
            if layer is None or int(layer) < num_layers:
                keep[name] = tensor
    save_file(keep, out / "model.safetensors")
    return out


def add_mtp_layer(
    out_dir: str | os.PathLike, model_dir: str | os.PathLike, *, seed: int = 0, own_head: bool = True
) -> Path:
    """A copy of a DeepSeek-V3-style checkpoint with a multi-token-prediction layer appended, as
    DeepSeek-V3's own (transformers has none to build): ``model.layers.{N}`` (N =
    ``num_hidden_layers``) with ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and a decoder
    layer of the last one's shapes and names, random (norms and the router's bias copied), and
    ``num_nextn_predict_layers: 1`` in config.json. ``own_head``: the layer also holds
    ``embed_tokens`` and ``shared_head.head`` (copies of the target's, as DeepSeek-V3 ships them);
    else the target's are used."""
    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            (out / path.name).write_bytes(path.read_bytes())
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        weights.update(load_file(shard))
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    dtype = weights["model.embed_tokens.weight"].dtype

    def rand(shape: Sequence[int], std: float) -> torch.Tensor:
        return (torch.randn(tuple(shape), generator=g) * std).to(dtype)

    last, new = f"model.layers.{n - 1}.", f"model.layers.{n}."
    for name, t in list(weights.items()):
        if name.startswith(last):
            kept = name.endswith(("norm.weight", "e_score_correction_bias"))
            weights[new + name[len(last) :]] = t.clone() if kept else rand(t.shape, float(t.float().std()))
    weights[new + "enorm.weight"] = torch.ones(hidden, dtype=dtype)
    weights[new + "hnorm.weight"] = torch.ones(hidden, dtype=dtype)
    weights[new + "shared_head.norm.weight"] = torch.ones(hidden, dtype=dtype)
    weights[new + "eh_proj.weight"] = rand((hidden, 2 * hidden), (2 * hidden) ** -0.5)
    if own_head:
        weights[new + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
        weights[new + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file(weights, out / "model.safetensors")
    return out


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_lora_adapter(
    out_dir: str | os.PathLike,
    model_dir: str | os.PathLike,
    *,
    seed: int = 0,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Sequence[str] = LORA_TARGETS,
    use_rslora: bool = False,
    std: float = 0.05,
) -> Path:
    """Write a random LoRA adapter for the model at ``model_dir`` in PEFT's format
    (``adapter_config.json`` + ``adapter_model.safetensors``). Unlike a freshly initialised PEFT
    adapter (``B = 0``), both matrices are random, so it changes what the model says. Targets
    are PEFT module names; those a layer does not have (an MoE layer's MLP) are skipped."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    model_dir, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in sorted(shapes.items()):
        parts = name.split(".")
        # model.layers.N.{self_attn|mlp}.<module>.weight: experts and shared experts are deeper
        if len(parts) != 6 or parts[1] != "layers" or parts[4] not in targets or parts[5] != "weight":
            continue
        fan_out, fan_in = shape
        key = "base_model.model." + name.removesuffix(".weight")
        tensors[key + ".lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * std
        tensors[key + ".lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * std
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(set(targets)),
        "bias": "none",
        "use_rslora": use_rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


# A chat template that renders image parts as LLaVA's placeholder (ChatML around it).
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_llava(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    image_size: int = 32,
    patch_size: int = 8,
    vision_feature_layer: int | list[int] = -2,
    vision_feature_select_strategy: str = "default",
) -> Path:
    """Write a random-weight ``LlavaForConditionalGeneration`` checkpoint: a 2-layer CLIP vision
    tower (``image_size`` / ``patch_size`` patches, so 16 image tokens per image by default), the
    projector, and the tiny Llama of ``build_model``; its tokenizer has ``<image>`` as a special
    token, and its processor (CLIP image processor + tokenizer) a chat template rendering image parts."""
    import torch
    from transformers import (
        AddedToken,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    tok.add_tokens([AddedToken("<image>", special=True, normalized=False)])
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=16,
    )
    text = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=None,
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        rms_norm_eps=1e-6,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy=vision_feature_select_strategy,
        projector_hidden_act="gelu",
    )
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(cfg).save_pretrained(str(out))
    images = CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=patch_size,
        vision_feature_select_strategy=vision_feature_select_strategy,
        chat_template=LLAVA_CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(str(out))
    return out


def _gpt_oss_swiglu_limit(wanted: float) -> float:
    """``wanted`` where transformers' gpt-oss reads ``swiglu_limit`` from the config, else the 7.0
    that older releases (5.17 among them) hard-code: a checkpoint made here must mean the same to
    transformers as to ferry, which reads the config."""
    import transformers
    from transformers.models.gpt_oss import modeling_gpt_oss

    probe = transformers.GptOssConfig(
        hidden_size=4, intermediate_size=4, num_local_experts=1, swiglu_limit=wanted
    )
    return wanted if modeling_gpt_oss.GptOssExperts(probe).limit == wanted else 7.0
