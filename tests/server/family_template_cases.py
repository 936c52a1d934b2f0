"""Families, message shapes and helpers for comparing ferry's chat prompts with transformers' (the
tests in ``test_family_chat_templates.py`` and ``test_family_templates_serve.py``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from family_chat_templates import DEEPSEEK_R1, GEMMA, LLAMA31, MIXTRAL, QWEN3, QWEN25

from engine.demo import build_tokenizer
from engine.tokenizer import Tokenizer
from server.chat_protocol import ChatCompletionRequest
from server.prompts import chat_prompt

DS_MARKERS = [
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁outputs▁end｜>",
]
# A fine-tuned Qwen2.5 whose template marks the assistant's text for training masks (TRL, NeMo):
# transformers' ``{% generation %}`` block.
QWEN25_MASKED = QWEN25.replace(
    "{%- for message in messages %}", "{%- for message in messages %}\n    {%- generation %}"
).replace(
    "{%- endfor %}\n{%- if add_generation_prompt %}",
    "    {%- endgeneration %}\n{%- endfor %}\n{%- if add_generation_prompt %}",
)
assert QWEN25_MASKED.count("generation %}") == 2
# family: (template, bos, eos, more tokens of its vocabulary)
FAMILIES: dict[str, tuple[str, str | None, str, list[str]]] = {
    "qwen25": (QWEN25, None, "<|im_end|>", []),
    "qwen25_masked": (QWEN25_MASKED, None, "<|im_end|>", []),
    "qwen3": (QWEN3, None, "<|im_end|>", ["<think>", "</think>"]),
    "llama31": (LLAMA31, "<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"]),
    "mixtral": (MIXTRAL, "<s>", "</s>", []),
    "gemma": (GEMMA, "<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"]),
    "dsr1": (DEEPSEEK_R1, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", DS_MARKERS + ["<think>"]),
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
]
USER = {"role": "user", "content": "What is the weather in Paris?"}
CASES: dict[str, dict[str, Any]] = {
    "plain": {"messages": [USER]},
    "system": {"messages": [{"role": "system", "content": "You are terse."}, USER]},
    "turns": {
        "messages": [USER, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "More?"}]
    },
    "text_parts": {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "you"}]}
        ]
    },
    "no_generation_prompt": {
        "messages": [USER, {"role": "assistant", "content": "Sunny."}],
        "add_generation_prompt": False,
    },
    "continue_final_message": {
        "messages": [USER, {"role": "assistant", "content": "It is"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    # Templates that trim the message (Gemma, Llama 3.1) end the prompt at its stripped text.
    "continue_trailing_space": {
        "messages": [USER, {"role": "assistant", "content": " It is \n"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "continue_user_parts": {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "Tell "}]}
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "tools": {"messages": [USER], "tools": TOOLS},
    "tool_history": {
        "messages": [
            USER,
            {"role": "assistant", "content": "Let me check.", "tool_calls": CALL},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "22C"},
            {"role": "assistant", "content": "22C."},
            {"role": "user", "content": "thanks"},
        ],
        "tools": TOOLS,
    },
    "empty_arguments": {
        "messages": [
            USER,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "x"},
        ],
        "tools": TOOLS,
    },
    # A role of the template's own (vLLM's custom messages): Llama 3.1 writes an ipython turn;
    # templates that know no such role drop it or raise, as under transformers.
    "ipython_result": {
        "messages": [
            USER,
            {"role": "assistant", "content": "", "tool_calls": CALL},
            {"role": "ipython", "content": '{"temp": "22C"}'},
        ],
        "tools": TOOLS,
    },
    "reasoning_in_history": {
        "messages": [
            USER,
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "I should call the tool.",
                "tool_calls": CALL,
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
        ],
        "tools": TOOLS,
    },
    "reasoning_field": {
        "messages": [USER, {"role": "assistant", "content": "Sunny", "reasoning": "Look outside."}],
        "add_generation_prompt": False,
    },
    "no_thinking": {"messages": [USER], "chat_template_kwargs": {"enable_thinking": False}},
}
# Shapes a family's template refuses (transformers raises too): the 400 carries its message.


def family_dir(root: Path, family: str) -> Path:
    template, bos, eos, extra = FAMILIES[family]
    out = root / family
    build_tokenizer(out, extra_tokens=[t for t in (bos, eos) if t] + extra)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(chat_template=template, eos_token=eos, **({"bos_token": bos} if bos else {}))
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    (out / "chat_template.jinja").write_text(template)
    if bos:  # the tokenizer adds BOS to plain text too: a chat prompt must still hold only the template's
        spec = json.loads((out / "tokenizer.json").read_text())
        bos_id = next(t["id"] for t in spec["added_tokens"] if t["content"] == bos)
        spec["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }
        (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    return out


def as_vllm_passes_them(messages: list[dict], decode_arguments: bool = True) -> list[dict]:
    """The messages as vLLM hands them to transformers: text parts joined with newlines, tool-call
    arguments decoded (empty ones ``{}``)."""
    out = []
    for message in copy.deepcopy(messages):
        if isinstance(message.get("content"), list):
            message["content"] = "\n".join(p["text"] for p in message["content"])
        for call in message.get("tool_calls") or []:
            arguments = call["function"]["arguments"]
            if decode_arguments:
                call["function"]["arguments"] = json.loads(arguments) if arguments else {}
        out.append(message)
    return out


def hf_ids(hf: Any, body: dict[str, Any], decode_arguments: bool = True) -> list[int]:
    ids = hf.apply_chat_template(
        as_vllm_passes_them(body["messages"], decode_arguments),
        tools=body.get("tools"),
        add_generation_prompt=body.get("add_generation_prompt", True),
        continue_final_message=body.get("continue_final_message", False),
        documents=body.get("documents"),
        tokenize=True,
        return_dict=False,
        **body.get("chat_template_kwargs", {}),
    )
    return list(ids)


def ferry_ids(tokenizer: Tokenizer, body: dict[str, Any]) -> list[int]:
    return chat_prompt(ChatCompletionRequest.model_validate({"model": "m", **body}), tokenizer)
