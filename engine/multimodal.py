"""Image inputs of vision-language models, on the torch-free side: what a model's image token is,
how a prompt's image tokens expand into placeholder runs, and opening image bytes. Torch-free
(Pillow is imported when an image is opened), so API servers use it too.

A prompt names an image with one image token (``<image>``) where the chat template or the user put
it; before the engine runs it, each such token becomes a run of ``tokens_per_image`` image tokens,
the positions whose embeddings the model runner replaces with the image's features (as
transformers' processor expands them). A prompt whose runs are already expanded is kept as it is.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Where an image decoded from encoded bytes keeps their digest (``kvcache.keys.image_source_digest``,
# in ``PIL.Image.info``, which survives pickling to the engine process): its KV blocks are keyed by
# it, so a router that reads the same bytes from the request keys them alike. An image given as a
# ``PIL.Image`` (offline) has none and is keyed by its processed pixels.
SOURCE_DIGEST_KEY = "ferry_source_digest"

# Images decoded from a request may not be larger than this (Pillow's decompression-bomb guard
# at its warning level, as vLLM leaves it): a few bytes of PNG must not become gigabytes of pixels.
MAX_IMAGE_PIXELS = 89_478_485
# Formats Pillow decodes by running another program (EPS: Ghostscript, where installed) are never
# opened from a request's bytes: a client's file must not reach an interpreter on the server.
EXTERNAL_DECODER_FORMATS = frozenset({"EPS"})


@dataclass(frozen=True)
class ImageSpec:
    """How a vision-language model takes images (``ModelInfo.image``; None for text-only models)."""

    image_token: str  # the placeholder text chat templates write (``<image>``)
    image_token_id: int
    tokens_per_image: int  # the placeholder run one image becomes


# The token id of every position of a prompt given as embeddings (engine/prompt_embeds.py): it
# stands in the request's token ids and block hashes (whose ``extra`` carries the embeddings'
# digest); the sampler's penalties and the detokenizer never see it.
EMBEDS_PLACEHOLDER_ID = 0


@dataclass
class ImageInput:
    """One span of a request whose input embeddings are not its tokens': an image (its processed
    pixels, encoded when a chunk first reaches it) or prompt embeddings (``features`` given)."""

    offset: int  # first placeholder position in the prompt
    length: int  # placeholder tokens (the rows of its features)
    pixel_values: Any  # torch tensor [1, channels, height, width]; None when features are given
    digest: bytes  # content hash of the pixels or features: keys the KV blocks it touches
    features: Any = None  # torch tensor [length, hidden] in the model's dtype and device: given, not encoded


def image_offsets(ids: list[int], spec: ImageSpec) -> list[int]:
    """The first position of each image's placeholder run in expanded ``ids`` (adjacent images'
    runs touch: a run of k * tokens_per_image image tokens is k images)."""
    offsets: list[int] = []
    i, n, size = 0, len(ids), spec.tokens_per_image
    while i < n:
        if ids[i] == spec.image_token_id:
            j = i
            while j < n and ids[j] == spec.image_token_id:
                j += 1
            if (j - i) % size:
                raise ValueError(
                    f"a run of {j - i} {spec.image_token} tokens is not whole images of {size} tokens each"
                )
            offsets.extend(range(i, j, size))
            i = j
        else:
            i += 1
    return offsets


def expand_image_tokens(ids: list[int], spec: ImageSpec, num_images: int) -> list[int]:
    """``ids`` with each image token expanded to an image's placeholder run (kept as they are when
    already expanded). Raises ValueError unless the prompt holds ``num_images`` image tokens (or
    that many expanded runs)."""
    count = ids.count(spec.image_token_id)
    if count == num_images * spec.tokens_per_image:
        image_offsets(ids, spec)  # checks that the runs are whole images
        return list(ids)
    if count != num_images:
        raise ValueError(
            f"the prompt has {count} image placeholders ({spec.image_token}) but {num_images} "
            f"image{'s were' if num_images != 1 else ' was'} given"
        )
    out: list[int] = []
    for token in ids:
        if token == spec.image_token_id:
            out.extend([token] * spec.tokens_per_image)
        else:
            out.append(token)
    return out


def open_image(data: bytes) -> Any:
    """A decoded RGB ``PIL.Image`` from encoded bytes; ValueError when they are not an image Pillow
    can decode (without another program: ``EXTERNAL_DECODER_FORMATS``), or one past
    ``MAX_IMAGE_PIXELS``."""
    from PIL import Image

    Image.init()  # registers every plugin, so the formats below are all the others
    formats = [f for f in Image.OPEN if f not in EXTERNAL_DECODER_FORMATS]
    try:
        with Image.open(io.BytesIO(data), formats=formats) as img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise ValueError(
                    f"the image is {img.width}x{img.height} pixels, more than {MAX_IMAGE_PIXELS} allowed"
                )
            img.load()
            return img.convert("RGB")
    except ValueError:
        raise
    except Exception as e:  # Pillow raises many types for bad data (UnidentifiedImageError, OSError…)
        raise ValueError(f"the data is not an image that can be decoded ({type(e).__name__})") from None


def tokens_per_image_from_files(model_dir: str | Path) -> int | None:
    """How many placeholder tokens one image becomes, read from a LLaVA-style model's processor
    files as transformers' ``LlavaProcessor`` counts them (patches of the cropped image, plus its
    additional tokens, less the CLS token under the ``default`` feature strategy); None when the
    files do not say. For the router, which keys image prompts without loading the processor; the
    engine measures the count with the processor itself and warns if the two disagree."""
    root = Path(model_dir)
    try:
        processor = json.loads((root / "processor_config.json").read_text())
    except (OSError, ValueError):
        processor = {}
    images = processor.get("image_processor")
    if not isinstance(images, dict):
        try:
            images = json.loads((root / "preprocessor_config.json").read_text())
        except (OSError, ValueError):
            return None
    patch = processor.get("patch_size")
    crop = images.get("crop_size") if images.get("do_center_crop", True) else images.get("size")
    if not isinstance(patch, int) or patch < 1 or not isinstance(crop, dict):
        return None
    height, width = crop.get("height"), crop.get("width")
    if not isinstance(height, int) or not isinstance(width, int):
        return None
    count = (height // patch) * (width // patch) + int(processor.get("num_additional_image_tokens") or 0)
    if processor.get("vision_feature_select_strategy", "default") == "default":
        count -= 1
    return count if count > 0 else None
