"""The model shape read from a Hugging Face ``config.json`` (both transformers 4 and 5 spellings)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.models.config_alibi import ALIBI_ARCHS, AlibiConfig, alibi_config, alibi_settings
from engine.models.config_arch import (
    _GEMMA2_DEFAULTS,
    _GPT_OSS_DEFAULTS,
    ARCH_DEFAULTS,
    _gemma3_text_config,
    _llava_config,
)
from engine.models.config_classic import CLASSIC_CONFIGS
from engine.models.config_learned import LEARNED_ARCHS, AbsoluteConfig, absolute_config, learned_config
from engine.models.config_llama4 import LLAMA4_ARCHS, Llama4Config, llama4, llama4_text_config
from engine.models.config_parts import (
    GemmaConfig,
    MLAConfig,
    MoEConfig,
    VisionConfig,
    _fp8_block,
    _gemma,
    _layer_ropes,
    _mla,
    _moe,
    _rope,
    _sliding_windows,
)
from engine.models.config_phimoe import PhimoeConfig, phimoe
from engine.models.config_vision_text import VISION_TEXT, vision_text_config
from engine.models.quant_config import WeightQuant, from_config

__all__ = [
    "GemmaConfig",
    "MLAConfig",
    "AbsoluteConfig",
    "AlibiConfig",
    "ModelConfig",
    "MoEConfig",
    "VisionConfig",
    "matryoshka_dimensions",
    "read_hf_config",
]


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
    hidden_act: str = "silu"  # the MLP's activation (config.json's hidden_act), read by ungated MLPs
    sliding_window: int | None = None  # attention window (Mistral, Qwen2); None: full attention
    # Per layer: the window that layer attends within, or None for full attention. A query at
    # position q sees keys k with q - window < k <= q (transformers' sliding mask).
    layer_windows: tuple[int | None, ...] = ()
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    partial_rotary_factor: float = 1.0  # the share of each head's dims that rotate (Phi-4-mini: 0.75)
    # GLM-4 and ERNIE 4.5 rotate pairs (x0, x1), (x2, x3)… of the rotary dims, not the two halves.
    rope_interleave: bool = False
    # Per layer: its rope's (theta, scaling), None for a layer without rotary (SmolLM3's NoPE layers,
    # EXAONE 4's full ones). Empty: every layer has rope_theta / rope_scaling. (OLMo 3's differ by
    # layer type.)
    layer_rope: tuple[tuple[float, dict[str, Any] | None] | None, ...] = ()
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
    logit_scale: float = 1.0  # Cohere's: logits multiplied by it
    # GPT-NeoX and StableLM's use_parallel_residual: attention and MLP both read the layer's input.
    parallel_residual: bool = False
    # OLMo 1's clip_qkv: the q, k and v projections clamped to [-clip_qkv, clip_qkv]. None: no clamp.
    clip_qkv: float | None = None
    # Ministral 3's (Llama 4's) attention temperature: (beta, original_max_position_embeddings) from
    # rope_parameters; queries at position p times ``1 + beta * log(1 + floor(p / original))``.
    query_position_scale: tuple[float, int] | None = None
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
    # GPT-2 / OPT: learned absolute positions and their options. None: not such a model.
    absolute: AbsoluteConfig | None = None
    llama4: Llama4Config | None = None  # Llama 4: NoPE and chunked layers, its MoE (config_llama4.py)
    phimoe: PhimoeConfig | None = None  # Phi-3.5-MoE: sparsemixer's threshold, longrope (config_phimoe.py)
    alibi: AlibiConfig | None = None  # Bloom, MPT: ALiBi slopes and their options (config_alibi.py)

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
        elif archs[0] in LLAMA4_ARCHS:
            raw = llama4_text_config(raw)
        elif archs[0] in ("Gemma2ForCausalLM", "Gemma2ForSequenceClassification"):
            raw = {**_GEMMA2_DEFAULTS, **raw}
        elif archs[0] == "GptOssForCausalLM":
            raw = {**_GPT_OSS_DEFAULTS, **raw}
        elif archs[0] in LEARNED_ARCHS:
            raw = learned_config(raw)
        elif archs[0] in ALIBI_ARCHS:
            raw = alibi_config(raw)
        elif archs[0] in ARCH_DEFAULTS:
            raw = {**ARCH_DEFAULTS[archs[0]], **raw}
        elif archs[0] in CLASSIC_CONFIGS:  # GPT-NeoX, Phi, StableLM, GPT-J, OLMo 1, Falcon
            raw = CLASSIC_CONFIGS[archs[0]](raw)
        elif archs[0] in VISION_TEXT:  # Mistral 3, the Qwen VL models: their language model, text-only
            raw = vision_text_config(raw)
        model_type = raw.get("model_type", "")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(raw.get("rope_parameters") or {})
        theta, scaling = _rope(
            raw.get("rope_theta") or rope.get("rope_theta"), raw.get("rope_scaling") or rope
        )
        scaling = _longrope(raw, scaling)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").replace("torch.", "")
        # use_bias: ERNIE 4.5's, on every projection (StarCoder2's biases are served).
        if (raw.get("mlp_bias") and model_type != "nemotron") or (
            raw.get("use_bias") and model_type != "starcoder2"
        ):
            raise ValueError("MLP biases (mlp_bias / use_bias = true) are not supported")
        quant = raw.get("quantization_config")
        weight_quant = from_config(quant) if isinstance(quant, dict) else None
        fp8_block = None if weight_quant else _fp8_block(quant)
        num_layers = int(raw["num_hidden_layers"])
        head_dim = int(raw.get("head_dim") or hidden // heads)
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
            head_dim=head_dim,
            # The LayerNorms' epsilon: StarCoder2's norm_epsilon, Cohere's layer_norm_eps.
            rms_norm_eps=float(
                raw.get("rms_norm_eps", raw.get("norm_epsilon", raw.get("layer_norm_eps", 1e-6)))
            ),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(
                raw.get("attention_bias", raw.get("qkv_bias", model_type in ("qwen2", "qwen2_moe")))
                or (model_type == "starcoder2" and raw.get("use_bias"))
            ),
            checkpoint_dtype=dtype,
            eos_token_ids=eos_ids,
            hidden_act=str(raw.get("hidden_act") or "silu"),
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
            logit_scale=float(raw.get("logit_scale") or 1.0),
            parallel_residual=bool(raw.get("use_parallel_residual", False)),
            clip_qkv=float(raw["clip_qkv"]) if raw.get("clip_qkv") is not None else None,
            query_position_scale=_query_position_scale(raw, raw.get("rope_scaling") or rope),
            partial_rotary_factor=_partial_rotary(raw, rope, head_dim),
            rope_interleave=model_type
            in ("glm", "glm4", "helium", "ernie4_5", "ernie4_5_moe", "cohere", "cohere2"),
            layer_rope=_layer_ropes(raw, num_layers, (theta, scaling)),
            swiglu=(float(raw["swiglu_alpha"]), float(raw["swiglu_limit"]))
            if model_type == "gpt_oss"
            else None,
            vision=vision,
            is_matryoshka=raw.get("is_matryoshka") is True or bool(raw.get("matryoshka_dimensions")),
            matryoshka_dimensions=matryoshka_dimensions(raw.get("matryoshka_dimensions")),
            absolute=absolute_config(raw),
            llama4=llama4(raw, num_layers),
            phimoe=phimoe(raw, scaling, head_dim),
            alibi=alibi_settings(raw),
        )


def _longrope(raw: dict[str, Any], scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """``scaling`` with longrope's ``original_max_position_embeddings`` and ``attention_factor``
    resolved as transformers 5 resolves them: a top-level original length wins (Phi3Config's class
    default is 4096), then the scaling's own, then ``max_position_embeddings``; the attention factor is
    the given one or sqrt(1 + ln(factor) / ln(original)), ``factor`` being the given one or
    max_position_embeddings / original. Phi3Config reads the old "su" and "yarn" as longrope."""
    if scaling is None:
        return None
    kind = scaling["rope_type"]
    if raw.get("model_type") == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"
    if kind != "longrope":
        return scaling
    max_len = int(raw.get("max_position_embeddings", 2048))
    top = raw.get("original_max_position_embeddings", 4096 if raw.get("model_type") == "phi3" else None)
    original = int(top or scaling.get("original_max_position_embeddings") or max_len)
    factor = float(scaling.get("factor") or max_len / original)
    mscale = scaling.get("attention_factor")
    if mscale is None:
        mscale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    resolved = {"original_max_position_embeddings": original, "attention_factor": float(mscale)}
    return {**scaling, "rope_type": "longrope", **resolved}


def _partial_rotary(raw: dict[str, Any], rope: dict[str, Any], head_dim: int) -> float:
    """The share of each head's dims that rotate: ``partial_rotary_factor`` (transformers 5 keeps it in
    ``rope_parameters``), or MiniMax-M2's ``rotary_dim``, or GLM's and GLM-4's class default of a half."""
    factor = raw.get("partial_rotary_factor") or rope.get("partial_rotary_factor")
    if not factor and raw.get("rotary_dim"):
        factor = int(raw["rotary_dim"]) / head_dim
    return float(factor or (0.5 if raw.get("model_type") in ("glm", "glm4") else 1.0))


def _query_position_scale(raw: dict[str, Any], rope: dict[str, Any]) -> tuple[float, int] | None:
    """Ministral 3's ``llama_4_scaling_beta`` with the original context it counts positions in (the
    other families' transformers classes ignore that key)."""
    beta = rope.get("llama_4_scaling_beta")
    if beta is None or raw.get("model_type") != "ministral3":
        return None
    if not rope.get("original_max_position_embeddings"):
        raise ValueError("rope_parameters.llama_4_scaling_beta needs original_max_position_embeddings")
    return float(beta), int(rope["original_max_position_embeddings"])


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
