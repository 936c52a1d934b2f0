"""The prompt forms the offline ``LLM`` takes, brought to what its engine takes: text or token ids,
given bare or as vLLM's prompt dicts (``{"prompt": …}``, ``{"prompt_token_ids": …}``, with
``"multi_modal_data"`` images: an ``ImagePrompt``; ``{"prompt_embeds": …}``: the tensor). Apart
from ``engine/llm.py`` because it is input checking only: it runs nothing and holds no state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Required, TypedDict

Prompt = str | list[int]


class TextPrompt(TypedDict, total=False):
    """vLLM's ``TextPrompt`` (``vllm.inputs``): ``TextPrompt(prompt=text)`` is the dict ``LLM`` takes."""

    prompt: Required[str]
    multi_modal_data: dict[str, Any]


class TokensPrompt(TypedDict, total=False):
    """vLLM's ``TokensPrompt``: ``TokensPrompt(prompt_token_ids=ids)``."""

    prompt_token_ids: Required[list[int]]
    multi_modal_data: dict[str, Any]


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with images (vLLM's ``{"prompt": …, "multi_modal_data": {"image": …}}``)."""

    prompt: Prompt
    images: tuple[Any, ...]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt], images: bool = False) -> list[Prompt]:
    """Prompts as the engine takes them: text or token ids, also given as vLLM's prompt dicts
    (``{"prompt": text}``, ``{"prompt_token_ids": ids}``, either with ``"multi_modal_data":
    {"image": PIL image or list}`` where ``images`` allows it: then an ``ImagePrompt``; and,
    there too, ``{"prompt_embeds": tensor [seq_len, hidden]}``: the tensor, for the engine's
    ``enable_prompt_embeds``)."""
    if isinstance(prompts, (str, Mapping)):
        prompts = [prompts]  # type: ignore[list-item]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one token-id prompt
    return [_unwrap(p, images) for p in prompts]


def _unwrap(prompt: object, images: bool) -> Prompt:
    if not isinstance(prompt, Mapping):
        return prompt  # type: ignore[return-value]
    keys = set(prompt) - {"multi_modal_data"}
    if keys == {"prompt_embeds"} and "multi_modal_data" not in prompt:
        if not images:
            raise ValueError("prompt_embeds is taken by LLM.generate only")
        return prompt["prompt_embeds"]
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        text: Prompt = prompt["prompt"]
    elif keys == {"prompt_token_ids"}:
        text = list(prompt["prompt_token_ids"])
    else:
        raise ValueError(
            "a prompt dict takes 'prompt' (text) or 'prompt_token_ids' (and 'multi_modal_data'), or "
            f"'prompt_embeds' alone, got {sorted(keys)}"
        )
    if "multi_modal_data" not in prompt:
        return text
    if not images:
        raise ValueError("multi_modal_data is taken by LLM.generate only")
    data = prompt["multi_modal_data"]
    if not isinstance(data, Mapping) or set(data) - {"image"}:
        raise ValueError("multi_modal_data takes 'image': a PIL image or a list of them")
    given = data.get("image", [])
    return ImagePrompt(text, tuple(given) if isinstance(given, (list, tuple)) else (given,))  # type: ignore[return-value]
