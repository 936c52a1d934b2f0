"""The parts of a model's shape beyond a plain decoder, and how each is read from a ``config.json``
(defaults filled in): multi-head latent attention, mixtures of experts, Gemma's scalings and
per-layer ropes, a LLaVA checkpoint's image side, rope scalings, sliding windows and block fp8.
``engine/models/config.py``'s ``ModelConfig`` holds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
    # ("group_limited_greedy"). ERNIE 4.5: softmax scores chosen with a correction bias ("noaux_tc").
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
    """Gemma 1/2/3: queries scaled by ``query_pre_attn_scalar ** -0.5`` (Gemma 1: ``head_dim ** -0.5``),
    a rope table per layer (Gemma 3: local layers a small base, global ones a large one, maybe scaled),
    optional soft-capped logits and (Gemma 2) soft-capped attention scores."""

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


Rope = tuple[float, dict[str, Any] | None]  # (theta, scaling)


def _layer_ropes(raw: dict[str, Any], num_layers: int, rope: Rope) -> tuple[Rope | None, ...]:
    """Each layer's rope where it differs between layers (empty: every layer has ``rope``). OLMo 3:
    transformers 5 gives each layer type its own; older configs scale only the full-attention layers.
    SmolLM3: ``no_rope_layers[i] == 0`` marks a layer without rotary (NoPE); EXAONE 4 with a sliding
    window: its full-attention layers have none."""
    model_type = raw.get("model_type")
    if model_type == "olmo3":
        types = _layer_types(raw, num_layers) or ["full_attention"] * num_layers
        params = raw.get("rope_parameters") or {}
        if "full_attention" in params:
            ropes = {kind: _rope(p.get("rope_theta"), p) for kind, p in params.items() if p}
        else:
            ropes = {"full_attention": rope, "sliding_attention": (rope[0], None)}
        return tuple(ropes[t] for t in types)
    # Hybrid: the full layers have no rotary. Cohere 2 without a window has rotary on no layer at all.
    if model_type == "cohere2":
        types = _layer_types(raw, num_layers) or ["full_attention"] * num_layers
        return tuple(rope if t == "sliding_attention" and raw.get("sliding_window") else None for t in types)
    if model_type == "exaone4" and raw.get("sliding_window"):
        types = _layer_types(raw, num_layers) or ["full_attention"] * num_layers
        return tuple(rope if t == "sliding_attention" else None for t in types)
    if model_type == "smollm3":
        interval = int(raw.get("no_rope_layer_interval") or 4)
        flags = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
        if len(flags) != num_layers:
            raise ValueError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
        return tuple(rope if flag else None for flag in flags)
    return ()


def _gemma(raw: dict[str, Any], num_layers: int) -> GemmaConfig | None:
    if raw.get("model_type") not in ("gemma", "gemma2", "gemma3_text"):
        return None
    if raw.get("model_type") == "gemma" and raw.get("hidden_act", "gelu") not in (
        "gelu",
        "gelu_pytorch_tanh",
    ):
        # GemmaConfig reads the releases' "gelu" as the tanh approximation, which ferry computes.
        raise ValueError(f"Gemma with hidden_act {raw['hidden_act']!r} is not supported")
    if raw.get("use_bidirectional_attention"):
        raise ValueError(
            "bidirectional attention (use_bidirectional_attention, embedding models) is not supported"
        )
    types = _layer_types(raw, num_layers) or ["full_attention"] * num_layers
    params = raw.get("rope_parameters") or {}
    if raw.get("model_type") in ("gemma", "gemma2"):  # one rope for every layer
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
    # gpt-oss and Granite-MoE softmax their top k logits: the same as all of them softmaxed, the top k
    # renormalised.
    # Phi-3.5-MoE: Mixtral's experts behind its own router (sparsemixer, engine/models/phimoe.py).
    if arch in ("MixtralForCausalLM", "GptOssForCausalLM", "GraniteMoeForCausalLM", "PhimoeForCausalLM"):
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
    # OLMoE: Qwen3-MoE's router on every layer (config_learned.py names its expert width so).
    moe_archs = (
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "OlmoeForCausalLM",
        "Qwen3VLMoeForConditionalGeneration",
    )
    if arch in moe_archs:
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
    if arch == "MiniMaxM2ForCausalLM":  # every layer: sigmoid scores chosen with a correction bias
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
        )
    if arch == "Ernie4_5_MoeForCausalLM":
        # Layers start..end (end -1: the last) whose (i + 1) is a multiple of the interval are MoE.
        layers = int(raw["num_hidden_layers"])
        end = int(raw.get("moe_layer_end_index", -1))
        end = layers - 1 if end == -1 else end
        return MoEConfig(
            num_experts=int(raw.get("moe_num_experts") or raw["num_experts"]),
            experts_per_token=int(raw.get("moe_k") or raw["num_experts_per_tok"]),
            num_shared_experts=int(raw.get("moe_num_shared_experts") or 0),
            intermediate_size=int(raw["moe_intermediate_size"]),
            first_dense_layers=int(raw.get("moe_layer_start_index", 1)),
            num_groups=1,
            topk_groups=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=True,
            scoring="softmax",
            topk_method="noaux_tc",
            sparse_step=int(raw.get("moe_layer_interval") or 1),
            mlp_only_layers=tuple(range(end + 1, layers)),
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
    if model_type == "smollm3":  # SmolLM3Config: only with use_sliding_window, on its NoPE layers
        if not (raw.get("use_sliding_window") and raw.get("sliding_window")):
            return None, (None,) * num_layers
        window = int(raw["sliding_window"])
        types = raw.get("layer_types") or [
            "full_attention" if rope else "sliding_attention"
            for rope in _layer_ropes(raw, num_layers, (0, None))
        ]
        return window, tuple(window if t == "sliding_attention" else None for t in types)
    if model_type == "dots1":  # Dots1Config: layers from max_window_layers on slide, when a window is set
        window = raw.get("sliding_window")
        first = int(raw.get("max_window_layers") or 62)
        types = raw.get("layer_types") or [
            "sliding_attention" if window and i >= first else "full_attention" for i in range(num_layers)
        ]
        if not window:
            return None, (None,) * num_layers
        return int(window), tuple(int(window) if t == "sliding_attention" else None for t in types)
    if model_type == "ministral":  # MinistralConfig: a 4096 window by default, layer_types say where
        window = raw.get("sliding_window", 4096)
        if not window:
            return None, (None,) * num_layers
        types = _layer_types(raw, num_layers) or ["sliding_attention"] * num_layers
        return int(window), tuple(int(window) if t == "sliding_attention" else None for t in types)
    if model_type in ("exaone4", "cohere2") and not raw.get("sliding_window"):
        return None, (None,) * num_layers  # Exaone4Config, Cohere2Config: no window, every layer full
    if model_type in ("gemma2", "gemma3_text", "gpt_oss", "olmo3", "exaone4", "cohere2"):
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
