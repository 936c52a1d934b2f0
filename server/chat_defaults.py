"""Server-wide settings of how a chat is rendered into its prompt, which every renderer of a chat
must apply alike: the replica (``server/prompts.py`` chat_prompt, for chat, Responses, Messages and
/tokenize) and the router (``router/prompt_keys.py`` TokenKeyer, whose block hashes must be the
replica's or cache-aware routing and PD hand-offs miss). Torch-free: the router imports it.

* ``--default-chat-template-kwargs JSON``: template variables every chat gets, under the request's
  own (``ChatDefaults.render_kwargs`` merges them as vLLM does), e.g. ``{"enable_thinking": false}``.
* ``--exclude-tools-when-tool-choice-none``: a request with ``tool_choice`` "none" is rendered
  without its tools (vLLM's flag; by default the template still sees them).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Keys --default-chat-template-kwargs may not set: the conversation itself, and the two variables
# every request's own fields set (they always win, so a default there would never apply).
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "continue_final_message"})


def _set(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` less the unset ones: a request's null or "auto" is no value (vLLM's merge drops
    them), so the server's default, or the template's own, applies."""
    return {k: v for k, v in values.items() if v is not None and not (isinstance(v, str) and v == "auto")}


@dataclass(frozen=True)
class ChatDefaults:
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    exclude_tools_when_tool_choice_none: bool = False

    def render_kwargs(
        self,
        request_kwargs: Mapping[str, Any] | None,
        *,
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        documents: Any = None,
        reasoning_effort: str | None = None,
        tools: Any = None,
        tool_choice: Any = None,
    ) -> dict[str, Any]:
        """Every variable one request's template gets beside its messages, merged as vLLM merges
        them, each layer over the ones before: the server's defaults; the tools shown (``tools``);
        the request's ``chat_template_kwargs`` (a null or "auto" value there leaves its key unset);
        the request's own fields, ``add_generation_prompt`` and ``continue_final_message`` always
        (so the template sees the values the server acts on: the answer's role, echo), ``documents``
        and ``reasoning_effort`` when given. A ``reasoning_effort`` also turns ``enable_thinking``
        on ("none": off) unless the request's kwargs set it (templates such as Gemma's think only
        when asked)."""
        own = dict(request_kwargs or {})
        fields: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "documents": documents,
            "reasoning_effort": reasoning_effort,
        }
        if reasoning_effort is not None and "enable_thinking" not in own:
            fields["enable_thinking"] = reasoning_effort != "none"
        base = {**self.template_kwargs, **_set({"tools": self.tools(tools, tool_choice)})}
        return {**base, **_set({**own, **_set(fields)})}

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
            f"--default-chat-template-kwargs must not set {', '.join(sorted(reserved))}: each request's "
            "own fields set them"
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
