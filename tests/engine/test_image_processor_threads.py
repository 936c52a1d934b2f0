"""One ``ImageProcessor`` serves every API worker thread (``AsyncEngine.process_images`` runs it in
``asyncio.to_thread``): many requests' images processed at once, on threads, must each come out
exactly as they do one at a time (pixels and digests), the shared cache of processed images
included (more digests than it keeps, so threads evict each other's entries meanwhile)."""

from __future__ import annotations

import io
import random
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

from engine.image_processor import PROCESSED_CACHE_SIZE, ImageProcessor, ProcessedImage
from engine.multimodal import SOURCE_DIGEST_KEY, open_image
from kvcache.keys import image_source_digest

IMAGE_TOKEN_ID = 1000  # tiny_llava's <image>
NUM_IMAGES = PROCESSED_CACHE_SIZE + 16
THREADS = 8
REQUESTS_PER_THREAD = 12


def _images() -> list[Image.Image]:
    """Distinct noise images of varied sizes and aspect ratios (resized and cropped differently);
    every other one decoded from PNG bytes as the server does (with its bytes' digest: the cached
    path), the rest in-memory images (no digest: pixels hashed on every call)."""
    rng = np.random.default_rng(7)
    images = []
    for i in range(NUM_IMAGES):
        height, width = 20 + 7 * (i % 9), 24 + 5 * (i % 11)
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
        if i % 2 == 0:
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            image = open_image(buf.getvalue())
            image.info[SOURCE_DIGEST_KEY] = image_source_digest(buf.getvalue())
        images.append(image)
    return images


@pytest.fixture
def tiny_switch_interval() -> Iterator[None]:
    """Threads handed the GIL every microsecond: they interleave within the processor's steps."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _key(out: list[ProcessedImage]) -> list[tuple[bytes, bytes]]:
    return [(p.digest, p.pixel_values.numpy().tobytes()) for p in out]


def test_concurrent_processing_equals_one_at_a_time(tiny_llava, tiny_switch_interval) -> None:
    images = _images()
    # One at a time, on a processor of its own.
    reference = ImageProcessor(tiny_llava, IMAGE_TOKEN_ID)
    alone = [reference.process([img])[0] for img in images]
    assert len({p.digest for p in alone}) == NUM_IMAGES
    assert all(p.pixel_values.shape == (1, 3, 32, 32) for p in alone)

    shared = ImageProcessor(tiny_llava, IMAGE_TOKEN_ID)
    rng = random.Random(3)
    # Each request: 1-4 images, some repeated across threads (the same PIL object on two threads).
    requests = [
        [rng.randrange(NUM_IMAGES) for _ in range(rng.randint(1, 4))]
        for _ in range(THREADS * REQUESTS_PER_THREAD)
    ]
    start = threading.Barrier(THREADS)

    def run(thread: int) -> list[tuple[list[int], list[ProcessedImage]]]:
        start.wait(30)
        mine = requests[thread::THREADS]
        return [(picks, shared.process([images[i] for i in picks])) for picks in mine]

    with ThreadPoolExecutor(THREADS) as pool:
        results = [r for batch in pool.map(run, range(THREADS)) for r in batch]

    assert len(results) == len(requests)
    for picks, out in results:
        assert _key(out) == _key([alone[i] for i in picks]), picks  # exact bytes and digests
        assert all(p.pixel_values.dtype == torch.float32 for p in out)
    assert len(shared._processed) <= PROCESSED_CACHE_SIZE
