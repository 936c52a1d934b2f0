"""When the PD router hands a request off and when the decode worker prefills locally.

Pure decisions over the router's own state (pools, in-flight counters, the prompt's length):
no process is started, nothing is sent.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from router.app import RouterApp
from router.config import RouterConfig
from router.pd_config import PDConfig
from router.pd_messages import prefill_body, requested_budget, wants_disaggregation
from router.policies.base import RouteRequest
from router.relay import ProxyCall

PREFILL = ("http://127.0.0.1:7001", "http://127.0.0.1:7002")
DECODE = ("http://127.0.0.1:7101",)


@pytest.fixture
def app(tiny_llama: Path) -> RouterApp:
    app = RouterApp(
        RouterConfig(prefill=PREFILL, decode=DECODE, model=str(tiny_llama)),
        pd=PDConfig(pd_threshold=32, prefill_max_inflight=2),
    )
    for r in app.replicas:
        r.on_probe_ok(0.0)
    return app


def _call(body: dict, path: str = "/v1/completions") -> ProxyCall:
    return ProxyCall("POST", path, b"", [], b"", "rid", RouteRequest("rid"), body)


def _reason(app: RouterApp, body: dict, path: str = "/v1/completions") -> str | None:
    pools = app.replicas.pools
    return asyncio.run(app.pd._local_reason(_call(body, path), pools["prefill"], pools["decode"]))


def test_long_prompts_are_disaggregated_short_ones_prefill_on_decode(app: RouterApp) -> None:
    assert app.disaggregated
    assert _reason(app, {"prompt": list(range(10, 50)), "max_tokens": 4}) is None  # 40 tokens >= 32
    assert _reason(app, {"prompt": list(range(10, 40)), "max_tokens": 4}) == "short_prompt"  # 30 < 32


def test_requests_the_hand_off_does_not_cover(app: RouterApp) -> None:
    long = list(range(10, 80))
    assert _reason(app, {"prompt": long, "n": 2}) == "n"
    assert _reason(app, {"prompt": long, "use_beam_search": True}) == "beam_search"
    assert _reason(app, {"prompt": long, "logprobs": 1}) == "logprobs"
    assert _reason(app, {"prompt": long, "echo": True}) == "echo"
    assert _reason(app, {"prompt": long, "prompt_logprobs": 0}) == "logprobs"
    assert _reason(app, {"prompt": [long, long]}) == "prompts"
    assert _reason(app, {"prompt": long, "max_tokens": 1}) == "single_token"
    chat = {"messages": [{"role": "user", "content": "x " * 60}], "logprobs": True}
    assert _reason(app, chat, "/v1/chat/completions") == "logprobs"
    tools = [{"type": "function", "function": {"name": "f"}}]
    chat = {"messages": [{"role": "user", "content": "x " * 60}], "tools": tools}
    assert _reason(app, chat, "/v1/chat/completions") == "tools"
    assert _reason(app, {**chat, "tool_choice": "required"}, "/v1/chat/completions") == "tools"
    assert _reason(app, {**chat, "tool_choice": "none"}, "/v1/chat/completions") is None


def test_saturated_or_missing_prefill_pool_means_local_prefill(app: RouterApp) -> None:
    body = {"prompt": list(range(10, 80))}
    p1, p2 = app.replicas.pools["prefill"]
    p1.inflight = p2.inflight = 2
    assert _reason(app, body) == "prefill_saturated"
    p2.inflight = 1
    assert _reason(app, body) is None
    for r in (p1, p2):
        app.replicas.drain(r.url)
    assert _reason(app, body) == "no_prefill_worker"


def test_producer_request_shape() -> None:
    body = {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 9,
            "min_tokens": 4, "temperature": 0.5, "seed": 3}  # fmt: skip
    assert prefill_body(body) == {
        "prompt": "hi",
        "max_tokens": 1,
        "min_tokens": 1,
        "temperature": 0.5,
        "seed": 3,
        # DESIGN's hand-off: one token; the client's budget rides along for the producer to check.
        "kv_transfer": {"role": "producer", "budget": {"max_completion_tokens": 9, "min_tokens": 4}},
        "return_token_ids": True,
    }
    assert (
        requested_budget("/v1/completions", {}) == 16 and requested_budget("/v1/chat/completions", {}) is None
    )
    assert requested_budget("/v1/completions", {"max_tokens": 5, "max_completion_tokens": 7}) == 7
    assert wants_disaggregation("/v1/completions", {"prompt": ["one prompt"]}) is None
