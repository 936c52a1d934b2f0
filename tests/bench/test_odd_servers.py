"""The bench client against servers that answer 200 with odd streams: every request is a result
(typed failure or success), never a crash of the whole run and never a success without output.

The server is a real HTTP server on loopback that plays scripted SSE streams, one per request in
turn, so a run's failure counts are exact."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest


def _chunk(text: str | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
        **extra,
    }


# "" is an event with an empty data field (a proxy's keep-alive): no event at all, says SSE.
GOOD = [
    _chunk("a"),
    "",
    _chunk("b", "length"),
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
]
# vLLM before its errors took OpenAI's shape sent this mid-stream (then [DONE]).
OLD_VLLM_ERROR = [
    _chunk("a"),
    {"object": "error", "message": "boom", "type": "InternalServerError", "code": 500},
]
# Nothing generated: an empty first chunk, then [DONE] (no finish_reason, no usage).
NO_OUTPUT = [{"object": "text_completion", "choices": []}]
MALFORMED = {
    "usage_not_object": [_chunk("a", "stop"), {"choices": [], "usage": "oops"}],
    "choices_not_list": [{"choices": {"0": {"text": "a"}}}],
    "text_not_string": [_chunk(5, "stop")],  # type: ignore[arg-type]
    "choice_not_object": [{"choices": ["a"]}],
}


def _event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


def _response(status: str) -> dict[str, Any]:
    usage = {"input_tokens": 3, "output_tokens": 3, "total_tokens": 6}
    return {"id": "resp_1", "object": "response", "status": status, "output": [], "usage": usage}


# A Responses stream whose only output is a function call: its argument deltas are the tokens.
CALL_ONLY = [
    _event("response.created", response=_response("in_progress")),
    _event("response.output_item.added", output_index=0, item={"type": "function_call", "id": "fc_1"}),
    *(
        _event("response.function_call_arguments.delta", item_id="fc_1", output_index=0, delta=d)
        for d in ('{"a"', ": ", '"b"}')
    ),
    _event("response.function_call_arguments.done", item_id="fc_1", output_index=0, arguments='{"a": "b"}'),
    _event("response.completed", response=_response("completed")),
]
# ferry's last event of a cancelled background response.
CANCELLED = [
    _event("response.created", response=_response("in_progress")),
    _event("response.output_text.delta", item_id="m", output_index=0, content_index=0, delta="a"),
    _event("response.cancelled", response=_response("cancelled")),
]


class _Scripted(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    scripts: Iterator[list[Any]]
    lock = threading.Lock()

    def log_message(self, *args: Any) -> None:
        pass

    models = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()

    def do_GET(self) -> None:
        body = self.models
        self.send_response(200)
        self.send_header("content-type", "application/json" if body.startswith(b"{") else "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        with self.lock:
            events = next(self.scripts)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        for event in [*events, "[DONE]"]:
            data = event if isinstance(event, str) else json.dumps(event)
            self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()


@contextmanager
def _serve(scripts: list[list[Any]], models: bytes = _Scripted.models) -> Iterator[str]:
    """Every POST answers the next of ``scripts`` (an SSE stream, then [DONE]); every GET answers
    ``models`` (GET /v1/models)."""
    handler = type("Handler", (_Scripted,), {"scripts": itertools.cycle(scripts), "models": models})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _run(
    bench, url: str, n: int, out: Path, endpoint: str = "completions"
) -> tuple[int, str, list[dict], dict]:
    flags = f"--base-url {url} --endpoint {endpoint} --tokenizer words --num-prompts {n} --input-len 4"
    flags += " --output-len 2 --concurrency 2"
    rc, stdout = bench(flags, "--slo", "ttft=60000", "--output-dir", str(out))
    raw = [json.loads(line) for line in (out / "raw.jsonl").read_text().splitlines()]
    return rc, stdout, raw, json.loads((out / "summary.json").read_text())["points"][0]["metrics"]


def test_error_objects_and_empty_streams_are_failures(bench, tmp_path: Path) -> None:
    with _serve([GOOD, OLD_VLLM_ERROR, NO_OUTPUT]) as url:
        rc, stdout, raw, m = _run(bench, url, 6, tmp_path / "r")
    assert rc == 0, stdout
    assert (m["completed"], m["failed"]) == (2, 4)
    assert m["failures"] == {"bad_response": 2, "stream_error": 2}
    assert m["good_requests"] == 2 and m["total_output_tokens"] == 4
    errors = {r["error"] for r in raw if not r["ok"]}
    assert errors == {"boom", "the stream ended without any token chunk or finish_reason"}
    for r in raw:
        if r["ok"]:
            assert r["completion_tokens"] == 2 and r["prompt_tokens"] == 3 and len(r["itl_s"]) == 1


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_chunks_are_bad_responses(bench, tmp_path: Path, name: str) -> None:
    with _serve([GOOD, MALFORMED[name]]) as url:
        rc, stdout, raw, m = _run(bench, url, 4, tmp_path / name)
    assert rc == 0, stdout
    assert (m["completed"], m["failures"]) == (2, {"bad_response": 2})
    for r in raw:
        if not r["ok"]:
            assert r["error"].startswith("malformed chunk (") and r["http_status"] == 200


def test_responses_function_call_deltas_are_output_and_a_cancel_is_an_abort(bench, tmp_path: Path) -> None:
    with _serve([CALL_ONLY, CANCELLED]) as url:
        rc, stdout, raw, m = _run(bench, url, 4, tmp_path / "r", endpoint="responses")
    assert rc == 0, stdout
    assert (m["completed"], m["failures"]) == (2, {"aborted": 2})
    for r in raw:
        if r["ok"]:  # three argument deltas: three token chunks, the first one's time is the TTFT
            assert r["stream_chunks"] == 3 and len(r["itl_s"]) == 2 and r["completion_tokens"] == 3
            assert r["ttft_s"] + sum(r["itl_s"]) <= r["e2e_s"] and r["finish_reason"] == "stop"
        else:
            assert r["finish_reason"] == "abort" and r["error_kind"] == "aborted"


def test_tokenizer_auto_falls_back_to_words_when_tokenize_is_not_json(bench, tmp_path: Path) -> None:
    """The scripted server answers POST /tokenize 200 with an event stream: no tokenizer there, so
    'auto' builds approximate word prompts instead of failing the run."""
    with _serve([GOOD]) as url:
        rc, stdout = bench(
            f"--base-url {url} --num-prompts 2 --input-len 4 --output-len 2",
            "--output-dir",
            str(tmp_path / "r"),
        )
    assert rc == 0, stdout
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["dataset"]["token_source"] == {"kind": "words"}
    assert summary["points"][0]["metrics"]["completed"] == 2


def test_server_tokenizer_ignores_proxy_variables(standin, bench, tmp_path: Path, monkeypatch) -> None:
    """The requests never take a proxy from the environment; neither does /tokenize (a dead proxy
    would otherwise fail `--tokenizer server`, or turn 'auto' into approximate words)."""
    srv = standin("--tokens", "2")
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # the discard port: nothing listens
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "r"
    rc, stdout = bench(
        f"--base-url {srv.url} --tokenizer server --num-prompts 2 --input-len 5 --output-len 2",
        "--output-dir",
        str(out),
    )
    assert rc == 0, stdout
    records = [json.loads(line) for line in (out / "raw.jsonl").read_text().splitlines()]
    assert [r["prompt_tokens"] for r in records] == [5, 5]  # exact: the server's byte tokenizer


def test_models_page_that_is_not_json(bench, tmp_path: Path) -> None:
    """GET /v1/models answers 200 with a web page: with --model it is only not recorded; without,
    one line asks for --model."""
    with _serve([GOOD], models=b"<html>gateway</html>") as url:
        flags = f"--base-url {url} --tokenizer words --num-prompts 2 --input-len 4 --output-len 2"
        rc, stdout = bench(flags + " --model m", "--output-dir", str(tmp_path / "r"))
        assert rc == 0, stdout
        assert json.loads((tmp_path / "r" / "summary.json").read_text())["server_models"] is None
        rc, stdout = bench(flags, "--output-dir", str(tmp_path / "r2"))
    assert rc == 2 and "/v1/models answered 200 without JSON; pass --model" in stdout
