"""Known client mistakes and the error each must get: (path, body, status, param, code), and a
hypothesis strategy of malformed and near-valid request bodies.

Shared by the error table and fuzz (``test_errors``) and the fast-path comparison
(``test_generation_routes``).
"""

from __future__ import annotations

from hypothesis import strategies as st

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
    (COMP, {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "invalid_value"),
    (COMP, {"prompt": "x", "truncate_prompt_tokens": 5000}, 400, "truncate_prompt_tokens", "invalid_value"),
    (CHAT, {"messages": USER, "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens", "invalid_value"),
    (
        COMP,
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "invalid_value",
    ),
    (
        CHAT,
        {"messages": USER, "stream": False, "stream_options": {"continuous_usage_stats": True}},
        400,
        "stream_options",
        "invalid_value",
    ),
    (CHAT, {"messages": []}, 400, "messages", "invalid_value"),
    # Any other non-empty role reaches the chat template (vLLM's custom roles: test_custom_roles).
    (CHAT, {"messages": [{"role": "", "content": "x"}]}, 400, "messages.0.role", "invalid_value"),
    (CHAT, {"messages": [{"role": 5, "content": "x"}]}, 400, "messages.0.role", "invalid_value"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages.0",
        "invalid_value",
    ),
    (CHAT, {"messages": USER, "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs", "invalid_value"),
    # OpenAI's deprecated function forms and audio output would be answered without: refused.
    (CHAT, {"messages": USER, "functions": [{"name": "f"}]}, 400, "functions", "invalid_value"),
    (CHAT, {"messages": USER, "function_call": "auto"}, 400, "function_call", "invalid_value"),
    (CHAT, {"messages": USER, "modalities": ["text", "audio"]}, 400, "modalities", "invalid_value"),
    (
        CHAT,
        {"messages": [*USER, {"role": "assistant", "content": [{"type": "refusal"}]}]},
        400,
        "messages.1",
        "invalid_value",
    ),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    (
        CHAT,
        {"messages": USER, "response_format": {"type": "xml"}},
        400,
        "response_format.type",
        "invalid_value",
    ),
    (
        CHAT,
        {"messages": USER, "response_format": {"type": "json_schema"}},
        400,
        "response_format.json_schema",
        "invalid_value",
    ),
    (
        CHAT,
        {
            "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
        },
        400,
        "response_format",
        "invalid_value",
    ),
    (COMP, {"prompt": "x", "guided_regex": "("}, 400, "guided_regex", "invalid_value"),
    (COMP, {"prompt": "x", "guided_grammar": "root ::= "}, 400, "guided_grammar", "invalid_value"),
    (COMP, {"prompt": "x", "guided_json": "{no"}, 400, "guided_json", "invalid_value"),
    (COMP, {"prompt": "x", "guided_choice": []}, 400, "guided_choice", "invalid_value"),
    # A schema given as text is parsed by the server, not by the body's JSON parser: nested
    # deeper than Python's json takes, it was a RecursionError (500).
    (
        COMP,
        {"prompt": "x", "guided_json": '{"items": ' * 1500 + "{}" + "}" * 1500},
        400,
        "guided_json",
        "invalid_value",
    ),
    (
        COMP,
        {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]},
        400,
        "guided_choice",
        "invalid_value",
    ),
    (
        COMP,
        {"prompt": "x", "guided_whitespace_pattern": " "},
        400,
        "guided_whitespace_pattern",
        "invalid_value",
    ),
    (COMP, {"prompt": "x", "structured_outputs": {}}, 400, "structured_outputs", "invalid_value"),
    (
        COMP,
        {"prompt": "x", "structured_outputs": {"regex": "a", "json_object": True}},
        400,
        "structured_outputs",
        "invalid_value",
    ),
    (
        COMP,
        {"prompt": "x", "structured_outputs": {"structural_tag": "t"}},  # not JSON: not a tag
        400,
        "structured_outputs",
        "invalid_value",
    ),
    (
        COMP,
        {"prompt": "x", "structured_outputs": {"choice": "ab"}},
        400,
        "structured_outputs.choice",
        "invalid_value",
    ),
    (
        COMP,
        {"prompt": "x", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        400,
        "structured_outputs",
        "invalid_value",
    ),
    (
        CHAT,
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tool_choice",  # "auto" by default, and this replica has no --tool-call-parser
        "invalid_value",
    ),
    (
        CHAT,
        {"messages": USER, "tools": [{"type": "function", "function": {"name": 5}}], "tool_choice": "none"},
        400,
        "tools.0.function.name",
        "invalid_value",
    ),
    (
        CHAT,
        {
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "x"},
        },
        400,
        "tool_choice.type",
        "invalid_value",
    ),
    (CHAT, {"messages": USER, "tool_choice": "required"}, 400, "tool_choice", "invalid_value"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens", "invalid_value"),
    (CHAT, {"messages": USER, "model": "nope"}, 404, "model", "model_not_found"),
    ("/tokenize", {"prompt": "x", "messages": USER}, 400, None, "invalid_value"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "invalid_value"),
]

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "prompt",
    "messages",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "echo",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "suffix",
    "best_of",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "use_beam_search",
    "length_penalty",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "kv_transfer",
    "resume",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tools",
    "tool_choice",
    "add_generation_prompt",
]
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | json_values,
        "content": st.text(max_size=30) | json_values,
    }
)
# Output constraints that often compile (xgrammar parses them in the server process: a crash
# there would take the replica down), and as often do not.
constraint_text = st.lists(
    st.sampled_from(list("ab()[]{}|*+?.^$-:,\"'= 09\n") + ["\\d", "\\w", "\\u12", "::=", "root"]), max_size=16
).map("".join)
schemas = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.sampled_from(["object", "string", "integer", "array"]),
    lambda c: (
        st.lists(c, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                ["type", "properties", "items", "enum", "required", "anyOf", "$ref", "minimum", "pattern"]
            ),
            c,
            max_size=3,
        )
    ),
    max_leaves=10,
)
CONSTRAINTS = {
    "use_beam_search": st.booleans() | json_values,
    "length_penalty": st.floats(-3, 3) | json_values,
    "guided_regex": constraint_text | json_values,
    "guided_grammar": constraint_text.map(lambda t: "root ::= " + t) | json_values,
    "guided_json": schemas | json_values,
    "guided_choice": st.lists(st.text(max_size=4), max_size=3) | json_values,
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "x"])},
        optional={
            "json_schema": st.fixed_dictionaries(
                {}, optional={"name": st.text(max_size=4), "schema": schemas}
            )
        },
    )
    | json_values,
    "tools": st.lists(
        st.fixed_dictionaries(
            {
                "type": st.sampled_from(["function", "x"]),
                "function": st.fixed_dictionaries(
                    {"name": st.sampled_from(["f", "g", ""])}, optional={"parameters": schemas}
                ),
            }
        )
        | json_values,
        max_size=2,
    )
    | json_values,
    "tool_choice": st.sampled_from(["none", "auto", "required", "x"])
    | st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "h"])}),
        }
    )
    | json_values,
    "structured_outputs": st.dictionaries(
        st.sampled_from(
            ["json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace", "structural_tag"]
        ),
        constraint_text | schemas,
        max_size=2,
    )
    | json_values,
}
near_valid = st.fixed_dictionaries(
    {
        "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 1200), max_size=8) | json_values,
        "messages": st.lists(message, max_size=3),
    },
    optional={f: CONSTRAINTS.get(f, json_values) for f in FIELDS if f not in ("prompt", "messages")},
)
bodies = (
    near_valid
    | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values, max_size=6)
    | json_values
)

