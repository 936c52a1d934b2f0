"""Known client mistakes and the error each must get: (path, body, status, param, code).

Shared by the error table (``test_errors``) and the fast-path comparison (``test_generation_routes``).
"""

from __future__ import annotations

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

CASES = [
    # (path, body, status, param, code)
    (COMP, {"prompt": "x", "temperature": -0.1}, 400, "temperature", "invalid_value"),
    (COMP, {"prompt": "x", "temperature": 2.5}, 400, "temperature", "invalid_value"),
    (COMP, {"prompt": "x", "top_p": 0}, 400, "top_p", "invalid_value"),
    (COMP, {"prompt": "x", "top_p": 1.5}, 400, "top_p", "invalid_value"),
    (COMP, {"prompt": "x", "n": 0}, 400, "n", "invalid_value"),
    (COMP, {"prompt": "x", "n": 129}, 400, "n", "invalid_value"),
    (COMP, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    (COMP, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "invalid_value"),
    (COMP, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    (COMP, {"prompt": "x", "suffix": "y"}, 400, "suffix", "invalid_value"),
    (COMP, {"prompt": "x", "best_of": 2}, 400, "best_of", "invalid_value"),
    (COMP, {"prompt": "x", "stop": [""]}, 400, "stop", "invalid_value"),
    (COMP, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", "invalid_value"),
    (COMP, {"prompt": "x", "logit_bias": {"1": 101}}, 400, "logit_bias", "invalid_value"),
    (COMP, {"prompt": "x", "logit_bias": {"100000": 1}}, 400, "logit_bias", "invalid_value"),
    (COMP, {"prompt": "x", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens", "invalid_value"),
    (COMP, {"prompt": [5, 100000]}, 400, "prompt", "invalid_value"),
    (COMP, {"prompt": []}, 400, "prompt", "invalid_value"),
    (COMP, {"prompt": ""}, 400, "prompt", "invalid_value"),
    (COMP, {"prompt": 5}, 400, "prompt", "invalid_value"),
    (COMP, {}, 400, "prompt", "missing_required_parameter"),
    (COMP, {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    (COMP, {"prompt": "x", "max_tokens": 2000}, 400, "max_tokens", "context_length_exceeded"),
    (COMP, {"prompt": [5] * 1027}, 400, "prompt", "context_length_exceeded"),
    (
        COMP,
        {"prompt": "x", "kv_transfer": {"role": "consumer", "block_hashes": ["zz"]}},
        400,
        "kv_transfer.block_hashes",
        "invalid_value",
    ),
    (COMP, {"prompt": "x", "kv_transfer": {"role": "sideways"}}, 400, "kv_transfer.role", "invalid_value"),
    (
        COMP,
        {"prompt": "x", "resume": {"token_ids": [1] * 20}, "max_tokens": 10},
        400,
        "resume.token_ids",
        "invalid_value",
    ),
    (COMP, {"prompt": ["a", "b"], "kv_transfer": {"role": "producer"}}, 400, "kv_transfer", "invalid_value"),
    (COMP, {"prompt": "x", "temperature": float("nan")}, 400, "temperature", "invalid_value"),
    (CHAT, {"messages": []}, 400, "messages", "invalid_value"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", "invalid_value"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages.0",
        "invalid_value",
    ),
    (CHAT, {"messages": USER, "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs", "invalid_value"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    (
        CHAT,
        {"messages": USER, "response_format": {"type": "json_object"}},
        400,
        "response_format",
        "invalid_value",
    ),
    (
        CHAT,
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools",
        "invalid_value",
    ),
    (CHAT, {"messages": USER, "tool_choice": "required"}, 400, "tool_choice", "invalid_value"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens", "invalid_value"),
    (CHAT, {"messages": USER, "model": "nope"}, 404, "model", "model_not_found"),
    ("/tokenize", {"prompt": "x", "messages": USER}, 400, None, "invalid_value"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "invalid_value"),
]
