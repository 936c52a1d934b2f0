"""Edge validation and wire helpers without a model: request models, error mapping, param mapping, flags."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import fields

import pytest
from pydantic import ValidationError

from engine.config import EngineConfig
from server.args import add_serve_args, engine_options, server_config
from server.chat_protocol import ChatCompletionRequest
from server.completion_protocol import CompletionRequest
from server.errors import validation_error
from server.params import ModelLimits, child_seed, resolve_max_tokens, sampling_params
from server.registration import replica_key, replica_value
from server.streaming import DONE_FRAME, sse_frame

LIMITS = ModelLimits(
    vocab_size=1000, max_model_len=1024, max_logprobs=20, max_n=128, block_size=16, num_kv_blocks=32
)


def _error(model, body: dict):
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_error(info.value.errors())


def test_validation_errors_name_the_field() -> None:
    err = _error(CompletionRequest, {"prompt": "x", "temperature": 9})
    assert (err.status, err.param, err.code) == (400, "temperature", "invalid_value")
    err = _error(CompletionRequest, {"prompt": {"a": 1}})
    assert err.param == "prompt"  # union-member tags never leak into param
    err = _error(ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert err.param == "messages.0"
    err = _error(CompletionRequest, {"prompt": "x", "stop": ["a", ""]})
    assert err.param == "stop" and "non-empty" in err.message
    err = _error(CompletionRequest, {})
    assert err.code == "missing_required_parameter" and err.param == "prompt"


def test_strict_types_and_nulls() -> None:
    for body in (
        {"prompt": "x", "max_tokens": True},
        {"prompt": "x", "n": "2"},
        {"prompt": "x", "stream": 1},
        {"prompt": [1, True]},
    ):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(body)
    req = CompletionRequest.model_validate(
        {"prompt": "x", "max_tokens": None, "n": None, "stop": None, "temperature": 1}
    )
    assert req.max_tokens == 16 and req.n == 1 and req.stop_list == [] and req.temperature == 1.0


def test_max_completion_tokens_wins_and_context_checks() -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 7}
    )
    assert resolve_max_tokens(req, 10, LIMITS, default=None) == 7
    open_ended = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    # no budget asked: the rest of what one sequence can hold (32 blocks x 16 = 512 < 1024)
    assert resolve_max_tokens(open_ended, 12, LIMITS, default=None) == 500
    too_long = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 600})
    with pytest.raises(Exception) as info:
        resolve_max_tokens(too_long, 10, LIMITS, default=16)
    assert info.value.code == "context_length_exceeded" and "610" in info.value.message


def test_sampling_params_mapping_is_exact() -> None:
    req = CompletionRequest.model_validate(
        {
            "prompt": "x",
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 0,
            "min_p": 0.1,
            "seed": 3,
            "stop": "\n",
            "stop_token_ids": [5],
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.2,
            "logit_bias": {"7": -100},
            "min_tokens": 2,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
    )
    sp = sampling_params(req, max_tokens=10, logprobs=3, limits=LIMITS, prompt_logprobs=None)
    assert (sp.n, sp.max_tokens, sp.min_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (
        1,
        10,
        2,
        0.5,
        0.9,
        -1,
        0.1,
    )
    assert (sp.seed, sp.stop, sp.stop_token_ids, sp.logit_bias, sp.logprobs) == (
        3,
        ["\n"],
        [5],
        {7: -100.0},
        3,
    )
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.2)
    assert sp.ignore_eos and not sp.skip_special_tokens and sp.include_stop_str_in_output
    sp.validate()


def test_child_seeds() -> None:
    assert [child_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert child_seed(None, 2) is None
    assert child_seed(2**63 - 1, 1) == -(2**63)  # stays an int64


def test_sse_frames() -> None:
    assert sse_frame('{"a":1}') == b'data: {"a":1}\n\n'
    assert DONE_FRAME == b"data: [DONE]\n\n"


def test_every_engine_field_has_a_flag_and_maps_by_name() -> None:
    parser = add_serve_args(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--model",
            "/m",
            "--num-kv-blocks",
            "64",
            "--no-enable-prefix-caching",
            "--no-partial-prefix-caching",
            "--kv-events",
            "--dtype",
            "float32",
            "--attention-backend",
            "torch",
            "--seed",
            "5",
            "--kv-cache-memory-bytes",
            "1000",
            "--max-model-len",
            "512",
            "--num-threads",
            "1",
        ]
    )
    opts = engine_options(args)
    assert set(opts) == {f.name for f in fields(EngineConfig)}
    cfg = EngineConfig.from_options(**opts)
    assert cfg.partial_prefix_caching is False and EngineConfig().partial_prefix_caching is True
    assert (cfg.model, cfg.num_kv_blocks, cfg.enable_prefix_caching, cfg.kv_events, cfg.dtype) == (
        "/m",
        64,
        False,
        True,
        "float32",
    )
    assert (
        cfg.attention_backend,
        cfg.seed,
        cfg.kv_cache_memory_bytes,
        cfg.max_model_len,
        cfg.num_threads,
    ) == ("torch", 5, 1000, 512, 1)
    server = server_config(
        parser.parse_args(
            [
                "--max-queued-requests",
                "3",
                "--request-timeout",
                "2.5",
                "--max-request-bytes",
                "100",
                "--drain-timeout",
                "4",
            ]
        )
    )
    assert (
        server.max_queued_requests,
        server.request_timeout,
        server.max_request_bytes,
        server.drain_timeout,
    ) == (3, 2.5, 100, 4.0)
    assert server.served_model_name == "ferry-demo" and server.url == "http://127.0.0.1:8000"


def test_registration_wire_format() -> None:
    assert replica_key("http://10.0.0.7:8000") == "ferry:replica:http://10.0.0.7:8000"
    assert replica_value("http://h:1", "prefill", "m", 12.5) == (
        '{"url": "http://h:1", "role": "prefill", "model": "m", "started": 12.5}'
    )


def test_protocol_stays_torch_free() -> None:
    code = (
        "import sys, server.protocol, server.chat_protocol, server.completion_protocol,"
        " server.embedding_protocol, server.tokenize_protocol, server.args, server.server_flags,"
        " server.engine_flags, server.anthropic_protocol, server.anthropic_content;"
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_api_server_process_stays_torch_free() -> None:
    """What an API server process of ``--api-server-count`` imports never loads torch (seconds of
    start and hundreds of MB each; the engine process alone holds the model)."""
    code = (
        "import sys, server.app, server.engine_client, server.main, server.api_servers;"
        "assert 'torch' not in sys.modules, [m for m in sys.modules if m.startswith('engine.')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
