"""The model shape read from a Hugging Face ``config.json`` (both transformers 4 and 5 spellings)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.models.quantized import WeightQuant, from_config


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek V2/V3): each token caches one latent vector
    (``kv_lora_rank`` compressed K/V plus ``qk_rope_head_dim`` of rotated key), shared by all heads."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: queries come from one q_proj, not a low-rank pair
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary pairs are (x0, x1), (x2, x3)… rather than the two halves

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek mixture of experts: routed experts chosen per token, shared experts beside them;
    the first ``first_dense_layers`` layers are dense."""

    num_experts: int
    experts_per_token: int
    num_shared_experts: int
    intermediate_size: int  # per expert
    first_dense_layers: int
    num_groups: int
    topk_groups: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    # V3: sigmoid scores, chosen with a correction bias among the best groups (by their top-2 sum).
    # V2: softmax scores, top-k overall ("greedy") or within the best groups by their maximum
    # ("group_limited_greedy").
    scoring: str = "sigmoid"  # sigmoid | softmax
    topk_method: str = "noaux_tc"  # noaux_tc | greedy | group_limited_greedy
    # Qwen3-MoE: every sparse_step-th layer is MoE, except the mlp_only_layers.
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_moe_layer(self, i: int) -> bool:
        return (
            i >= self.first_dense_layers and i not in self.mlp_only_layers and (i + 1) % self.sparse_step == 0
        )


@dataclass(frozen=True)
class GemmaConfig:
    """Gemma 2/3: queries scaled by ``query_pre_attn_scalar ** -0.5``, a rope table per layer
    (Gemma 3: local layers a small base, global ones a large one, maybe scaled), optional
    soft-capped logits and (Gemma 2) soft-capped attention scores."""

    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    layer_rope: tuple[tuple[float, dict[str, Any] | None], ...]  # per layer: (theta, scaling)
    attn_logit_softcapping: float | None = None  # Gemma 2: scores capped at +-this by tanh


