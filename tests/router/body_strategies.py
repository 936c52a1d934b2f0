"""Hypothesis strategies of request bodies a router may be sent: arbitrary JSON in the fields its
cache_aware keyer reads (messages, prompt, chat template options), from near-valid to nonsense."""

from __future__ import annotations

from hypothesis import strategies as st

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 70000) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 5]), "text": JSON})
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "", 7]) | JSON},
    optional={"content": JSON | st.lists(_PART | JSON, max_size=3), "name": JSON, "tool_calls": JSON},
)
BODIES = st.fixed_dictionaries(
    {},
    optional={
        "messages": JSON | st.lists(_MESSAGE | JSON, max_size=4),
        "prompt": JSON | st.lists(st.integers(-3, 70000), max_size=40),
        "chat_template_kwargs": JSON,
        "add_generation_prompt": JSON,
        "continue_final_message": JSON,
        "tools": JSON,
    },
)
# Fields the router itself reads to relay a generation (stream handling, failover, sessions).
RELAY_FIELDS = st.dictionaries(
    st.sampled_from(
        [
            "n",
            "echo",
            "logprobs",
            "stream",
            "user",
            "stop",
            "seed",
            "top_logprobs",
            "return_token_ids",
            "stream_options",
            "return_tokens_as_token_ids",
        ]
    ),
    JSON,
    max_size=3,
)
