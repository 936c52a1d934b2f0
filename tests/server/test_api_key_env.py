"""The API key from the environment (``FERRY_API_KEY``, else vLLM's ``VLLM_API_KEY``) when no
``--api-key`` is given, for `ferry serve` and `ferry router` alike: a secret kept out of ``ps``."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from ferry.cli import build_parser
from router.config import RouterConfig
from server.config import api_key_from
from tests.server.conftest import ServerProcess


def test_flag_then_ferrys_variable_then_vllms() -> None:
    env = {"FERRY_API_KEY": "f", "VLLM_API_KEY": "v"}
    assert api_key_from("flag", env) == "flag"
    assert api_key_from(None, env) == "f"
    assert api_key_from(None, {"FERRY_API_KEY": "", "VLLM_API_KEY": "v"}) == "v"
    assert api_key_from(None, {}) is None


def test_the_router_reads_the_same_variables(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "shared")
    monkeypatch.delenv("FERRY_API_KEY", raising=False)
    config = RouterConfig.from_args(build_parser().parse_args(["router", "--replica", "http://127.0.0.1:9"]))
    assert config.api_key == "shared"
    flagged = build_parser().parse_args(["router", "--replica", "http://127.0.0.1:9", "--api-key", "own"])
    assert RouterConfig.from_args(flagged).api_key == "own"


def test_serve_takes_vllms_variable(tiny_llama: Path, serve_logs: Path, monkeypatch) -> None:
    monkeypatch.delenv("FERRY_API_KEY", raising=False)
    srv = ServerProcess(tiny_llama, ["--num-kv-blocks", "16"], serve_logs).start(env={"VLLM_API_KEY": "vk"})
    try:
        assert httpx.get(srv.url + "/v1/models", timeout=10).status_code == 401
        ok = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer vk"}, timeout=10)
        assert ok.status_code == 200
        # 16 blocks of 16 hold 256 tokens of the model's 1024: what a request may use, said at start.
        assert ok.json()["data"][0]["max_model_len"] == 256
        assert "the KV cache holds 256 tokens (16 blocks of 16), fewer than max_model_len 1024" in (
            srv.log_path.read_text()
        )
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200  # stays open
    finally:
        srv.stop()


@pytest.mark.parametrize("key", ["k\u20acy", " key", "key\n", "k\x00y"])
def test_a_key_no_client_can_send_is_refused_at_start(key: str) -> None:
    """A key outside printable ASCII (or with spaces at its ends) could never match what a client
    sends in its header: every guarded request would fail (the router answered 500), so neither
    `ferry serve`, `ferry router` nor the router's --replica-api-key starts with one."""
    message = (
        "must be printable ASCII without leading or trailing spaces (a client sends it in an HTTP header)"
    )
    with pytest.raises(ValueError, match=r"^--api-key " + re.escape(message)):
        api_key_from(key, {})
    with pytest.raises(ValueError, match=r"^FERRY_API_KEY " + re.escape(message)):
        api_key_from(None, {"FERRY_API_KEY": key})
    args = ["router", "--replica", "http://127.0.0.1:9"]
    with pytest.raises(ValueError, match=r"^--api-key "):
        RouterConfig.from_args(build_parser().parse_args([*args, "--api-key", key]))
    with pytest.raises(ValueError, match=r"^--replica-api-key "):
        RouterConfig.from_args(build_parser().parse_args([*args, "--replica-api-key", key]))
    assert api_key_from("k-Y_1.~!", {}) == "k-Y_1.~!"
