"""A vision-language model's image processing, on the engine side: transformers' ``AutoProcessor``
from the model directory turns images into pixel values and says how many placeholder tokens an
image takes; ``prepare`` turns a request's prompt ids and images into expanded ids and
``ImageInput``s (placeholder run, pixels, content digest).

The token ids themselves come from ferry's tokenizer (as every prompt's do); the processor's own
expansion of ``<image>`` is what ``tokens_per_image`` is measured from, so the two agree
(``tests/engine/test_llava.py`` checks the ids against the processor's).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.multimodal import (
    SOURCE_DIGEST_KEY,
    ImageInput,
    ImageSpec,
    expand_image_tokens,
    image_offsets,
    tokens_per_image_from_files,
)
from kvcache.keys import DIGEST_SIZE

logger = logging.getLogger(__name__)

# Processed images kept by their bytes' digest (a 336x336 LLaVA image is 1.3 MB of fp32 pixels).
PROCESSED_CACHE_SIZE = 32

# Images one request may carry (an engine-side bound; the server's --limit-mm-per-prompt is
# usually lower).
MAX_IMAGES_PER_REQUEST = 64


class ImageProcessor:
    """One per engine, called from many threads at once (``AsyncEngine.process_images`` runs in
    worker threads): ``process`` keeps a call's state in locals, the cache of processed images is
    read and written under ``_lock`` only, and transformers' image processors read their settings
    in ``preprocess`` and write nothing (tests/engine/test_image_processor_threads.py). Two threads
    that miss the cache on the same image both process it; the results are equal."""

    def __init__(self, model_dir: Path, image_token_id: int) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(model_dir))
        token = getattr(self.processor, "image_token", None) or "<image>"
        # One image's run, measured with the processor's own expansion of a one-image prompt.
        probe = self.processor(text=token, images=[probe_image()], return_tensors="pt")
        count = int((probe["input_ids"][0] == image_token_id).sum())
        if count < 1:
            raise ValueError(f"the model's processor does not expand {token!r} into image tokens")
        self.spec = ImageSpec(token, image_token_id, count)
        # Images read from bytes, processed, by their bytes' digest: a multi-turn chat resends its
        # images with every turn, and beam search sends them with every beam of every step.
        self._processed: OrderedDict[bytes, ProcessedImage] = OrderedDict()
        self._lock = threading.Lock()
        from_files = tokens_per_image_from_files(model_dir)
        if from_files != count:
            logger.warning(
                "the processor makes %d tokens of an image, its files say %s: a router keys image "
                "prompts by the files, so its cache-aware hints for them will miss",
                count,
                from_files,
            )

    def process(self, images: list[Any]) -> list[ProcessedImage]:
        """PIL images as pixel values and digests (ValueError for what the processor cannot take).
        The costly part of ``prepare`` (tens of ms for a photo): the async engine runs it off its
        event loop first."""
        from PIL import Image

        if len(images) > MAX_IMAGES_PER_REQUEST:
            raise ValueError(f"{len(images)} images: at most {MAX_IMAGES_PER_REQUEST} per request")
        if all(isinstance(img, ProcessedImage) for img in images):
            return list(images)
        for img in images:
            if not isinstance(img, Image.Image):
                raise ValueError(f"an image must be a PIL.Image, got {type(img).__name__}")
        if not images:
            return []
        out: list[ProcessedImage | None] = [self._cached(img) for img in images]
        todo = [i for i, done in enumerate(out) if done is None]
        if todo:
            try:
                pixels = self.processor.image_processor(
                    images=[images[i] for i in todo], return_tensors="pt"
                )["pixel_values"]
            except Exception as e:  # the processor's own checks (channels, sizes…)
                raise ValueError(f"the image could not be processed: {type(e).__name__}: {e}") from None
            for i, pixel_values in zip(todo, pixels, strict=True):
                pv = pixel_values.unsqueeze(0).contiguous()
                digest = images[i].info.get(SOURCE_DIGEST_KEY)
                if isinstance(digest, bytes):
                    out[i] = self._keep(digest, ProcessedImage(pv, digest))
                else:
                    out[i] = ProcessedImage(pv, pixel_digest(pv))
        return out  # type: ignore[return-value]

    def _cached(self, image: Any) -> ProcessedImage | None:
        digest = image.info.get(SOURCE_DIGEST_KEY)
        if not isinstance(digest, bytes):
            return None
        with self._lock:
            found = self._processed.get(digest)
            if found is not None:
                self._processed.move_to_end(digest)
            return found

    def _keep(self, digest: bytes, processed: ProcessedImage) -> ProcessedImage:
        with self._lock:
            self._processed[digest] = processed
            self._processed.move_to_end(digest)
            while len(self._processed) > PROCESSED_CACHE_SIZE:
                self._processed.popitem(last=False)
        return processed

    def prepare(self, ids: list[int], images: list[Any]) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each image's placeholder run expanded, and its images' inputs in order
        (``images``: PIL images, or what ``process`` made of them); ValueError for a prompt whose
        placeholders do not match the images, or images the processor cannot take."""
        ids = expand_image_tokens(ids, self.spec, len(images))
        processed = self.process(images)
        length = self.spec.tokens_per_image
        inputs = [
            ImageInput(offset, length, image.pixel_values, image.digest)
            for offset, image in zip(image_offsets(ids, self.spec), processed, strict=True)
        ]
        return ids, inputs


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # [1, channels, height, width]
    digest: bytes  # the source bytes' digest when known (SOURCE_DIGEST_KEY), else pixel_digest


def probe_image() -> Any:
    """A small plain image, for measuring what one image becomes."""
    from PIL import Image

    return Image.new("RGB", (32, 32), (128, 64, 32))


def pixel_digest(pixel_values: torch.Tensor) -> bytes:
    """A stable content hash of processed pixels (shape, dtype and bytes): the same image gives the
    same digest in any process, so its KV blocks are found again; another image never does."""
    t = pixel_values.detach().cpu().contiguous()
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    h.update(f"{tuple(t.shape)}:{t.dtype}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes())
    return h.digest()
