"""Server-wide settings of how a chat is rendered into its prompt, which every renderer of a chat
must apply alike: the replica (``server/prompts.py`` chat_prompt, for chat, Responses, Messages and
/tokenize) and the router (``router/prompt_keys.py`` TokenKeyer, whose block hashes must be the
replica's or cache-aware routing and PD hand-offs miss). Torch-free: the router imports it.

* ``--default-chat-template-kwargs JSON``: template variables every chat gets, under the request's
  own ``chat_template_kwargs`` (a request's value for a key wins, as vLLM merges them), e.g.
  ``{"enable_thinking": false}``.
* ``--exclude-tools-when-tool-choice-none``: a request with ``tool_choice`` "none" is rendered
  without its tools (vLLM's flag; by default the template still sees them).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Template variables a request sets through its own fields, never through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tools", "continue_final_message"})


@dataclass(frozen=True)
class ChatDefaults:
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    exclude_tools_when_tool_choice_none: bool = False

    def kwargs(self, request_kwargs: Mapping[str, Any] | None, documents: Any = None) -> dict[str, Any]:
        """The template variables of one request: its ``documents`` (vLLM's request field, for
        RAG templates), then the server's defaults, then the request's own (each winning over the
        ones before, as vLLM merges them)."""
        base = {"documents": documents} if documents is not None else {}
        return {**base, **self.template_kwargs, **(request_kwargs or {})}

    def tools(self, tools: Any, tool_choice: Any) -> Any:
        """The tools the template is shown."""
        if self.exclude_tools_when_tool_choice_none and tool_choice == "none":
            return None
        return tools


def template_kwargs_flag(text: str | None) -> dict[str, Any]:
    """``--default-chat-template-kwargs``'s JSON object (ValueError naming the flag otherwise)."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(
            f"--default-chat-template-kwargs must be a JSON object such as '{{\"enable_thinking\": false}}', "
            f"got {text!r}"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"--default-chat-template-kwargs must be a JSON object, got {type(value).__name__}")
    reserved = RESERVED_TEMPLATE_KWARGS.intersection(value)
    if reserved:
        raise ValueError(
            f"--default-chat-template-kwargs must not set {', '.join(sorted(reserved))}: requests set "
            "them through their own fields"
        )
    return value


def add_chat_default_args(p: argparse.ArgumentParser | argparse._ArgumentGroup, router: bool = False) -> None:
    """The two flags, on `ferry serve` and (the replicas' values, to render as they do) `ferry router`."""
    whose = "the replicas' " if router else ""
    p.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help=f"{whose}chat template variables every chat gets under its own chat_template_kwargs, "
        "e.g. '{\"enable_thinking\": false}'",
    )
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help=f'{whose}chats with tool_choice "none" are rendered without their tools',
    )


def chat_defaults(args: argparse.Namespace) -> ChatDefaults:
    """From either command line's flags (ValueError for a bad JSON value)."""
    return ChatDefaults(
        template_kwargs=template_kwargs_flag(args.default_chat_template_kwargs),
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
    )
