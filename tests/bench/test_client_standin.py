"""The bench client against bench/standin.py (a real HTTP server with known, exact answers):
chunk accounting, failure kinds, datasets, replay, arrivals, dry runs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from bench.client.load import arrival_gaps

REPO = Path(__file__).resolve().parents[2]


def _raw(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "raw.jsonl").read_text().splitlines()]


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_multi_token_chunks_itl_per_chunk(standin, bench, tmp_path: Path) -> None:
    srv = standin("--tokens", "10", "--tokens-per-chunk", "3")
    out = tmp_path / "r"
    flags = f"--base-url {srv.url} --num-prompts 5 --input-len 12 --output-len 10 --concurrency 2"
    rc, stdout = bench(flags, "--output-dir", str(out))
    assert rc == 0, stdout
    recs = _raw(out)
    assert len(recs) == 5
    for r in recs:
        assert r["ok"] and r["completion_tokens"] == 10 and r["prompt_tokens"] == 12
        assert r["stream_chunks"] == 4  # 3 + 3 + 3 + 1 tokens
        assert len(r["itl_s"]) == 3
        assert r["chunk_tokens"] == []  # no per-chunk usage asked for
        assert r["token_count_mismatch"] is True  # usage 10 != 4 chunks: not one token per chunk
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / 9)
    m = _summary(out)["points"][0]["metrics"]
    assert m["token_count_mismatches"] == 5 and m["total_output_tokens"] == 50 and m["itl_ms"]["count"] == 15
    assert "requests ok" in stdout and "c=2" in stdout

    out = tmp_path / "continuous"
    rc, _ = bench(flags + " --continuous-usage-stats", "--output-dir", str(out))
    assert rc == 0
    for r in _raw(out):  # per-chunk usage: exact tokens per chunk, and they add up to the usage
        assert r["chunk_tokens"] == [3, 3, 3, 1] and r["token_count_mismatch"] is False


def test_server_that_does_not_stream(standin, bench, tmp_path: Path) -> None:
    srv = standin("--tokens", "5")
    out = tmp_path / "whole"
    rc, _ = bench(
        f"--base-url {srv.url} --num-prompts 3 --input-len 4 --output-len 5 --endpoint chat",
        "--extra-body",
        '{"stream": false}',
        "--output-dir",
        str(out),
    )
    assert rc == 0
    for r in _raw(out):  # one JSON answer: measured as one chunk, TTFT = E2E
        assert r["ok"] and r["completion_tokens"] == 5 and r["stream_chunks"] == 1 and r["itl_s"] == []
        assert r["ttft_s"] == r["e2e_s"] and r["finish_reason"] == "stop"


def test_failures_are_typed_and_counted(standin, bench, tmp_path: Path) -> None:
    slow = standin("--tokens", "4", "--ttft-ms", "3000")
    out = tmp_path / "timeout"
    rc, _ = bench(
        f"--base-url {slow.url} --num-prompts 3 --input-len 4 --output-len 4 --timeout 0.3",
        "--output-dir",
        str(out),
    )
    assert rc == 0  # failures are results; the run itself finished
    m = _summary(out)["points"][0]["metrics"]
    assert (m["completed"], m["failed"], m["failures"]) == (0, 3, {"timeout": 3})

    fast = standin("--tokens", "4")
    out = tmp_path / "http"
    rc, stdout = bench(
        f"--base-url {fast.url} --num-prompts 3 --input-len 4 --output-len 4",
        "--extra-body",
        '{"max_tokens": 0}',
        "--output-dir",
        str(out),
    )
    assert rc == 0
    recs = _raw(out)
    assert {(r["error_kind"], r["http_status"]) for r in recs} == {("http_400", 400)}
    assert "max_tokens" in recs[0]["error"]
    assert "http_400:3" in stdout


def test_server_lost_ends_run_quickly(standin, bench, tmp_path: Path) -> None:
    srv = standin("--tokens", "4", "--ttft-ms", "200")

    def kill_when_the_second_arrives() -> None:  # the first has finished (one at a time)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if httpx.get(srv.url + "/standin/stats", timeout=5).json()["completions"] >= 2:
                break
            time.sleep(0.02)
        srv.kill()  # nothing listens any more: connection refused at once

    out = tmp_path / "gone"
    flags = f"--base-url {srv.url} --model standin --tokenizer words --num-prompts 50 --concurrency 1,4 --timeout 60"
    killer = threading.Thread(target=kill_when_the_second_arrives)
    killer.start()
    rc, stdout = bench(flags, "--output-dir", str(out))
    killer.join()
    assert rc == 1, stdout
    s = _summary(out)
    assert s["server_lost"] and s["skipped_points"] == ["c=4"]
    m = s["points"][0]["metrics"]
    assert m["completed"] >= 1 and m["completed"] + m["failed"] == 50 and m["failures"]["not_sent"] > 0
    assert set(m["failures"]) <= {"broken_stream", "connect_error", "not_sent"}
    assert "server lost" in stdout


@pytest.mark.parametrize("model", [[], ["--model", "standin"]])
def test_refused_url_fails_fast_with_one_line(standin, bench, tmp_path: Path, model: list[str]) -> None:
    """Nothing listening before any request: one clear line and exit 2, whether or not --model
    spares the bench asking the server for its model (no table of failed requests)."""
    srv = standin("--tokens", "4")
    srv.kill()
    out = tmp_path / "refused"
    flags = f"--base-url {srv.url} --tokenizer words --num-prompts 5"
    rc, stdout = bench(flags, *model, "--output-dir", str(out))
    assert rc == 2
    [line] = stdout.splitlines()
    assert line.startswith(f"ferry bench: error: cannot connect to {srv.url} (")
    assert line.endswith("); is the server up?")
    assert not out.exists()


def test_multi_turn_context_grows_and_replays(standin, bench, tmp_path: Path) -> None:
    srv = standin("--tokens", "4")
    out = tmp_path / "mt"
    flags = (
        f"--base-url {srv.url} --dataset multi-turn --num-prompts 2 --turns 3 --input-len 5 --output-len 4"
    )
    rc, _ = bench(flags + " --concurrency 2", "--output-dir", str(out))
    assert rc == 0
    lines = _lines(out / "requests.jsonl")
    assert [(x["ferry_bench"]["session_id"], x["ferry_bench"]["turn"]) for x in lines] == [
        ("bench-0-s00000", 0), ("bench-0-s00000", 1), ("bench-0-s00000", 2),
        ("bench-0-s00001", 0), ("bench-0-s00001", 1), ("bench-0-s00001", 2),
    ]  # fmt: skip
    # Byte tokens: each turn's prompt = earlier turns (5 each) + earlier answers (4 each) + 5 new.
    recs = _raw(out)
    assert [r["prompt_tokens"] for r in recs] == [5, 14, 23] * 2
    by_session: dict[str, list[dict]] = {}
    for r in recs:
        by_session.setdefault(r["session_id"], []).append(r)
    for turns in by_session.values():  # a turn is sent only after the previous answer ended
        for a, b in zip(turns, turns[1:], strict=False):
            assert b["send_time_s"] >= a["send_time_s"] + a["e2e_s"]
    replay = tmp_path / "replay"
    rc, _ = bench(
        f"--base-url {srv.url} --dataset jsonl",
        "--dataset-path",
        str(out / "requests.jsonl"),
        "--output-dir",
        str(replay),
    )
    assert rc == 0
    assert (replay / "requests.jsonl").read_bytes() == (out / "requests.jsonl").read_bytes()
    # Both runs sent every turn of a session under its X-Session-Id header.
    stats = httpx.get(srv.url + "/standin/stats").json()
    assert stats["sessions"] == {"bench-0-s00000": 6, "bench-0-s00001": 6}
    assert [r["prompt_tokens"] for r in _raw(replay)] == [5, 14, 23] * 2


def test_shared_prefix_token_ids(standin, bench, tmp_path: Path) -> None:
    srv = standin("--tokens", "2")
    out = tmp_path / "sp"
    flags = (
        f"--base-url {srv.url} --dataset shared-prefix --num-groups 3 --prompts-per-group 4 "
        "--prefix-len 20 --input-len 6 --output-len 2 --token-ids --warmup 1 --dry-run"
    )
    rc, _ = bench(flags, "--output-dir", str(out))
    assert rc == 0
    prompts = [x["prompt"] for x in _lines(out / "requests.jsonl")]
    assert len(prompts) == 13 and all(len(p) == 26 for p in prompts)
    prefixes = {tuple(p[:20]) for p in prompts}
    assert len(prefixes) == 3
    measured = [tuple(p[:20]) for p in prompts[1:]]
    assert sorted(measured.count(x) for x in prefixes) == [4, 4, 4]
    assert not (out / "raw.jsonl").exists()  # a dry run sends nothing


def test_random_lengths_and_seed(standin, bench, tmp_path: Path) -> None:
    srv = standin("--tokens", "64")
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    common = (
        f"--base-url {srv.url} --num-prompts 20 --input-len 30 --output-len 10 --range-ratio 0.5 --dry-run"
    )
    assert bench(common + " --seed 3", "--output-dir", str(a))[0] == 0
    assert bench(common + " --seed 3", "--output-dir", str(b))[0] == 0
    assert bench(common + " --seed 4", "--output-dir", str(c))[0] == 0
    assert (a / "requests.jsonl").read_bytes() == (b / "requests.jsonl").read_bytes()
    assert (a / "requests.jsonl").read_bytes() != (c / "requests.jsonl").read_bytes()
    lines = _lines(a / "requests.jsonl")
    for x in lines:  # the stand-in's tokenizer is bytes, so text length = token length, exactly
        assert 15 <= x["ferry_bench"]["input_len"] <= 45
        assert len(x["prompt"].encode()) == x["ferry_bench"]["input_len"]
        assert 5 <= x["max_tokens"] <= 15 and x["stream"] and x["stream_options"] == {"include_usage": True}
    assert len({x["ferry_bench"]["input_len"] for x in lines}) > 5


def test_request_rate_schedule(standin, bench, tmp_path: Path) -> None:
    srv = standin("--tokens", "2")
    out = tmp_path / "rate"
    flags = (
        f"--base-url {srv.url} --num-prompts 12 --input-len 4 --output-len 2 --request-rate 40 "
        "--burstiness 2 --repeat 2"
    )
    rc, _ = bench(flags, "--output-dir", str(out))
    assert rc == 0
    gaps = arrival_gaps(40.0, 2.0, 12, seed=0)
    planned = [sum(gaps[: i + 1]) for i in range(12)]
    recs = _raw(out)
    for run in (0, 1):
        sends = [r["send_time_s"] for r in recs if r["run"] == run]
        for actual, want in zip(sends, planned, strict=True):  # never early; not far behind when idle
            assert want - 1e-3 <= actual <= want + 0.25
    point = _summary(out)["points"][0]
    assert point["label"] == "rate=40" and len(point["runs"]) == 2 and point["metrics"]["completed"] == 24


def test_reset_prefix_cache_before_each_run(standin, bench, tmp_path: Path) -> None:
    srv = standin("--tokens", "2")
    flags = f"--base-url {srv.url} --num-prompts 3 --input-len 4 --output-len 2 --concurrency 1,2 --repeat 2 --warmup 1"
    assert bench(flags + " --reset-prefix-cache", "--output-dir", str(tmp_path / "r"))[0] == 0
    assert httpx.get(srv.url + "/standin/stats").json() == {"completions": 16, "resets": 4, "sessions": {}}


def test_api_key_is_sent_but_never_saved(standin, bench, tmp_path: Path) -> None:
    srv = standin("--tokens", "2")
    out = tmp_path / "secret"
    rc, stdout = bench(
        f"--base-url {srv.url} --num-prompts 2 --input-len 4 --output-len 2 --api-key sk-do-not-save",
        "--header",
        "Authorization: Bearer sk-do-not-save-either",
        "--output-dir",
        str(out),
    )
    assert rc == 0 and _summary(out)["points"][0]["metrics"]["completed"] == 2
    for f in out.iterdir():
        assert b"sk-do-not-save" not in f.read_bytes(), f.name


def test_bad_flags_are_clear(bench) -> None:
    rc, out = bench("--dataset multi-turn --endpoint completions")
    assert rc == 2 and "multi-turn needs --endpoint chat" in out
    rc, out = bench("--dataset jsonl")
    assert rc == 2 and "--dataset-path" in out
    rc, out = bench("--slo ttft=fast")
    assert rc == 2 and "not a number" in out


def test_cli_subprocess_progress_and_table(standin, tmp_path: Path) -> None:
    srv = standin("--tokens", "3")
    out = tmp_path / "cli"
    cmd = [
        sys.executable,
        "-m",
        "ferry",
        "bench",
        "--base-url",
        srv.url,
        "--num-prompts",
        "4",
        "--input-len",
        "4",
        "--output-len",
        "3",
        "--concurrency",
        "2",
        "--output-dir",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "[c=2 run 1/1]" in proc.stderr and "4/4 failed 0" in proc.stderr  # progress on stderr
    assert "request throughput (req/s)" in proc.stdout and f"results: {out}" in proc.stdout
    assert {p.name for p in out.iterdir()} == {
        "summary.json",
        "summary.txt",
        "raw.jsonl",
        "requests.jsonl",
        "environment.json",
    }


def test_lora_modules_spread_chains_over_adapters(standin, bench, tmp_path: Path) -> None:
    srv = standin("--tokens", "2")
    plain, spread = tmp_path / "plain", tmp_path / "spread"
    common = f"--base-url {srv.url} --num-prompts 40 --input-len 6 --output-len 2 --dry-run"
    assert bench(common, "--output-dir", str(plain))[0] == 0
    assert bench(common + " --lora-modules sql chat", "--output-dir", str(spread))[0] == 0
    a, b = _lines(plain / "requests.jsonl"), _lines(spread / "requests.jsonl")
    assert [x["prompt"] for x in a] == [x["prompt"] for x in b]  # the same prompts either way
    models = [x["model"] for x in b]
    assert set(models) == {"sql", "chat"} and 10 <= models.count("sql") <= 30
    turns = tmp_path / "turns"
    multi = (
        f"--base-url {srv.url} --dataset multi-turn --num-prompts 6 --turns 3 --input-len 4 --output-len 2"
    )
    assert bench(multi + " --dry-run --lora-modules sql chat", "--output-dir", str(turns))[0] == 0
    by_session: dict[str, set[str]] = {}
    for x in _lines(turns / "requests.jsonl"):
        by_session.setdefault(x["ferry_bench"]["session_id"], set()).add(x["model"])
    assert all(len(m) == 1 for m in by_session.values())  # a conversation keeps its adapter
