"""`ferry run-batch`: a JSONL file of OpenAI requests through the replica's own app, offline.

The answers are the HTTP API's (same validation, usage, errors): greedy text and token counts equal
the offline ``LLM``'s on the same checkpoint; bad lines get error lines in their places and never
stop the rest; input and output may be http(s) URLs (GET in, PUT out)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from ferry.cli import main

CHATS = [
    [{"role": "user", "content": "Tell me about ferries."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
]
PROMPT = "The quick brown fox"


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _batch_file() -> str:
    lines = [
        _line("chat-0", "/v1/chat/completions", {"messages": CHATS[0], "max_tokens": 6, "temperature": 0}),
        "{not json",
        _line("cmpl", "/v1/completions", {"prompt": PROMPT, "max_tokens": 7, "temperature": 0}),
        _line("bad-param", "/v1/completions", {"prompt": PROMPT, "max_tokens": 0}),
        _line("emb", "/v1/embeddings", {"input": PROMPT}),
        "",  # blank lines are skipped
        _line("bad-url", "/v1/images/generations", {"prompt": "x"}),
        _line("stream", "/v1/completions", {"prompt": PROMPT, "stream": True}),
        json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/completions"}),
        _line("bad-model", "/v1/chat/completions", {"model": "nope", "messages": CHATS[0]}),
        _line("chat-1", "/v1/chat/completions", {"messages": CHATS[1], "max_tokens": 5, "temperature": 0}),
        _line("score", "/v1/score", {"text_1": PROMPT, "text_2": ["ferry", "boat"]}),
    ]
    return "\n".join(lines) + "\n"


def _run(model: Path, source: str, target: str, *flags: str) -> int:
    return main(
        [
            "run-batch",
            "-i",
            source,
            "-o",
            target,
            "--model",
            str(model),
            "--num-threads",
            "1",
            "--deterministic",
            *flags,
        ]  # fmt: skip
    )


def test_run_batch_answers_as_the_api(tiny_llama: Path, tmp_path: Path) -> None:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(_batch_file())
    assert _run(tiny_llama, str(source), str(target), "--max-batch-concurrency", "3") == 0
    out = [json.loads(line) for line in target.read_text().splitlines()]
    by_id = {o["custom_id"]: o for o in out}
    expected_ids = ["chat-0", None, "cmpl", "bad-param", "emb", "bad-url", "stream", "no-body", "bad-model",
                    "chat-1", "score"]  # fmt: skip
    assert [o["custom_id"] for o in out] == expected_ids  # input order, one per non-blank line
    for o in out:
        assert o["id"] == f"batch_req_{o['response']['request_id']}"
        assert set(o) == {"id", "custom_id", "response", "error"}
        assert set(o["response"]) == {"status_code", "request_id", "body"}

    llm = LLM(tiny_llama, deterministic=True)
    greedy = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0, max_tokens=5)]
    for i, params in enumerate(greedy):
        want = llm.chat(CHATS[i], params)[0]
        got = by_id[f"chat-{i}"]
        assert got["error"] is None and got["response"]["status_code"] == 200
        body = got["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["id"] == f"chatcmpl-{got['response']['request_id']}"
        assert body["choices"][0]["message"]["content"] == want.outputs[0].text
        assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        assert body["usage"]["completion_tokens"] == len(want.outputs[0].token_ids) == params.max_tokens
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=7))[0]
    body = by_id["cmpl"]["response"]["body"]
    assert body["choices"][0]["text"] == want.outputs[0].text
    assert body["usage"] == {
        "prompt_tokens": len(want.prompt_token_ids),
        "completion_tokens": 7,
        "total_tokens": len(want.prompt_token_ids) + 7,
        "prompt_tokens_details": body["usage"]["prompt_tokens_details"],
    }
    unit = llm.embed(PROMPT)[0].outputs.embedding  # normalised, as /v1/embeddings answers
    assert by_id["emb"]["response"]["body"]["data"][0]["embedding"] == pytest.approx(unit, rel=1e-4, abs=1e-6)
    scores = by_id["score"]["response"]["body"]["data"]
    assert [s["index"] for s in scores] == [0, 1] and by_id["score"]["error"] is None
    llm.close()

    def error(custom_id: str | None) -> tuple[int, str, str]:
        o = out[expected_ids.index(custom_id)]
        body = o["response"]["body"]["error"]
        assert o["error"] == {"code": body["code"], "message": body["message"]}
        return o["response"]["status_code"], body["code"], body["type"]

    assert error(None) == (400, "invalid_json_line", "BadRequestError")
    assert error("bad-param") == (400, "invalid_value", "BadRequestError")  # the endpoint's own 400
    assert error("bad-url") == (400, "invalid_url", "BadRequestError")
    assert error("stream") == (400, "streaming_not_supported", "BadRequestError")
    assert error("no-body") == (400, "invalid_request_line", "BadRequestError")
    assert error("bad-model") == (404, "model_not_found", "NotFoundError")
    assert "max_tokens" in out[3]["error"]["message"]


class _Bucket(BaseHTTPRequestHandler):
    """An object store of one GET-able input and PUT-able outputs."""

    store: dict[str, bytes] = {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        data = self.store.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.send_header("content-length", str(len(data or b"")))
        self.end_headers()
        self.wfile.write(data or b"")

    def do_PUT(self) -> None:  # noqa: N802
        self.store[self.path] = self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_run_batch_reads_and_writes_urls(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    lines = [
        _line(f"c{i}", "/v1/completions", {"prompt": f"{PROMPT} {i}", "max_tokens": 3, "temperature": 0})
        for i in range(5)
    ]
    _Bucket.store = {"/in.jsonl": ("\n".join(lines) + "\n").encode()}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Bucket)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        # vLLM's --output-tmp-dir: where the results wait before they are PUT.
        spool = tmp_path / "spool"
        spool.mkdir()
        assert (
            _run(tiny_llama, f"{base}/in.jsonl", f"{base}/results/out.jsonl", "--output-tmp-dir", str(spool))
            == 0
        )
        out = [json.loads(line) for line in _Bucket.store["/results/out.jsonl"].decode().splitlines()]
        assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(5)]
        assert all(
            o["error"] is None and o["response"]["body"]["usage"]["completion_tokens"] == 3 for o in out
        )
        # An input that cannot be read: one clear line, exit code 2, nothing written.
        assert _run(tiny_llama, f"{base}/missing.jsonl", str(tmp_path / "never.jsonl")) == 2
        assert "ferry run-batch: error: cannot read" in capsys.readouterr().err
        assert not (tmp_path / "never.jsonl").exists()
        # An output that cannot be written is refused before the model loads and any request runs
        # (it was found only when writing the results, which were then lost).
        missing = tmp_path / "no" / "such" / "out.jsonl"
        assert _run(tiny_llama, f"{base}/in.jsonl", str(missing)) == 2
        assert f"cannot write {missing}: no such directory: {missing.parent}" in capsys.readouterr().err
        target = f"{base}/results/never.jsonl"
        assert _run(tiny_llama, f"{base}/in.jsonl", target, "--output-tmp-dir", str(missing.parent)) == 2
        assert f"cannot use --output-tmp-dir {missing.parent}" in capsys.readouterr().err
        assert "/results/never.jsonl" not in _Bucket.store
    finally:
        server.shutdown()


def test_an_interrupted_run_writes_what_was_answered(tiny_llama: Path, tmp_path: Path) -> None:
    # Ctrl-C: no more requests start, those running are aborted, the answered ones are written
    # (in input order), and the exit code says the batch is not whole; no traceback.
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    source.write_text("".join(_line(f"c{i}", "/v1/completions", body) + "\n" for i in range(400)))
    cmd = [sys.executable, "-m", "ferry", "run-batch", "-i", str(source), "-o", str(target)]
    cmd += ["--model", str(tiny_llama), "--num-threads", "1", "--max-batch-concurrency", "2"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # the first request is answered (the progress line says so)
        if "/400 requests done" in line:
            break
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 130
    out = [json.loads(line) for line in target.read_text().splitlines()]
    assert 0 < len(out) < 400 and "Traceback" not in err
    assert f"interrupted: {len(out)} of 400 requests answered" in err
    ids = [int(o["custom_id"][1:]) for o in out]
    assert ids == sorted(ids) and all(o["error"] is None for o in out)
