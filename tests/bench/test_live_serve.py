"""`ferry bench` against a live `ferry serve` of the tiny Llama: token accounting, chunk timing,
percentiles checked by hand on the raw records, reproducible request sets, conversations, and a
server killed mid-run."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest


def _raw(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "raw.jsonl").read_text().splitlines()]


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _replay(url: str, bench, run: Path, tmp_path: Path) -> tuple[int, str, Path]:  # noqa: ANN001
    """Replay ``run``'s saved request set (``--dataset jsonl``) into ``tmp_path / "replay"``."""
    replay = tmp_path / "replay"
    rc, stdout = bench(
        f"--base-url {url} --dataset jsonl",
        "--dataset-path",
        str(run / "requests.jsonl"),
        "--output-dir",
        str(replay),
    )
    return rc, stdout, replay


def _text_safe_bias(model_dir: Path) -> dict[str, float]:
    """logit_bias banning every token that yields no text on its own (special tokens, partial
    UTF-8 bytes), so each sampled token streams text at once and no chunk waits for the next."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    banned = {}
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i], skip_special_tokens=False)
        if not text or "\ufffd" in text or tok.id_to_token(i).startswith("<|"):
            banned[str(i)] = -100.0
    return banned


def test_token_accounting_itl_and_percentiles(ferry_serve, tiny_llama: Path, bench, tmp_path: Path) -> None:
    out = tmp_path / "live"
    # Token-id prompts (exact input length), ignore_eos (exact output length), one request at a
    # time after a warm-up, per-chunk usage, and no text-less tokens: one token per chunk.
    flags = (
        f"--base-url {ferry_serve.url} --tokenizer {tiny_llama} --token-ids --num-prompts 8 "
        "--input-len 24 --output-len 12 --range-ratio 0.25 --ignore-eos --concurrency 1 --warmup 1 "
        "--continuous-usage-stats --seed 5 --slo ttft=10000,tpot=10000"
    )
    rc, stdout = bench(
        flags,
        "--extra-body",
        json.dumps({"logit_bias": _text_safe_bias(tiny_llama)}),
        "--output-dir",
        str(out),
    )
    assert rc == 0, stdout
    recs = _raw(out)
    assert len(recs) == 9 and sum(r["warmup"] for r in recs) == 1
    for r in recs:
        assert r["ok"], r
        assert r["prompt_tokens"] == r["input_len"]  # token-id prompts are exact
        assert r["completion_tokens"] == r["output_len"]  # ignore_eos: exactly max_tokens
        assert (
            sum(r["chunk_tokens"]) == r["completion_tokens"] and len(r["chunk_tokens"]) == r["stream_chunks"]
        )
        assert len(r["itl_s"]) == r["stream_chunks"] - 1
        assert r["token_count_mismatch"] is False
    # The server folds tokens into one chunk only when its writer falls behind the engine (a step
    # of the tiny model takes about a millisecond, so a busy 2-core machine makes that happen now
    # and then, anywhere in a stream: on a loaded clean-clone run, in every one of the 9); how often
    # is timing, not accounting (a run beside other test runs, load 9 on 2 cores, got 49 chunks for
    # 109 tokens). What must hold is that tokens stream as they come rather than in one lump at the
    # end: the streams hold more than two token chunks each on average (a buffered answer is one; the
    # tiny model's 12 tokens take ~12 ms to write).
    chunks = sum(r["stream_chunks"] for r in recs)
    assert chunks > 2 * len(recs), [r["chunk_tokens"] for r in recs]

    measured = [r for r in recs if not r["warmup"]]
    m = _summary(out)["points"][0]["metrics"]
    by_hand = {
        "ttft_ms": [r["ttft_s"] * 1000 for r in measured],
        "tpot_ms": [(r["e2e_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1) * 1000 for r in measured],
        "itl_ms": [g * 1000 for r in measured for g in r["itl_s"]],
        "e2e_ms": [r["e2e_s"] * 1000 for r in measured],
    }
    for key, values in by_hand.items():
        stats = m[key]
        assert stats["count"] == len(values)
        assert stats["mean"] == pytest.approx(float(np.mean(values)), rel=1e-9)
        for name, q in (("median", 50), ("p90", 90), ("p99", 99)):
            assert stats[name] == pytest.approx(float(np.percentile(values, q)), rel=1e-9), (key, name)
    duration = _summary(out)["points"][0]["runs"][0]["duration_s"]
    assert m["completed"] == 8 and m["failed"] == 0
    assert m["total_output_tokens"] == sum(r["completion_tokens"] for r in measured)
    assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / duration)
    assert m["good_requests"] == 8
    assert "TTFT p99 (ms)" in stdout
    env = json.loads((out / "environment.json").read_text())
    assert env["model_dir"]["path"] == str(tiny_llama.resolve()) and len(env["model_dir"]["sha256"]) == 64
    assert env["model_dir"]["method"] == "sha256-full" and env["flags"]["seed"] == 5
    assert env["ferry_version"] and env["python"] and env["os"] and env["cpu_count"] >= 1
    assert env == _summary(out)["environment"]


def test_same_seed_same_request_set(ferry_serve, bench, tmp_path: Path) -> None:
    # Text prompts built through the server's /tokenize and /detokenize.
    flags = f"--base-url {ferry_serve.url} --tokenizer server --num-prompts 6 --input-len 20 --output-len 4"
    runs = {}
    for name, seed in (("a", 11), ("b", 11), ("c", 12)):
        out = tmp_path / name
        rc, stdout = bench(f"{flags} --seed {seed}", "--output-dir", str(out))
        assert rc == 0, stdout
        runs[name] = out
    a, b, c = ((runs[n] / "requests.jsonl").read_bytes() for n in "abc")
    assert a == b and a != c
    recs = _raw(runs["a"])
    assert all(r["ok"] for r in recs)
    # The text was fixed up until it encodes to the planned length, so the server counts it exactly.
    assert [r["prompt_tokens"] for r in recs] == [r["input_len"] for r in recs]
    rc, _, replay = _replay(ferry_serve.url, bench, runs["a"], tmp_path)
    assert rc == 0 and (replay / "requests.jsonl").read_bytes() == a


@pytest.mark.parametrize("endpoint", ["chat", "responses"])
def test_multi_turn(ferry_serve, bench, tmp_path: Path, endpoint: str) -> None:
    """Chat resends the conversation each turn; responses sends only the new message and the last
    answer's id (the replica keeps the conversation). Either way the prompt grows."""
    out = tmp_path / "mt"
    flags = (
        f"--base-url {ferry_serve.url} --dataset multi-turn --endpoint {endpoint} --num-prompts 2 --turns 3 "
        "--input-len 8 --output-len 5 --ignore-eos --concurrency 2"
    )
    rc, stdout = bench(flags, "--output-dir", str(out))
    assert rc == 0, stdout
    recs = _raw(out)
    assert len(recs) == 6 and all(r["ok"] and r["completion_tokens"] == 5 for r in recs)
    for s in ("bench-0-s00000", "bench-0-s00001"):
        turns = [r for r in recs if r["session_id"] == s]
        # Each turn's prompt holds at least the previous prompt, its answer and the new message.
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert cur["prompt_tokens"] >= prev["prompt_tokens"] + prev["completion_tokens"] + 8
    if endpoint == "responses":  # the plan as saved: one message each, the id added when sent
        bodies = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
        assert all(len(b["input"]) == 1 and "previous_response_id" not in b for b in bodies)


