"""config.json ``architectures`` -> model class. Adding an architecture is one line here."""

from __future__ import annotations

import importlib

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "engine.models.llama:LlamaForCausalLM",
    # Base models saved without a head, served for embeddings (and generation with tied logits).
    "LlamaModel": "engine.models.llama:LlamaForCausalLM",
    "MistralModel": "engine.models.llama:LlamaForCausalLM",
    "Qwen2Model": "engine.models.llama:LlamaForCausalLM",
    "Qwen3Model": "engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "engine.models.llama:LlamaForCausalLM",  # Mistral + MoE MLPs
    # MiniMax-M2: q/k norm over all heads, partial rotary, MoE with a sigmoid router and correction bias.
    "MiniMaxM2ForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "ArceeForCausalLM": "engine.models.arcee:ArceeForCausalLM",  # Llama + an ungated ReLU^2 MLP
    "ApertusForCausalLM": "engine.models.arcee:ApertusForCausalLM",  # Arcee's MLP with xIELU + q/k norm
    # StarCoder2: LayerNorms with bias, biases on every projection, an ungated GELU MLP, a window.
    "Starcoder2ForCausalLM": "engine.models.starcoder2:Starcoder2ForCausalLM",
    # Command R: parallel attention and MLP on one LayerNorm, interleaved rotary, scaled logits.
    "CohereForCausalLM": "engine.models.cohere:CohereForCausalLM",
    "Cohere2ForCausalLM": "engine.models.cohere:CohereForCausalLM",  # + sliding layers, NoPE full ones
    "Qwen2ForCausalLM": "engine.models.llama:LlamaForCausalLM",  # Llama + q/k/v bias
    # The classic LayerNorm families: partial rotary, biases, parallel or sequential residuals.
    "GPTNeoXForCausalLM": "engine.models.classic:GPTNeoXForCausalLM",  # Pythia: per-head fused qkv
    "PhiForCausalLM": "engine.models.classic:PhiForCausalLM",  # phi-1/1.5/2: one norm, parallel blocks
    "StableLmForCausalLM": "engine.models.classic:StableLmForCausalLM",  # SwiGLU, per-head q/k norm
    "GPTJForCausalLM": "engine.models.classic:GPTJForCausalLM",  # rotary over interleaved pairs
    # Learned absolute positions, LayerNorms, biased MHA and an ungated MLP; GPT-2's Conv1D weights.
    "GPT2LMHeadModel": "engine.models.gpt2:GPT2LMHeadModel",
    "OPTForCausalLM": "engine.models.gpt2:OPTForCausalLM",  # positions offset 2, pre- or post-norm
    # ALiBi position biases: Bloom (embedding LayerNorm, per-head fused qkv, biases), MPT (no biases).
    "BloomForCausalLM": "engine.models.bloom:BloomForCausalLM",
    "MptForCausalLM": "engine.models.bloom:MptForCausalLM",
    "MPTForCausalLM": "engine.models.bloom:MptForCausalLM",  # MosaicML's hub configs (their own code)
    # OLMoE: Llama + q/k RMSNorm over whole projections + MoE MLPs (softmax top-k router).
    "OlmoeForCausalLM": "engine.models.llama:LlamaForCausalLM",
    # Nemotron-4 / Minitron: LayerNorm1p, partial rotary, an ungated ReLU^2 MLP.
    "NemotronForCausalLM": "engine.models.nemotron:NemotronForCausalLM",
    "OlmoForCausalLM": "engine.models.classic:OlmoForCausalLM",  # LayerNorms without weights, clip_qkv
    # Falcon 7B/40B/180B: multi-query or grouped KV, parallel blocks on one or two LayerNorms.
    "FalconForCausalLM": "engine.models.falcon:FalconForCausalLM",
    "GraniteForCausalLM": "engine.models.llama:LlamaForCausalLM",  # Llama + four scalings
    "GraniteMoeForCausalLM": "engine.models.llama:LlamaForCausalLM",  # Granite + MoE MLPs (Mixtral's router)
    "Glm4MoeForCausalLM": "engine.models.llama:LlamaForCausalLM",  # GLM-4.5: Llama attention + V3-style MoE
    "Dots1ForCausalLM": "engine.models.llama:LlamaForCausalLM",  # dots.llm1: Qwen3 attention + V3-style MoE
    "Olmo2ForCausalLM": "engine.models.olmo:Olmo2ForCausalLM",  # norms after each block, q/k norm
    "Olmo3ForCausalLM": "engine.models.olmo:Olmo2ForCausalLM",  # OLMo 2 + sliding layers, rope per layer type
    # EXAONE 4: OLMo 3 with per-head q/k norm, its full layers without rotary.
    "Exaone4ForCausalLM": "engine.models.olmo:Olmo2ForCausalLM",
    "HunYuanDenseV1ForCausalLM": "engine.models.llama:LlamaForCausalLM",  # q/k norm after rotary, NTK-alpha
    "SeedOssForCausalLM": "engine.models.llama:LlamaForCausalLM",  # Llama + q/k/v bias
    "SmolLM3ForCausalLM": "engine.models.llama:LlamaForCausalLM",  # Llama + NoPE layers (no_rope_layers)
    # GLM-4-0414: sandwich norms, fused gate_up, q/k/v bias, half of each head rotated in pairs.
    "Glm4ForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "GlmForCausalLM": "engine.models.llama:LlamaForCausalLM",  # GLM-4-9B: GLM-4-0414 without its extra norms
    "HeliumForCausalLM": "engine.models.llama:LlamaForCausalLM",  # Llama + rope in interleaved pairs
    "MinistralForCausalLM": "engine.models.llama:LlamaForCausalLM",  # Mistral + sliding/full layer_types
    # Ministral 3: Mistral + YaRN and Llama 4's position-dependent query scaling.
    "Ministral3ForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "Ernie4_5ForCausalLM": "engine.models.llama:LlamaForCausalLM",  # Llama + rope in interleaved pairs
    # ERNIE 4.5 + MoE MLPs: softmax router with a correction bias, shared experts beside.
    "Ernie4_5_MoeForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "Phi3ForCausalLM": "engine.models.llama:LlamaForCausalLM",  # fused qkv / gate_up, partial rotary
    "Qwen2MoeForCausalLM": "engine.models.llama:LlamaForCausalLM",  # Qwen2 + MoE MLPs (gated shared expert)
    "Qwen3ForCausalLM": "engine.models.llama:LlamaForCausalLM",  # Llama + per-head q/k norm
    "Qwen3MoeForCausalLM": "engine.models.llama:LlamaForCausalLM",  # Qwen3 + MoE MLPs
    "GemmaForCausalLM": "engine.models.gemma:GemmaForCausalLM",  # Gemma 1: Llama's norm placement
    "Gemma2ForCausalLM": "engine.models.gemma:GemmaForCausalLM",  # soft-capped attention and logits
    "Gemma3ForCausalLM": "engine.models.gemma:GemmaForCausalLM",  # sandwich norms, local/global layers
    "Gemma3ForConditionalGeneration": "engine.models.gemma:GemmaForCausalLM",  # its text model only
    # Vision-language checkpoints whose language model is served text-only (images refused with a 400).
    "Mistral3ForConditionalGeneration": "engine.models.vision_text:VisionTextForCausalLM",  # Mistral text
    "Qwen2VLForConditionalGeneration": "engine.models.vision_text:VisionTextForCausalLM",  # Qwen2 + M-RoPE
    "Qwen2_5_VLForConditionalGeneration": "engine.models.vision_text:VisionTextForCausalLM",
    "Qwen3VLForConditionalGeneration": "engine.models.vision_text:VisionTextForCausalLM",  # Qwen3 + M-RoPE
    "Qwen3VLMoeForConditionalGeneration": "engine.models.vision_text:VisionTextForCausalLM",  # Qwen3-MoE
    # A CLIP vision tower + projector in front of a Llama-family language model.
    "LlavaForConditionalGeneration": "engine.models.llava:LlavaForConditionalGeneration",
    # Llama 4: NoPE and chunked-attention layers, qk norm, MoE with input-scaled experts + a shared one.
    "Llama4ForCausalLM": "engine.models.llama4:Llama4ForCausalLM",
    "Llama4ForConditionalGeneration": "engine.models.llama4:Llama4ForCausalLM",  # its text model only
    # Phi-3.5-MoE: LayerNorms, q/k/v/o and head biases, longrope, Mixtral's experts behind sparsemixer.
    "PhimoeForCausalLM": "engine.models.phimoe:PhimoeForCausalLM",
    "GptOssForCausalLM": "engine.models.gpt_oss:GptOssForCausalLM",  # sinks, sliding/full, biased MoE
    "DeepseekV2ForCausalLM": "engine.models.deepseek:DeepseekForCausalLM",  # MLA + MoE (softmax router)
    "DeepseekV3ForCausalLM": "engine.models.deepseek:DeepseekForCausalLM",  # MLA + MoE (sigmoid router)
    # Classifiers, reward models, cross-encoders: the decoder + a ``score`` head (engine/classifier.py).
    "LlamaForSequenceClassification": "engine.models.llama:LlamaForCausalLM",
    "MistralForSequenceClassification": "engine.models.llama:LlamaForCausalLM",
    "Qwen2ForSequenceClassification": "engine.models.llama:LlamaForCausalLM",
    "Qwen3ForSequenceClassification": "engine.models.llama:LlamaForCausalLM",
    "Gemma2ForSequenceClassification": "engine.models.gemma:GemmaForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type:
    try:
        target = _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        ) from None
    module_name, cls_name = target.split(":")
    return getattr(importlib.import_module(module_name), cls_name)
