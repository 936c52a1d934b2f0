"""A request's inputs prepared off both loops (``AsyncEngine`` inherits ``RequestPreparation``).

What can take milliseconds or more before a request is submitted runs in a worker thread, so
neither the API's event loop nor the engine loop waits on it: compiling a structured-outputs
constraint (cached, so repeats cost a lookup), turning images into pixel values, checking and
hashing prompt embeddings. ``generate`` awaits these before ``start``; a caller that uses ``start``
directly (server/engine_host.py) awaits them itself and passes what they return. Each only
prepares: none submits a request or touches the engine's state beyond its grammar cache.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from engine.prompt_embeds import PreparedEmbeds

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import StructuredOutputsParams


class RequestPreparation:
    """``AsyncEngine``'s off-loop preparation of a request's inputs. Uses its ``engine``."""

    engine: LLMEngine

    async def compile_structured(self, spec: StructuredOutputsParams) -> Any:
        """Compile a structured-outputs constraint (ValueError if it is not a valid one). A new one
        compiles in a worker thread: a large schema can take long, and neither the event loop nor
        the engine loop may wait on it. Compiled constraints are kept, so repeats cost a lookup."""
        grammars = self.engine.grammars
        hit = grammars.cached(spec)
        return hit if hit is not None else await asyncio.to_thread(grammars.compile, spec)

    async def process_images(self, images: list[Any]) -> list[Any]:
        """A request's images made pixel values in a worker thread (engine/image_processor.py:
        resizing a photo takes tens of ms, which neither loop should wait on); as given for a model
        that takes no images (``make_request`` refuses them)."""
        processor = self.engine.image_processor
        return images if processor is None else await asyncio.to_thread(processor.process, images)

    async def prepare_prompt_embeds(self, embeds: Any) -> Any:
        """Prompt embeddings checked, cast and hashed in a worker thread (``LLMEngine.
        prepare_prompt_embeds``; ValueError for bad ones); what is prepared already as it is."""
        if isinstance(embeds, PreparedEmbeds):
            return embeds
        return await asyncio.to_thread(self.engine.prepare_prompt_embeds, embeds)
