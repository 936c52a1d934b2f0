"""LLaVA image inputs in the engine: greedy tokens equal transformers' ``LlavaForConditionalGeneration``
on the same weights and images (one image, two, an image mid-prompt), with an image's placeholder run
split across prefill chunks, under preemption, and through the prefix cache (another image never
shares KV past it; the same image does)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine import LLM, SamplingParams
from engine.multimodal import ImageSpec, expand_image_tokens, tokens_per_image_from_files
from kvcache.keys import block_hashes

IMAGE_ID = 1000
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def image(seed: int, size: tuple[int, int] = (40, 48)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def hf(tiny_llava: Path):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(str(tiny_llava)).eval()
    return model, AutoProcessor.from_pretrained(str(tiny_llava))


@pytest.fixture(scope="module")
def llm(tiny_llava: Path) -> LLM:
    return LLM(str(tiny_llava), num_kv_blocks=64)


def hf_generate(hf, text: str, images: list[Image.Image]) -> tuple[list[int], list[int]]:
    model, processor = hf
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()


CASES = {
    "one image": ("<image>\nwhat is in this picture?", [0]),
    "two images": ("compare <image> with <image> please", [1, 2]),
    "image mid-prompt": ("def f(x):\n    return x  # <image> and then some more text after it", [3]),
    "adjacent images": ("<image><image> two at once", [4, 5]),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_transformers(llm: LLM, hf, case: str) -> None:
    text, seeds = CASES[case]
    images = [image(s) for s in seeds]
    want_prompt, want = hf_generate(hf, text, images)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, PARAMS)[0]
    assert out.prompt_token_ids == want_prompt
    assert out.prompt_token_ids.count(IMAGE_ID) == 16 * len(images)
    assert out.outputs[0].token_ids == want


def test_processor_files_give_the_run_length(tiny_llava: Path, llm: LLM) -> None:
    """What a router reads from the processor files is what the processor makes (default strategy
    here, ``full`` below)."""
    assert tokens_per_image_from_files(tiny_llava) == llm.engine.model_info.image.tokens_per_image == 16


def test_images_read_from_bytes_are_processed_once(llm: LLM) -> None:
    """Keyed by their bytes' digest: the same bytes again (a later turn, another beam) reuse the
    processed pixels; an image given as a PIL.Image is processed each time (keyed by its pixels)."""
    from engine.media import MediaOptions, load_image

    processor = llm.engine.image_processor
    buf = io.BytesIO()
    image(40).save(buf, format="PNG")
    data = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    first = processor.process([load_image(data, MediaOptions())])[0]
    again = processor.process([load_image(data, MediaOptions())])[0]
    assert again is first
    given = image(40)
    assert processor.process([given])[0] is not processor.process([given])[0]
    assert processor.process([given])[0].digest != first.digest  # pixels vs bytes: another key


def test_info_and_expansion(llm: LLM) -> None:
    spec = llm.engine.model_info.image
    assert spec == ImageSpec("<image>", IMAGE_ID, 16)
    assert expand_image_tokens([5, IMAGE_ID, 6], spec, 1) == [5, *[IMAGE_ID] * 16, 6]
    expanded = [5, *[IMAGE_ID] * 16, 6]
    assert expand_image_tokens(expanded, spec, 1) == expanded
    with pytest.raises(ValueError, match="2 image placeholders"):
        expand_image_tokens([IMAGE_ID, 1, IMAGE_ID], spec, 1)
    assert expand_image_tokens([IMAGE_ID, IMAGE_ID], spec, 2) == [IMAGE_ID] * 32  # adjacent images
    with pytest.raises(ValueError, match="not whole images"):
        expand_image_tokens([IMAGE_ID] * 8 + [1] + [IMAGE_ID] * 24, spec, 2)
    with pytest.raises(ValueError, match="1 image placeholders"):
        llm.generate("a <image> b", PARAMS)


def test_split_placeholders_and_preemption(tiny_llava: Path, llm: LLM) -> None:
    """Chunks of 5 tokens split every 16-token run across four steps; 10 blocks of 4 tokens for
    three 40-token sequences preempt some: the tokens stay those of one whole prefill."""
    prompts = [
        {"prompt": f"request {i}: <image> then text", "multi_modal_data": {"image": [image(10 + i)]}}
        for i in range(3)
    ]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
    small = LLM(
        str(tiny_llava),
        block_size=4,
        num_kv_blocks=14,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=5,
    )
    got = [o.outputs[0].token_ids for o in small.generate(prompts, PARAMS)]
    assert got == want
    assert small.engine.scheduler.num_preemptions > 0
    small.engine.block_manager.check_integrity()
    assert all(not r.image_features for r in small.engine.requests.values())


def test_prefix_cache_keeps_images_apart(llm: LLM) -> None:
    """Block size 16: 18 tokens of text, the image's 16, then 22 more. Another image reuses only
    the first block (before the image); the same image reuses all three full blocks."""
    llm.engine.block_manager.reset_prefix_cache()
    text = "here is a long preamble before the image <image> what do you see there? Say it in many words."
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": image(20)}}, PARAMS)[0]
    ids = first.prompt_token_ids
    start = ids.index(IMAGE_ID)
    assert first.num_cached_tokens == 0
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": image(21)}}, PARAMS)[0]
    assert other.prompt_token_ids == ids
    assert other.num_cached_tokens == (start // 16) * 16  # the blocks wholly before the image
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    same = llm.generate({"prompt": text, "multi_modal_data": {"image": image(20)}}, PARAMS)[0]
    assert (len(ids), start) == (56, 18)
    assert same.num_cached_tokens == 48  # every full prompt block, the image's included
    assert same.outputs[0].token_ids == first.outputs[0].token_ids


def test_block_hashes_change_only_where_the_image_is() -> None:
    ids = list(range(100, 148))  # three blocks of 16
    spans = ((20, 16, b"a" * 16),)  # blocks 1 and 2
    plain = block_hashes(ids, 16)
    assert block_hashes(ids, 16, images=()) == plain
    with_a = block_hashes(ids, 16, images=spans)
    with_b = block_hashes(ids, 16, images=((20, 16, b"b" * 16),))
    assert with_a[0] == plain[0] == with_b[0]
    assert len({with_a[1], with_b[1], plain[1]}) == 3
    assert len({with_a[2], with_b[2], plain[2]}) == 3


def test_chat_with_image_parts(llm: LLM, hf) -> None:
    img = image(30)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    question = {"type": "text", "text": "what is this?"}
    by_url = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, question]}]
    by_pil = [{"role": "user", "content": [{"type": "image_pil", "image_pil": img}, question]}]
    text = "<|im_start|>user\n<image>what is this?<|im_end|>\n<|im_start|>assistant\n"
    want_prompt, want = hf_generate(hf, text, [img])
    for messages in (by_url, by_pil):
        out = llm.chat(messages, PARAMS)[0]
        assert out.prompt_token_ids == want_prompt
        assert out.outputs[0].token_ids == want


def test_partial_block_with_an_image(tiny_llava: Path) -> None:
    """Block size 64: a conversation's first turn and its follow-up sit in one partly filled
    block, reused from the finished first turn (partial prefix caching) only with the same image."""
    llm = LLM(str(tiny_llava), block_size=64, num_kv_blocks=8)
    first = llm.generate({"prompt": "look: <image> ok?", "multi_modal_data": {"image": image(40)}}, PARAMS)[0]
    follow_up = [*first.prompt_token_ids, *first.outputs[0].token_ids, 5, 6]  # image run already expanded
    assert len(follow_up) == 33
    other = llm.generate({"prompt_token_ids": follow_up, "multi_modal_data": {"image": image(41)}}, PARAMS)[0]
    assert other.num_cached_tokens == 0
    same = llm.generate({"prompt_token_ids": follow_up, "multi_modal_data": {"image": image(40)}}, PARAMS)[0]
    assert same.num_cached_tokens == 30  # the first turn's computed tokens (prompt + 7 outputs)
    assert llm.engine.scheduler.partial_prefix_hits == 30
    fresh = LLM(str(tiny_llava), block_size=64, num_kv_blocks=8)
    want = fresh.generate({"prompt_token_ids": follow_up, "multi_modal_data": {"image": image(40)}}, PARAMS)[
        0
    ]
    assert same.outputs[0].token_ids == want.outputs[0].token_ids
    llm.engine.block_manager.check_integrity()


def test_feature_layers_and_full_strategy(tmp_path: Path) -> None:
    """``vision_feature_layer`` as a list (hidden states concatenated) and the ``full`` strategy
    (CLS row kept: 17 tokens per image) follow transformers."""
    from engine.demo import build_llava

    path = build_llava(
        tmp_path / "llava_full", seed=25, vision_feature_layer=[-3, -1], vision_feature_select_strategy="full"
    )
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    hf = (
        LlavaForConditionalGeneration.from_pretrained(str(path)).eval(),
        AutoProcessor.from_pretrained(str(path)),
    )
    text = "first <image> then <image> end"
    images = [image(50), image(51, (64, 30))]
    want_prompt, want = hf_generate(hf, text, images)
    llm = LLM(str(path), num_kv_blocks=32, block_size=8, long_prefill_token_threshold=7)
    assert llm.engine.model_info.image.tokens_per_image == 17 == tokens_per_image_from_files(path)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, PARAMS)[0]
    assert out.prompt_token_ids == want_prompt
    assert out.outputs[0].token_ids == want