def _finished_requests(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:e2e_request_latency_seconds_count")
    )


def test_server_killed_mid_run(start_ferry_serve, bench, tmp_path: Path) -> None:
    srv = start_ferry_serve()
    killed_at: list[float] = []

    def kill_after_two_finish() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _finished_requests(srv.url) < 2:
            time.sleep(0.05)
        srv.kill()
        killed_at.append(time.monotonic())

    out = tmp_path / "killed"
    flags = (
        f"--base-url {srv.url} --tokenizer words --num-prompts 40 --input-len 16 --output-len 48 "
        "--ignore-eos --concurrency 2 --timeout 600"
    )
    killer = threading.Thread(target=kill_after_two_finish)
    killer.start()
    rc, stdout = bench(flags, "--output-dir", str(out))
    ended = time.monotonic()
    killer.join()
    assert rc == 1, stdout
    assert ended - killed_at[0] < 60  # no waiting out the 600 s timeout per remaining request
    s = _summary(out)
    assert s["server_lost"]
    m = s["points"][0]["metrics"]
    assert m["completed"] >= 2 and m["completed"] + m["failed"] == 40
    assert m["failures"].get("not_sent", 0) > 0
    assert set(m["failures"]) <= {"broken_stream", "connect_error", "not_sent"}
    assert m["failures"].get("broken_stream", 0) + m["failures"].get("connect_error", 0) >= 1
    assert len(_raw(out)) == 40 and "server lost" in stdout


