"""Sleep mode and weight updates over HTTP (vLLM's /sleep, /wake_up, /is_sleeping; SGLang's
/update_weights_from_disk), against real ``ferry serve`` processes: one in-process engine, and an
engine process behind two API servers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from engine.demo import build_model
from tests.server.conftest import metric_value

KEY = "sleepy"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def other_llama(models_root: Path) -> Path:
    return build_model(models_root / "sleep_other_llama", "llama", seed=101)


@pytest.fixture(scope="module")
def expected(tiny_llama: Path, other_llama: Path) -> dict[str, str]:
    """Greedy completions (12 tokens) of fresh offline engines on each checkpoint."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return {
        name: LLM(str(path), num_kv_blocks=64).generate([PROMPT], params)[0].outputs[0].text
        for name, path in (("tiny", tiny_llama), ("other", other_llama))
    }


@pytest.fixture(scope="module", params=["one process", "api servers"])
def replica(request, tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    flags = ["--enable-sleep-mode", "--api-key", KEY, "--num-kv-blocks", "64"]
    if request.param == "api servers":
        flags += ["--api-server-count", "2"]
    srv = server_process(tiny_llama, flags, serve_logs).start()
    yield srv
    srv.stop()


def _complete(replica) -> str:
    client = openai.OpenAI(base_url=replica.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    out = client.completions.create(
        model=replica.model_name,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].text


def _state(http: httpx.Client) -> tuple[bool, dict[str, float | None]]:
    sleeping = http.get("/is_sleeping", headers=AUTH).json()["is_sleeping"]
    text = http.get("/metrics").text
    gauge = {
        s: metric_value(text, "vllm:engine_sleep_state", sleep_state=s, engine="0")
        for s in ("awake", "weights_offloaded", "discard_all")
    }
    return sleeping, gauge


def test_sleep_holds_requests_and_wakes_to_the_same_text(replica, expected) -> None:
    with httpx.Client(base_url=replica.url, timeout=30) as http:
        assert _complete(replica) == expected["tiny"]
        assert _state(http) == (False, {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0})
        resets = http.get("/health").json()["prefix_cache_resets"]
        assert http.post("/sleep", params={"level": 1}, headers=AUTH).status_code == 200
        assert _state(http) == (True, {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0})
        health = http.get("/health")
        assert health.status_code == 200  # as vLLM: alive, though asleep
        # Its prefix cache went with the KV cache: a router's cache_aware index forgets it.
        assert health.json()["prefix_cache_resets"] == resets + 1
        assert http.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == replica.model_name
        held: list[str] = []
        thread = threading.Thread(target=lambda: held.append(_complete(replica)))
        thread.start()
        time.sleep(0.5)
        assert not held  # held until the engine wakes
        assert http.post("/wake_up", params={"tags": "weights"}, headers=AUTH).status_code == 200
        assert http.get("/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
        assert http.post("/wake_up", params={"tags": "kv_cache"}, headers=AUTH).status_code == 200
        thread.join(30)
        assert held == [expected["tiny"]]
        assert _state(http) == (False, {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0})


def test_update_weights_from_disk(replica, tiny_llama, other_llama, tiny_qwen3, expected) -> None:
    with httpx.Client(base_url=replica.url, timeout=30) as http:
        assert http.post("/sleep", params={"level": 2}, headers=AUTH).status_code == 200
        assert _state(http)[1] == {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 1.0}
        r = http.post("/update_weights_from_disk", json={"model_path": str(other_llama)}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json() == {
            "success": True,
            "message": f"Succeeded to update model weights from {other_llama}.",
            "num_paused_requests": 0,
        }
        assert http.post("/wake_up", headers=AUTH).status_code == 200
        assert _complete(replica) == expected["other"]
        assert http.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == replica.model_name
        for body, message in (
            ({"model_path": str(tiny_qwen3)}, "architecture"),
            ({"model_path": "/no/such/dir"}, "is not a directory"),
            ({"model_path": str(tiny_llama), "load_format": "pt"}, "load_format"),
        ):
            r = http.post("/update_weights_from_disk", json=body, headers=AUTH)
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        assert http.post("/update_weights_from_disk", json={}, headers=AUTH).status_code == 400
        assert _complete(replica) == expected["other"]  # refused updates changed nothing
        r = http.post("/update_weights_from_disk", json={"model_path": str(tiny_llama)}, headers=AUTH)
        assert r.status_code == 200
        assert _complete(replica) == expected["tiny"]


def test_bad_input_and_auth(replica) -> None:
    with httpx.Client(base_url=replica.url, timeout=30) as http:
        for path, params in (
            ("/sleep", {"level": 3}),
            ("/sleep", {"level": "one"}),
            ("/sleep", {"mode": "later"}),
            ("/wake_up", {"tags": "gpu"}),
        ):
            r = http.post(path, params=params, headers=AUTH)
            assert r.status_code == 400, (path, params, r.text)
            assert r.json()["error"]["type"] == "BadRequestError"
        for method, path in (
            ("POST", "/sleep"),
            ("POST", "/wake_up"),
            ("GET", "/is_sleeping"),
            ("POST", "/update_weights_from_disk"),
        ):
            assert http.request(method, path).status_code == 401
        assert http.get("/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}


def test_sleep_needs_the_flag(server) -> None:
    r = httpx.post(server.url + "/sleep")
    assert r.status_code == 400 and r.json()["error"]["code"] == "sleep_mode_disabled"
    assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": False}
