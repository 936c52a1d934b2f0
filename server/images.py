"""Image content parts of chat requests, for a vision-language model: read them (engine/media.py)
before anything reaches the engine, and give each one its placeholder run in the prompt ids.

Every problem is a 400 before any stream starts: an image part to a text-only model, more images
than ``--limit-mm-per-prompt`` allows, a URL that cannot be read, data that is not an image, or a
chat template that did not place one image token per image.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from engine.media import MediaError, aload_image, check_domain, check_image_count
from engine.multimodal import expand_image_tokens
from server.errors import bad_request
from server.state import ServerState


def image_sources(messages: Sequence[Any] | None) -> list[str]:
    """The image URLs of chat messages (``chat_protocol.ChatMessage``), in order."""
    return [url for message in messages or () for url in message.image_urls]


def check_images(state: ServerState, messages: Sequence[Any] | None) -> list[str]:
    """The messages' image URLs; 400 unless this model takes that many images in one prompt."""
    sources = image_sources(messages)
    if sources and state.limits.image is None:
        first = next(i for i, m in enumerate(messages or ()) if m.image_urls)
        raise bad_request(
            "image content parts are not supported: this model takes text only", param=f"messages.{first}"
        )
    try:
        check_image_count(len(sources), state.config.media)
    except MediaError as e:
        raise bad_request(str(e), param="messages") from None
    return sources


async def load_images(state: ServerState, messages: Sequence[Any] | None) -> list[Any]:
    """The messages' decoded images (fetched concurrently), or a 400 naming the first that failed."""
    sources = check_images(state, messages)
    if not sources:
        return []
    # Every image's run must fit the context: more images than it holds are a 400 before any is
    # fetched or decoded (each decoded image may hold up to ~270 MB of pixels: a request of many
    # small files of huge images would otherwise fill the memory only to be refused afterwards).
    spec, context = state.limits.image, state.limits.max_model_len
    if spec is not None and len(sources) * spec.tokens_per_image > context:
        raise bad_request(
            f"this request has {len(sources)} images of {spec.tokens_per_image} tokens each, more than "
            f"the model's context of {context} tokens holds",
            param="messages",
        )
    media = state.config.media
    try:
        for source in sources:  # every URL's host, before any is fetched
            check_domain(source, media)
    except MediaError as e:
        raise bad_request(str(e), param="messages") from None
    results = await asyncio.gather(*(aload_image(s, media) for s in sources), return_exceptions=True)
    for result in results:
        if isinstance(result, MediaError):
            raise bad_request(str(result), param="messages")
        if isinstance(result, BaseException):
            raise result
    return list(results)


def with_image_runs(state: ServerState, prompt_ids: list[int], num_images: int) -> list[int]:
    """``prompt_ids`` with each image token expanded to its image's placeholder run (what the
    engine computes and usage counts), or a 400 when they do not hold one per image."""
    spec = state.limits.image
    if spec is None:
        return prompt_ids
    try:
        return expand_image_tokens(prompt_ids, spec, num_images)
    except ValueError as e:
        raise bad_request(str(e), param="messages") from None