def test_shared_prefix_reports_cached_prompt_tokens(
    ferry_serve, tiny_llama: Path, bench, tmp_path: Path
) -> None:
    out = tmp_path / "sp"
    flags = (
        f"--base-url {ferry_serve.url} --tokenizer {tiny_llama} --token-ids --dataset shared-prefix "
        "--num-groups 2 --prompts-per-group 3 --prefix-len 48 --input-len 8 --output-len 2 --ignore-eos "
        "--concurrency 1 --seed 21"
    )
    rc, stdout = bench(flags, "--output-dir", str(out))
    assert rc == 0, stdout
    prompts = [json.loads(x)["prompt"] for x in (out / "requests.jsonl").read_text().splitlines()]
    recs = _raw(out)
    seen: set[tuple[int, ...]] = set()
    for prompt, rec in zip(prompts, recs, strict=True):
        prefix = tuple(prompt[:48])
        # The first prompt of a group computes its prefix; the others find its 3 full blocks cached.
        assert rec["cached_tokens"] == (0 if prefix not in seen else 48), (rec, len(seen))
        seen.add(prefix)
    m = _summary(out)["points"][0]["metrics"]
    assert m["cached_prompt_tokens"] == 4 * 48
    assert m["cached_prompt_fraction"] == pytest.approx(4 * 48 / (6 * 56))
    assert "prompt tokens from cache (fraction)" in stdout


def test_responses_endpoint(ferry_serve, bench, tmp_path: Path) -> None:
    """`--endpoint responses`: OpenAI's Responses API, timed from its text delta events, counted from
    the usage of its last event; a saved request set replays as Responses bodies."""
    out = tmp_path / "responses"
    flags = (
        f"--base-url {ferry_serve.url} --endpoint responses --num-prompts 4 --input-len 12 "
        "--output-len 6 --ignore-eos --concurrency 2 --seed 3"
    )
    rc, stdout = bench(flags, "--output-dir", str(out))
    assert rc == 0, stdout
    recs = _raw(out)
    assert len(recs) == 4
    for r in recs:
        assert r["ok"] and r["http_status"] == 200, r
        assert r["completion_tokens"] == 6 and r["finish_reason"] == "length"  # max_output_tokens reached
        assert r["prompt_tokens"] > 0 and r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"]
        assert 1 <= r["stream_chunks"] <= 6 and len(r["itl_s"]) == r["stream_chunks"] - 1
    bodies = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert all("input" in b and b["max_output_tokens"] == 6 and "stream_options" not in b for b in bodies)
    assert _summary(out)["endpoint"] == "responses"
    rc, stdout, replay = _replay(ferry_serve.url, bench, out, tmp_path)
    assert rc == 0 and all(r["ok"] and r["completion_tokens"] == 6 for r in _raw(replay)), stdout
    rc, stdout = bench(f"--base-url {ferry_serve.url} --endpoint responses --continuous-usage-stats")
    assert rc != 0 and "--continuous-usage-stats does not apply to --endpoint responses" in stdout


def test_embeddings_endpoint(ferry_serve, tiny_llama: Path, bench, tmp_path: Path) -> None:
    """`--endpoint embeddings`: one answer per input, timed to it, prompt tokens from its usage;
    a saved request set replays as embeddings (its bodies alone would read as Responses ones)."""
    out = tmp_path / "emb"
    flags = (
        f"--base-url {ferry_serve.url} --endpoint embeddings --tokenizer {tiny_llama} --token-ids "
        "--num-prompts 6 --input-len 16 --range-ratio 0.5 --concurrency 3 --seed 2"
    )
    rc, stdout = bench(flags, "--output-dir", str(out))
    assert rc == 0, stdout
    recs = _raw(out)
    assert len(recs) == 6
    for r in recs:
        assert r["ok"] and r["http_status"] == 200, r
        assert r["prompt_tokens"] == r["input_len"] and r["completion_tokens"] == 0
        assert r["ttft_s"] == r["e2e_s"] > 0 and r["itl_s"] == []
    m = _summary(out)["points"][0]["metrics"]
    assert m["total_input_tokens"] == sum(r["input_len"] for r in recs) and m["total_output_tokens"] == 0
    bodies = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert all(
        set(b) == {"model", "input", "ferry_bench"} and b["ferry_bench"]["endpoint"] == "embeddings"
        for b in bodies
    )
    rc, stdout, replay = _replay(ferry_serve.url, bench, out, tmp_path)
    assert rc == 0 and all(r["ok"] and r["completion_tokens"] == 0 for r in _raw(replay)), stdout
    assert (replay / "requests.jsonl").read_bytes() == (out / "requests.jsonl").read_bytes()
