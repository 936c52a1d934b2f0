"""`bench/chaos.py`: how it judges an answer (exact verdicts), and a small run — a replica killed and
restarted, Redis restarted, one API server process killed — in which every client gets a whole
answer or a clean error, the router serves again after each fault, and everything is idle after."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.chaos import judge  # noqa: E402

DONE = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n'


def test_judge_tells_whole_answers_from_broken_ones() -> None:
    whole = json.dumps({"choices": [{"text": "a", "finish_reason": "length"}]}).encode()
    assert judge(200, {}, whole, stream=False) == "ok"
    assert judge(200, {}, whole[:-5], stream=False) == "BAD-truncated-json"
    unfinished = json.dumps({"choices": [{"text": "a", "finish_reason": None}]}).encode()
    assert judge(200, {}, unfinished, stream=False) == "BAD-incomplete-choices"
    assert judge(200, {}, DONE, stream=True) == "ok"
    assert judge(200, {}, DONE.split(b"data: [DONE]")[0], stream=True) == "BAD-stream-cut"
    error_end = b'data: {"choices": []}\n\ndata: {"error": {"message": "replica died"}}\n\ndata: [DONE]\n\n'
    assert judge(200, {}, error_end, stream=True) == "stream-error"
    refused = json.dumps({"error": {"message": "no healthy replica", "type": "x", "code": 503}}).encode()
    assert judge(503, {}, refused, stream=True) == "refused-503: no healthy replica"
    assert judge(502, {}, b"Bad Gateway", stream=False) == "BAD-502-not-openai-error"


def test_small_chaos_run_serves_through_faults() -> None:
    cmd = [sys.executable, "bench/chaos.py", "--concurrency", "4", "--phase", "2", "--pause", "2"]
    cmd += ["--faults", "kill-b,redis-restart,kill-api-server"]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    report = json.loads(run.stdout[run.stdout.index("{\n") : run.stdout.index("\n}\n") + 2])
    phases = report["router:outcomes"]
    assert set(phases) == {"warm", "kill-b", "redis-restart", "kill-api-server", "after"}
    assert all(not k.startswith("BAD") for counts in phases.values() for k in counts)
    assert all(counts.get("ok", 0) > 0 for counts in phases.values())
    assert sorted(report["recovery_s"]) == ["kill-api-server@router", "kill-b@router", "redis-restart@router"]
