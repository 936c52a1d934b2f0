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
from dataclasses import dataclass
from typing import Any

# Images decoded from a request may not be larger than this (Pillow's decompression-bomb guard
# at its warning level, as vLLM leaves it): a few bytes of PNG must not become gigabytes of pixels.
MAX_IMAGE_PIXELS = 89_478_485


@dataclass(frozen=True)
class ImageSpec:
    """How a vision-language model takes images (``ModelInfo.image``; None for text-only models)."""

    image_token: str  # the placeholder text chat templates write (``<image>``)
    image_token_id: int
    tokens_per_image: int  # the placeholder run one image becomes


@dataclass
class ImageInput:
    """One image of a request: its placeholder run and its processed pixels (engine side)."""

    offset: int  # first placeholder position in the prompt
    length: int  # placeholder tokens (the rows of its features)
    pixel_values: Any  # torch tensor [1, channels, height, width]
    digest: bytes  # content hash of the pixels: keys the KV blocks it touches


def image_runs(ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(first position, length) of each run of consecutive image tokens in ``ids``."""
    runs: list[tuple[int, int]] = []
    i, n = 0, len(ids)
    while i < n:
        if ids[i] == image_token_id:
            j = i
            while j < n and ids[j] == image_token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def expand_image_tokens(ids: list[int], spec: ImageSpec, num_images: int) -> list[int]:
    """``ids`` with each single image token expanded to the image's placeholder run. Raises
    ValueError unless the prompt holds exactly ``num_images`` image tokens (or expanded runs)."""
    runs = image_runs(ids, spec.image_token_id)
    if len(runs) != num_images:
        raise ValueError(
            f"the prompt has {len(runs)} image placeholders ({spec.image_token}) but {num_images} "
            f"image{'s were' if num_images != 1 else ' was'} given"
        )
    if all(length == spec.tokens_per_image for _, length in runs):
        return list(ids)
    if any(length != 1 for _, length in runs):
        raise ValueError(
            f"each image takes one {spec.image_token} token in the prompt (or a run of "
            f"{spec.tokens_per_image}, already expanded)"
        )
    out: list[int] = []
    last = 0
    for first, _ in runs:
        out.extend(ids[last:first])
        out.extend([spec.image_token_id] * spec.tokens_per_image)
        last = first + 1
    out.extend(ids[last:])
    return out


def open_image(data: bytes) -> Any:
    """A decoded RGB ``PIL.Image`` from encoded bytes; ValueError when they are not an image Pillow
    can decode, or one past ``MAX_IMAGE_PIXELS``."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
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