@dataclass(frozen=True)
class VisionConfig:
    """A LLaVA checkpoint's image side: the vision tower's own config (``vision_config``), which of
    its hidden states feed the projector and whether the CLS row is dropped (transformers'
    ``vision_feature_layer`` / ``vision_feature_select_strategy``), the projector's activation and
    bias, and the image token."""

    vision_config: dict[str, Any]
    feature_layer: int | tuple[int, ...]
    select_strategy: str  # "default" (drop the CLS row) | "full"
    projector_act: str
    projector_bias: bool
    image_token_id: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None: plain rope; else has "rope_type" (linear | llama3 …)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    checkpoint_dtype: str  # float32 | bfloat16 | float16
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None  # attention window (Mistral, Qwen2); None: full attention
    # Per layer: the window that layer attends within, or None for full attention. A query at
    # position q sees keys k with q - window < k <= q (transformers' sliding mask).
    layer_windows: tuple[int | None, ...] = ()
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    partial_rotary_factor: float = 1.0  # the share of each head's dims that rotate (Phi-4-mini: 0.75)
    gemma: GemmaConfig | None = None
    # Block-quantized fp8 weights (DeepSeek-V3/R1, Qwen3-FP8): each weight's scale covers a block of
    # this shape; the loader dequantizes them to the model dtype. None: unquantized.
    fp8_block: tuple[int, int] | None = None
    # GPTQ / AWQ / compressed-tensors / per-tensor or per-channel fp8 weights, also dequantized at
    # load. None: none of those.
    weight_quant: WeightQuant | None = None
    # Granite's scalings: embeddings times embedding_multiplier, attention scores times
    # attention_multiplier (instead of head_dim ** -0.5), each block's output times
    # residual_multiplier before the residual add, logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # gpt-oss experts' clamped SwiGLU: (alpha, limit), ``(clamp(up) + 1) * g * sigmoid(alpha * g)``
    # with g the gate clamped above at limit. None: not gpt-oss.
    swiglu: tuple[float, float] | None = None
    # A vision-language model (LLaVA): its vision tower and projector settings. None: text only.
    vision: VisionConfig | None = None
    # Matryoshka embeddings, as vLLM reads config.json (and --hf-overrides): ``is_matryoshka`` or
    # a non-empty ``matryoshka_dimensions`` lets an embedding request keep fewer ``dimensions``;
    # the list, when given, names the only sizes a request may ask for.
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    # The paged KV cache per layer: ``kv_cache_parts`` tensors (K and V, or MLA's one latent) of
    # ``[num_blocks, block_size, kv_cache_heads, kv_cache_dim]``.
    @property
    def kv_cache_parts(self) -> int:
        return 1 if self.mla else 2

    @property
    def kv_cache_heads(self) -> int:
        return 1 if self.mla else self.num_kv_heads

    @property
    def kv_cache_dim(self) -> int:
        return self.mla.latent_dim if self.mla else self.head_dim

    @property
    def quant_method(self) -> str | None:
        """The checkpoint's ``quantization_config.quant_method`` as ferry loads it (None: unquantized)."""
        if self.weight_quant is not None:
            return self.weight_quant.method
        return "fp8" if self.fp8_block is not None else None

    @property
    def kv_layout(self) -> str:
        """Names the cache layout in the tier fingerprint: blocks of another layout never mix."""
        return "latent:[block,token,1,dim]" if self.mla else "k,v:[block,token,kv_head,dim]"

    @classmethod
    def from_dir(cls, model_dir: str | Path, overrides: dict[str, Any] | None = None) -> ModelConfig:
        return cls.from_dict(read_hf_config(model_dir, overrides))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError("config.json names no 'architectures'")
        vision = None
        if archs[0] in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
            raw = _gemma3_text_config(raw)
        elif archs[0] == "LlavaForConditionalGeneration":
            raw, vision = _llava_config(raw)
        elif archs[0] in ("Gemma2ForCausalLM", "Gemma2ForSequenceClassification"):
            raw = {**_GEMMA2_DEFAULTS, **raw}
        elif archs[0] == "GptOssForCausalLM":
            raw = {**_GPT_OSS_DEFAULTS, **raw}
        model_type = raw.get("model_type", "")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(raw.get("rope_parameters") or {})
        theta, scaling = _rope(
            raw.get("rope_theta") or rope.get("rope_theta"), raw.get("rope_scaling") or rope
        )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").replace("torch.", "")
        if raw.get("mlp_bias"):
            raise ValueError("MLP biases (mlp_bias=true) are not supported")
        quant = raw.get("quantization_config")
        weight_quant = from_config(quant) if isinstance(quant, dict) else None
        fp8_block = None if weight_quant else _fp8_block(quant)
        num_layers = int(raw["num_hidden_layers"])
        window, layer_windows = _sliding_windows(raw, model_type, num_layers)
        return cls(
            architecture=archs[0],
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(
                raw.get("attention_bias", raw.get("qkv_bias", model_type in ("qwen2", "qwen2_moe")))
            ),
            checkpoint_dtype=dtype,
            eos_token_ids=eos_ids,
            sliding_window=window,
            layer_windows=layer_windows,
            mla=_mla(raw),
            moe=_moe(raw),
            gemma=_gemma(raw, num_layers),
            fp8_block=fp8_block,
            weight_quant=weight_quant,
            embedding_multiplier=float(raw.get("embedding_multiplier") or 1.0),
            attention_multiplier=float(raw["attention_multiplier"])
            if raw.get("attention_multiplier")
            else None,
            residual_multiplier=float(raw.get("residual_multiplier") or 1.0),
            logits_scaling=float(raw.get("logits_scaling") or 1.0),
            partial_rotary_factor=float(
                raw.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
            ),
            swiglu=(float(raw["swiglu_alpha"]), float(raw["swiglu_limit"]))
            if model_type == "gpt_oss"
            else None,
            vision=vision,
            is_matryoshka=raw.get("is_matryoshka") is True or bool(raw.get("matryoshka_dimensions")),
            matryoshka_dimensions=matryoshka_dimensions(raw.get("matryoshka_dimensions")),
        )


