"""Sleep mode and weight updates over HTTP (vLLM's /sleep, /wake_up, /is_sleeping; SGLang's
/update_weights_from_disk), the generation pause (vLLM's dev-mode /pause, /resume, /is_paused) and
the torch profiler (/start_profile, /stop_profile), against real ``ferry serve`` processes: one
in-process engine, and an engine process behind two API servers."""

from __future__ import annotations

import json
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
def replica(request, tiny_llama: Path, serve_logs: Path, server_process, tmp_path_factory) -> Iterator:
    flags = ["--enable-sleep-mode", "--api-key", KEY, "--num-kv-blocks", "64"]
    if request.param == "api servers":
        flags += ["--api-server-count", "2"]
    traces = tmp_path_factory.mktemp("traces")
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_TORCH_PROFILER_DIR": str(traces)}
    srv = server_process(tiny_llama, flags, serve_logs).start(env=env)
    srv.traces = traces
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
    # vLLM's dev-mode and profiler routes exist only with VLLM_SERVER_DEV_MODE / VLLM_TORCH_PROFILER_DIR.
    for path in (
        "/pause",
        "/resume",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        "/start_profile",
        "/stop_profile",
    ):
        assert httpx.post(server.url + path).status_code == 404, path
    for path in ("/is_paused", "/get_world_size"):
        assert httpx.get(server.url + path).status_code == 404, path


LONG = 300  # tokens: a stream still running when the test pauses it