RESP = "/v1/responses"
response_item = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"])
        | json_values,
        "role": st.sampled_from(["user", "system", "assistant", "tool"]) | json_values,
        "content": st.text(max_size=20)
        | st.lists(
            st.fixed_dictionaries(
                {
                    "type": st.sampled_from(["input_text", "output_text", "input_image"]),
                    "text": st.text(max_size=8) | json_values,
                }
            ),
            max_size=2,
        )
        | json_values,
        "call_id": st.text(max_size=6) | json_values,
        "name": st.sampled_from(["f", ""]) | json_values,
        "arguments": st.sampled_from(["{}", "{bad"]) | json_values,
        "output": st.text(max_size=6) | json_values,
    },
)
responses_bodies = (
    st.fixed_dictionaries(
        {"input": st.text(max_size=20) | st.lists(response_item, max_size=3) | json_values},
        optional={
            "instructions": st.text(max_size=10) | json_values,
            "max_output_tokens": st.integers(-2, 6) | json_values,
            "temperature": st.floats(-1, 3, allow_nan=False) | json_values,
            "tools": st.lists(
                st.fixed_dictionaries(
                    {
                        "type": st.sampled_from(["function", "web_search"]),
                        "name": st.sampled_from(["f", "g"]),
                    },
                    optional={"parameters": schemas},
                ),
                max_size=2,
            )
            | json_values,
            "tool_choice": st.sampled_from(["auto", "none", "required"])
            | st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "h"])})
            | json_values,
            "text": st.fixed_dictionaries(
                {
                    "format": st.fixed_dictionaries(
                        {"type": st.sampled_from(["text", "json_object", "json_schema", "x"])},
                        optional={"schema": schemas},
                    )
                }
            )
            | json_values,
            "previous_response_id": st.text(max_size=4),
            "store": st.booleans() | json_values,
            "include": st.lists(
                st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content", "x"]),
                max_size=2,
            )
            | json_values,
            "top_logprobs": st.integers(-1, 21) | json_values,
            "stream": st.booleans(),
        },
    )
    | json_values
)

EMB = "/v1/embeddings"
embedding_bodies = (
    st.fixed_dictionaries(
        {
            "input": st.text(max_size=20)
            | st.lists(st.text(max_size=10), max_size=3)
            | st.lists(st.integers(-5, 1200), max_size=8)
            | st.lists(st.lists(st.integers(-5, 1200), max_size=4), max_size=3)
            | json_values
        },
        optional={
            "model": st.sampled_from(["tiny", None]) | json_values,
            "encoding_format": st.sampled_from(["float", "base64", "int8"]) | json_values,
            "dimensions": st.integers(-2, 70) | json_values,
            "user": st.text(max_size=6) | json_values,
            "truncate_prompt_tokens": st.integers(-1, 5) | json_values,
            "add_special_tokens": st.booleans() | json_values,
        },
    )
    | json_values
)
