"""``build_llava``: a random-weight tiny LLaVA checkpoint (CLIP vision tower, projector, the demo
Llama) with its processor, for the tests of image inputs. Torch is imported only when called.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.demo_tokenizer import build_tokenizer

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
