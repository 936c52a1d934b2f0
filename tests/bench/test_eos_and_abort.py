"""How `ferry bench` reads the end and the shape of a live `ferry serve` stream: the chunk that ends
a choice with a text-less EOS token, tool-call deltas, streams the server aborts; and that an
abbreviated --api-key never reaches the results."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.bench.conftest import Server, ferry_serve_argv


def _raw(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "raw.jsonl").read_text().splitlines()]


def _metrics(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())["points"][0]["metrics"]


def _eos_id(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["eos_token_id"]


def _text_safe_bias(model_dir: Path) -> dict[str, float]:
    """logit_bias banning every token that shows no text on its own (special tokens, partial UTF-8
    bytes), so no text is held back to the end of a stream."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    banned = {}
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i], skip_special_tokens=False)
        if not text or "\ufffd" in text or tok.id_to_token(i).startswith("<|"):
            banned[str(i)] = -100.0
    return banned


def test_answer_of_one_eos_token_has_a_ttft_and_meets_the_slo(
    ferry_serve, tiny_llama: Path, bench, tmp_path: Path
) -> None:
    """The first token is EOS: the answer is empty, and its one chunk (``text: ""``,
    ``finish_reason: "stop"``) is when that token arrived."""
    out = tmp_path / "eos-first"
    flags = (
        f"--base-url {ferry_serve.url} --tokenizer {tiny_llama} --token-ids --num-prompts 3 "
        "--input-len 8 --output-len 8 --concurrency 1 --slo ttft=60000"
    )
    rc, stdout = bench(
        flags,
        "--extra-body",
        json.dumps({"logit_bias": {str(_eos_id(tiny_llama)): 100}}),
        "--output-dir",
        str(out),
    )
    assert rc == 0, stdout
    for r in _raw(out):
        assert r["ok"] and r["finish_reason"] == "stop" and r["completion_tokens"] == 1, r
        assert r["stream_chunks"] == 1 and r["itl_s"] == [] and r["token_count_mismatch"] is False, r
        assert 0 < r["ttft_s"] <= r["e2e_s"], r
    m = _metrics(out)
    assert m["ttft_ms"]["count"] == 3 and m["good_requests"] == 3 and m["token_count_mismatches"] == 0


def test_eos_after_text_is_a_token_of_its_own_chunk(
    ferry_serve, tiny_llama: Path, bench, tmp_path: Path
) -> None:
    """Three text tokens, then EOS (``min_tokens`` 3, EOS favoured): usage counts four tokens, and
    per-chunk usage shows the EOS token came in the last, text-less chunk."""
    out = tmp_path / "eos-last"
    flags = (
        f"--base-url {ferry_serve.url} --tokenizer {tiny_llama} --token-ids --num-prompts 3 "
        "--input-len 8 --output-len 8 --concurrency 1 --continuous-usage-stats"
    )
    body = {"logit_bias": {**_text_safe_bias(tiny_llama), str(_eos_id(tiny_llama)): 100}, "min_tokens": 3}
    rc, stdout = bench(flags, "--extra-body", json.dumps(body), "--output-dir", str(out))
    assert rc == 0, stdout
    for r in _raw(out):
        assert r["ok"] and r["finish_reason"] == "stop" and r["completion_tokens"] == 4, r
        assert len(r["chunk_tokens"]) == r["stream_chunks"] and sum(r["chunk_tokens"]) == 4, r
        assert r["token_count_mismatch"] is False, r
        assert len(r["itl_s"]) == r["stream_chunks"] - 1
    assert _metrics(out)["token_count_mismatches"] == 0
    assert "note: token count mismatch" not in stdout


def test_tool_call_deltas_are_output(ferry_serve, bench, tmp_path: Path) -> None:
    """A named tool choice streams the call's arguments as ``delta.tool_calls``, with no content:
    each of those chunks is output, timed like text."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "string", "minLength": 40, "maxLength": 50}},
                    "required": ["a"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    lines = tmp_path / "tools.jsonl"
    lines.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [{"role": "user", "content": f"call f {i}"}],
                    "max_tokens": 120,
                    "tools": tools,
                    "tool_choice": {"type": "function", "function": {"name": "f"}},
                }
            )
            + "\n"
            for i in range(3)
        )
    )
    out = tmp_path / "tools"
    rc, stdout = bench(
        f"--base-url {ferry_serve.url} --dataset jsonl --concurrency 1 --continuous-usage-stats",
        "--dataset-path",
        str(lines),
        "--output-dir",
        str(out),
    )
    assert rc == 0, stdout
    for r in _raw(out):
        assert r["ok"] and r["finish_reason"] == "stop", r
        # '{"a": "…"}' of 40 characters or more takes dozens of tokens over as many steps: a server
        # that falls behind may put several in one chunk, never all of them.
        assert r["stream_chunks"] >= 2 and len(r["itl_s"]) == r["stream_chunks"] - 1, r
        assert r["ttft_s"] < r["e2e_s"] and sum(r["chunk_tokens"]) == r["completion_tokens"], r


def _running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    )


def test_stream_the_server_aborts_is_a_failure(tiny_llama: Path, bench, tmp_path: Path) -> None:
    """``POST /sleep?mode=abort`` ends every running request with ``finish_reason: "abort"``: those
    answers were cut short, so they are failures, not completed requests."""
    srv = Server([*ferry_serve_argv(tiny_llama), "--enable-sleep-mode"], tmp_path, 180)
    slept: list[int] = []

    def abort_once_all_run() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _running(srv.url) < 4:
            time.sleep(0.02)
        slept.append(httpx.post(srv.url + "/sleep?level=1&mode=abort", timeout=30).status_code)
        httpx.post(srv.url + "/wake_up", timeout=30)

    try:
        out = tmp_path / "aborted"
        flags = (
            f"--base-url {srv.url} --tokenizer {tiny_llama} --token-ids --num-prompts 4 --input-len 8 "
            "--output-len 1000 --ignore-eos --concurrency 4"
        )
        sleeper = threading.Thread(target=abort_once_all_run)
        sleeper.start()
        rc, stdout = bench(flags, "--output-dir", str(out))
        sleeper.join()
    finally:
        srv.kill()
    assert rc == 0 and slept == [200], stdout
    recs = _raw(out)
    assert all(r["finish_reason"] == "abort" and r["completion_tokens"] < 1000 for r in recs), recs
    m = _metrics(out)
    assert (m["completed"], m["failed"], m["failures"]) == (0, 4, {"aborted": 4})
    assert m["total_output_tokens"] == 0 and "aborted:4" in stdout


@pytest.mark.parametrize("flag", ["--api", "--api-k", "--a"])
def test_abbreviated_api_key_is_never_saved(
    standin, bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: str
) -> None:
    """argparse takes any unique prefix of --api-key; the command line saved with the results must
    not carry the key however the flag was spelled."""
    srv = standin("--tokens", "2")
    out = tmp_path / "secret"
    argv = [
        f"--base-url={srv.url}",
        flag,
        "sk-do-not-save",
        "--hea",
        "Authorization: Bearer sk-nor-this",
        "--num-prompts",
        "2",
        "--input-len",
        "4",
        "--output-len",
        "2",
    ]
    monkeypatch.setattr(sys, "argv", ["ferry", "bench", *argv])
    rc, stdout = bench(" ".join(argv[:1]), *argv[1:], "--output-dir", str(out))
    assert rc == 0, stdout
    assert _metrics(out)["completed"] == 2
    for f in out.iterdir():
        assert b"sk-do-not-save" not in f.read_bytes() and b"sk-nor-this" not in f.read_bytes(), f.name