def matryoshka_dimensions(value: Any) -> tuple[int, ...] | None:
    """A config's ``matryoshka_dimensions``: positive integers (None when absent or empty); anything
    else is a ValueError at load, not a list each request would be checked against wrongly."""
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value
    ):
        raise ValueError(f"matryoshka_dimensions must be a list of positive integers, not {value!r}")
    return tuple(value)


def read_hf_config(model_dir: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` with vLLM's ``--hf-overrides`` merged over it: each key replaces the file's,
    except that an object given for a sub-config (``text_config``: a key ending in ``_config`` other
    than ``quantization_config``) updates that sub-config key by key, as vLLM updates a nested
    ``PretrainedConfig``; other objects (``rope_scaling``) replace the file's whole."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{model_dir} has no config.json; it is not a Hugging Face model directory"
        ) from None
    return _merged(raw, overrides or {})


def _merged(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(raw)
    for key, value in overrides.items():
        sub = out.get(key)
        if (
            isinstance(value, dict)
            and isinstance(sub, dict)
            and key.endswith("_config")
            and key != "quantization_config"
        ):
            out[key] = _merged(sub, value)
        else:
            out[key] = value
    return out


def _fp8_block(quant: Any) -> tuple[int, int] | None:
    """The block shape of a block-wise fp8 checkpoint; any other quantization is refused by name."""
    if not quant:
        return None
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if (
        method == "fp8"
        and isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        if quant.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 checkpoints in format {quant.get('fmt')!r} are not supported (only e4m3)")
        return int(block[0]), int(block[1])
    detail = (
        f"fp8 weight_block_size={block!r}"
        if method == "fp8"
        else f"quantization_config.quant_method={method!r}"
    )
    raise ValueError(
        f"quantized checkpoints are not supported ({detail}); fp8 (block-wise, per tensor or per channel), "
        "GPTQ, AWQ, compressed-tensors and bfloat16/float16/float32 weights are"
    )


def _rope(theta: Any, scaling: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) with the scaling's kind in ``rope_type``; None for plain rope."""
    if scaling:
        scaling = dict(scaling)
        kind = scaling.get("rope_type") or scaling.get("type") or "default"
        scaling["rope_type"] = kind
        if kind == "default":
            scaling = None
    return float(theta or 10000.0), scaling or None


def _layer_types(raw: dict[str, Any], num_layers: int) -> list[str] | None:
    """Gemma 3's per-layer attention kinds: ``layer_types``, or every ``sliding_window_pattern``-th
    layer full and the others sliding."""
    types = raw.get("layer_types")
    if types is None and raw.get("sliding_window_pattern"):
        pattern = int(raw["sliding_window_pattern"])
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if types is not None and len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    return types


# Gemma3TextConfig's defaults: the multimodal checkpoints' text_config leaves most of them out.
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "model_type": "gemma3_text",
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "max_position_embeddings": 131072,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "tie_word_embeddings": True,
    "eos_token_id": 1,
}


def _gemma3_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's config with Gemma3TextConfig's defaults filled in; for a multimodal
    checkpoint (Gemma3ForConditionalGeneration) its ``text_config``, served text-only."""
    text = raw.get("text_config") or raw
    top = {
        k: raw[k]
        for k in ("architectures", "eos_token_id", "dtype", "torch_dtype", "quantization_config")
        if k in raw
    }
    merged = {**_GEMMA3_TEXT_DEFAULTS, **text, **top}
    merged["model_type"] = "gemma3_text"
    if "text_config" in raw:
        merged["final_logit_softcapping"] = None  # transformers' multimodal Gemma 3 never applies it
    return merged


# LlamaConfig's defaults (LLaVA's default text model), for text_configs that leave them out.
_LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}


def _llava_config(raw: dict[str, Any]) -> tuple[dict[str, Any], VisionConfig]:
    """A LLaVA checkpoint's language model config (its ``text_config``, LlavaConfig's Llama default
    when absent) and its image side, with LlavaConfig's defaults."""
    text = dict(raw.get("text_config") or {})
    text.setdefault("model_type", "llama")
    if text["model_type"] == "llama":  # the hub's llava-1.5 configs write only what differs from these
        text = {**_LLAMA_DEFAULTS, **text}
    top = {k: raw[k] for k in ("architectures", "dtype", "torch_dtype", "quantization_config") if k in raw}
    layer = raw.get("vision_feature_layer", -2)
    vision = VisionConfig(
        vision_config=dict(raw.get("vision_config") or {"model_type": "clip_vision_model"}),
        feature_layer=tuple(int(x) for x in layer) if isinstance(layer, list) else int(layer),
        select_strategy=str(raw.get("vision_feature_select_strategy", "default")),
        projector_act=str(raw.get("projector_hidden_act", "gelu")),
        projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        image_token_id=int(raw.get("image_token_id", raw.get("image_token_index", 32000))),
    )
    if vision.select_strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {vision.select_strategy!r} is not supported")
    return {**text, **top}, vision


# Gemma2Config's defaults (layer i slides when i is even).
_GEMMA2_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 2,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
}


# GptOssConfig's defaults (layer i slides when i is even; YaRN stretches 4096 positions 32 times).
_GPT_OSS_DEFAULTS: dict[str, Any] = {
    "head_dim": 64,
    "sliding_window": 128,
    "sliding_window_pattern": 2,
    "attention_bias": True,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    # Under the transformers 5 name, so a config's own rope_scaling / rope_theta (the released
    # checkpoints' spelling) or rope_parameters wins.
    "rope_parameters": {
        "rope_theta": 150000.0,
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
}


def _gemma(raw: dict[str, Any], num_layers: int) -> GemmaConfig | None:
    if raw.get("model_type") not in ("gemma2", "gemma3_text"):
        return None
    if raw.get("use_bidirectional_attention"):
        raise ValueError(
            "bidirectional attention (use_bidirectional_attention, embedding models) is not supported"
        )
    types = _layer_types(raw, num_layers) or ["full_attention"] * num_layers
    params = raw.get("rope_parameters") or {}
    if raw.get("model_type") == "gemma2":  # one rope for every layer
        rope = _rope(raw.get("rope_theta") or params.get("rope_theta"), raw.get("rope_scaling") or params)
        ropes = {"full_attention": rope, "sliding_attention": rope}
    elif "full_attention" in params:  # transformers 5: one entry per layer type
        ropes = {kind: _rope(p.get("rope_theta"), p) for kind, p in params.items() if p}
    else:  # transformers 4: global theta and scaling, a local base frequency
        ropes = {
            "full_attention": _rope(raw.get("rope_theta") or 1_000_000.0, raw.get("rope_scaling")),
            "sliding_attention": (float(raw.get("rope_local_base_freq") or 10000.0), None),
        }
    return GemmaConfig(
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or raw.get("head_dim") or 256),
        final_logit_softcapping=float(raw["final_logit_softcapping"])
        if raw.get("final_logit_softcapping")
        else None,
        layer_rope=tuple(ropes[t] for t in types),
        attn_logit_softcapping=float(raw["attn_logit_softcapping"])
        if raw.get("attn_logit_softcapping")
        else None,
    )


def _mla(raw: dict[str, Any]) -> MLAConfig | None:
    if raw.get("kv_lora_rank") is None:
        return None
    q_rank = raw.get("q_lora_rank")
    return MLAConfig(
        kv_lora_rank=int(raw["kv_lora_rank"]),
        q_lora_rank=int(q_rank) if q_rank else None,
        qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
        qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
        v_head_dim=int(raw["v_head_dim"]),
        # DeepseekV3Config defaults it to True; V2 checkpoints (no key) rotate interleaved pairs too.
        rope_interleave=bool(raw.get("rope_interleave", True)),
    )


def _moe(raw: dict[str, Any]) -> MoEConfig | None:
    arch = (raw.get("architectures") or [""])[0]
    # gpt-oss softmaxes its top k logits: the same as all of them softmaxed, the top k renormalised.
    if arch in ("MixtralForCausalLM", "GptOssForCausalLM"):
        return MoEConfig(
            num_experts=int(raw["num_local_experts"]),
            experts_per_token=int(raw["num_experts_per_tok"]),
            num_shared_experts=0,
            intermediate_size=int(raw["intermediate_size"]),
            first_dense_layers=0,
            num_groups=1,
            topk_groups=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=True,
            scoring="softmax",
            topk_method="greedy",
        )
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return MoEConfig(
            num_experts=int(raw.get("num_experts") or raw["num_local_experts"]),  # transformers 4 / 5
            experts_per_token=int(raw["num_experts_per_tok"]),
            num_shared_experts=1 if raw.get("shared_expert_intermediate_size") else 0,  # Qwen2-MoE
            intermediate_size=int(raw["moe_intermediate_size"]),
            first_dense_layers=0,
            num_groups=1,
            topk_groups=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            scoring="softmax",
            topk_method="greedy",
            sparse_step=int(raw.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        )
    experts = raw.get("n_routed_experts")
    if not experts:
        return None
    if arch == "DeepseekV2ForCausalLM":
        scoring, method = "softmax", raw.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"unsupported DeepSeek-V2 topk_method {method!r} (supported: greedy, group_limited_greedy)"
            )
    else:
        scoring, method = "sigmoid", "noaux_tc"
    return MoEConfig(
        num_experts=int(experts),
        experts_per_token=int(raw["num_experts_per_tok"]),
        num_shared_experts=int(raw.get("n_shared_experts") or 0),
        intermediate_size=int(raw["moe_intermediate_size"]),
        first_dense_layers=int(raw.get("first_k_dense_replace") or 0),
        num_groups=int(raw.get("n_group") or 1),
        topk_groups=int(raw.get("topk_group") or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", scoring == "sigmoid")),
        scoring=scoring,
        topk_method=method,
    )


def _sliding_windows(
    raw: dict[str, Any], model_type: str, num_layers: int
) -> tuple[int | None, tuple[int | None, ...]]:
    """The model's window and each layer's, as transformers reads them (defaults included)."""
    if model_type == "llama":
        return None, (None,) * num_layers  # transformers' Llama ignores a sliding_window entry
    if model_type == "gpt_oss" and not raw.get("sliding_window"):
        return None, (None,) * num_layers  # GptOssAttention: sliding layers without a window see all
    if model_type in ("gemma2", "gemma3_text", "gpt_oss"):
        window = int(raw.get("sliding_window") or 4096)
        types = _layer_types(raw, num_layers) or ["full_attention"] * num_layers
        return window, tuple(window if t == "sliding_attention" else None for t in types)
    # MistralConfig and Qwen2Config both default a missing sliding_window to 4096.
    qwen = model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
    window = raw.get("sliding_window", 4096 if model_type == "mistral" or qwen else None)
    if qwen and not raw.get("use_sliding_window", False):
        window = None  # Qwen2 configs carry a window size but only use it when told to
    if not window:
        return None, (None,) * num_layers
    window = int(window)
    if not qwen:
        return window, (window,) * num_layers
    # Qwen2/Qwen3: transformers 5 lists layer types; older configs window the layers from
    # max_window_layers on.
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    return window, tuple(window if t == "sliding_attention" else None for t in types)