def _stream(replica, max_tokens: int = LONG) -> Iterator[tuple[str, str | None]]:
    """A greedy streamed completion's (text, finish_reason) chunks."""
    client = openai.OpenAI(base_url=replica.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    stream = client.completions.create(
        model=replica.model_name,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices:
            yield chunk.choices[0].text, chunk.choices[0].finish_reason


def _engine_tokens(http: httpx.Client) -> float | None:
    """Tokens the engine's steps computed so far (from its stats, whichever API server answers)."""
    return metric_value(http.get("/metrics").text, "vllm:iteration_tokens_total_sum")


def _paused(http: httpx.Client) -> bool:
    return http.get("/is_paused", headers=AUTH).json()["is_paused"]


def test_pause_abort_holds_new_requests_until_resume(replica, expected) -> None:
    with httpx.Client(base_url=replica.url, timeout=30) as http:
        assert _paused(http) is False
        stream = _stream(replica)
        next(stream)  # running
        r = http.post("/pause", headers=AUTH)  # mode=abort, vLLM's default
        assert (r.status_code, r.json()) == (200, {"status": "paused"})
        assert [reason for _, reason in stream if reason] == ["abort"]
        assert _paused(http) is True
        health = http.get("/health")
        assert health.status_code == 200  # as vLLM: alive, though paused
        assert (health.json()["paused"], health.json()["sleeping"]) == (True, False)  # what a router reads
        assert http.get("/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}
        held: list[str] = []
        thread = threading.Thread(target=lambda: held.append(_complete(replica)))
        thread.start()
        time.sleep(0.5)
        assert not held  # held (not refused) until the resume
        r = http.post("/resume", headers=AUTH)
        assert (r.status_code, r.json()) == (200, {"status": "resumed"})
        thread.join(30)
        assert held == [expected["tiny"]]
        assert _paused(http) is False and http.get("/health").json()["paused"] is False
        assert http.post("/resume", headers=AUTH).json() == {"status": "resumed"}  # not paused: a no-op
        # A /resume sent while a mode=wait pause still waits for a running request cancels it.
        stream = _stream(replica)
        next(stream)
        answers: list[httpx.Response] = []
        pause = threading.Thread(
            target=lambda: answers.append(http.post("/pause", params={"mode": "wait"}, headers=AUTH))
        )
        pause.start()
        deadline = time.monotonic() + 30
        while not _paused(http):
            assert time.monotonic() < deadline
        assert http.post("/resume", headers=AUTH).status_code == 200
        pause.join(30)
        assert answers[0].status_code == 409 and answers[0].json()["error"]["code"] == "pause_cancelled"
        assert [reason for _, reason in stream if reason] == ["length"]  # it ran on, to its end
        assert _paused(http) is False


def test_pause_keep_freezes_running_requests(replica) -> None:
    unpaused = "".join(text for text, _ in _stream(replica))
    with httpx.Client(base_url=replica.url, timeout=30) as http:
        resets = http.get("/health").json()["prefix_cache_resets"]
        stream = _stream(replica)
        got = [next(stream)[0]]
        r = http.post("/pause", params={"mode": "keep"}, headers=AUTH)
        assert (r.status_code, r.json()) == (200, {"status": "paused"})
        assert _paused(http) is True
        # Frozen: no engine step runs until the resume (the engine's token count stands still).
        tokens = _engine_tokens(http)
        time.sleep(0.3)
        assert _engine_tokens(http) == tokens
        assert metric_value(http.get("/metrics").text, "vllm:num_requests_running") == 1.0
        # The frozen request uses its blocks: a reset refuses, unless told to preempt it (vLLM's option;
        # it recomputes, to the same tokens).
        r = http.post("/reset_prefix_cache", headers=AUTH)
        assert (r.status_code, r.json()["error"]["code"]) == (409, "prefix_cache_busy")
        r = http.post("/reset_prefix_cache", params={"reset_running_requests": "true"}, headers=AUTH)
        assert r.status_code == 200 and r.json()["num_blocks_dropped"] > 0, r.text
        assert metric_value(http.get("/metrics").text, "vllm:num_requests_running") == 0.0
        assert http.post("/resume", headers=AUTH).status_code == 200
        rest = list(stream)
        assert got[0] + "".join(text for text, _ in rest) == unpaused  # as if never paused
        assert rest[-1][1] == "length"
        # keep left the prefix cache alone (vLLM ignores clear_cache for keep): one reset, the route's
        assert http.get("/health").json()["prefix_cache_resets"] == resets + 1


def test_pause_wait_sleep_and_weight_updates(replica, tiny_llama, other_llama, expected) -> None:
    with httpx.Client(base_url=replica.url, timeout=30) as http:
        resets = http.get("/health").json()["prefix_cache_resets"]
        # Deprecated wait_for_inflight_requests means mode=wait: nothing runs, so it returns at once.
        r = http.post("/pause", params={"wait_for_inflight_requests": "true"}, headers=AUTH)
        assert (r.status_code, r.json()) == (200, {"status": "paused"})
        assert http.get("/health").json()["prefix_cache_resets"] == resets + 1  # clear_cache=true
        r = http.post("/pause", params={"mode": "wait", "clear_cache": "false"}, headers=AUTH)
        assert r.status_code == 200  # paused again: fine, cache kept
        assert http.get("/health").json()["prefix_cache_resets"] == resets + 1
        # A weight update while paused runs; the pause goes on.
        r = http.post("/update_weights_from_disk", json={"model_path": str(other_llama)}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert _paused(http) is True
        # Asleep counts as paused; a full wake-up resumes generation too (vLLM's).
        assert http.post("/sleep", params={"level": 1}, headers=AUTH).status_code == 200
        assert _paused(http) is True
        assert http.post("/resume", headers=AUTH).status_code == 200
        assert _paused(http) is True  # still asleep
        assert http.post("/wake_up", headers=AUTH).status_code == 200
        assert _paused(http) is False
        assert _complete(replica) == expected["other"]
        assert http.post("/update_weights_from_disk", json={"model_path": str(tiny_llama)}, headers=AUTH)
        for params in ({"mode": "later"}, {"clear_cache": "maybe"}, {"wait_for_inflight_requests": "2"}):
            r = http.post("/pause", params=params, headers=AUTH)
            assert r.status_code == 400, (params, r.text)
            assert r.json()["error"]["type"] == "BadRequestError"
        for method, path in (("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused")):
            assert http.request(method, path).status_code == 401
        # The other dev-mode routes vLLM's RL clients call: one process, no cross-request caches.
        assert http.get("/get_world_size", headers=AUTH).json() == {"world_size": 1}
        assert http.get("/get_world_size", params={"include_dp": "false"}, headers=AUTH).json() == {
            "world_size": 1
        }
        for path in ("/reset_mm_cache", "/reset_encoder_cache"):
            r = http.post(path, headers=AUTH)
            assert (r.status_code, r.content) == (200, b""), path
        assert _paused(http) is False
        assert _complete(replica) == expected["tiny"]


def test_profiler_writes_a_trace(replica, expected) -> None:
    with httpx.Client(base_url=replica.url, timeout=30) as http:
        before = set(replica.traces.iterdir())
        r = http.post("/start_profile", headers=AUTH)
        assert (r.status_code, r.content) == (200, b"")
        assert _complete(replica) == expected["tiny"]
        r = http.post("/stop_profile", headers=AUTH)
        assert (r.status_code, r.content) == (200, b"")
        new = sorted(set(replica.traces.iterdir()) - before)
        assert len(new) == 1 and new[0].name.endswith(".pt.trace.json"), new
        assert ".engine." in new[0].name
        events = json.loads(new[0].read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        assert "aten::embedding" in names  # the model's forward ran under it
        assert http.post("/stop_profile", headers=AUTH).status_code == 200  # not running: a no-op
        assert set(replica.traces.iterdir()) - before == set(new)
        assert http.post("/start_profile").status_code == 401
