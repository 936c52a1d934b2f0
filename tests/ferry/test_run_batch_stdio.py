"""`ferry run-batch -i - -o -`: standard input as the input file, standard output as the output file,
as in a shell pipeline (``producer | ferry run-batch -i - -o - … | consumer``).

Each run is a real ``python -m ferry`` process fed through a real pipe or file descriptor. Standard
output carries the JSONL alone, byte for byte what ``-o FILE`` writes (after the ids and clocks that
differ per run), even when something in the process prints to it meanwhile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import tracemalloc
from pathlib import Path

from ferry.cli import main
from server.batch_lines import FileLines  # imported now: its import is not the measured copy's cost
from server.run_batch import read_input

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The quick brown fox"


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _requests() -> bytes:
    lines = [
        _line("c0", "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0}),
        "{not json",
        _line(
            "chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        ),
        _line("bad-model", "/v1/completions", {"model": "nope", "prompt": PROMPT}),
        "",
        _line("c1", "/v1/completions", {"prompt": f"{PROMPT} jumps", "max_tokens": 3, "temperature": 0}),
    ]
    return ("\n".join(lines) + "\n").encode()


def _flags(model: Path) -> list[str]:
    return ["--model", str(model), "--num-threads", "1", "--deterministic", "--max-batch-concurrency", "2"]


def _ferry(args: list[str], stdin: int | bytes) -> subprocess.CompletedProcess:
    piped = isinstance(stdin, bytes)
    return subprocess.run(
        [sys.executable, "-m", "ferry", *args],
        cwd=REPO,
        input=stdin if piped else None,
        stdin=None if piped else stdin,
        capture_output=True,
        timeout=300,
    )


def _normalised(raw: bytes) -> list[dict]:
    """The output lines with what differs from run to run (request ids, `created`) blanked; every
    line exactly as the result spool serialises it."""
    out = []
    for text in raw.split(b"\n")[:-1]:
        line = json.loads(text)
        assert text == json.dumps(line).encode()
        rid = line["response"]["request_id"]
        line = json.loads(text.decode().replace(rid, "RID"))
        body = line["response"]["body"]
        if "created" in body:
            body["created"] = 0
        out.append(line)
    return out


def test_stdin_pipe_to_stdout_equals_the_file_output(tiny_llama: Path, tmp_path: Path) -> None:
    data = _requests()
    done = _ferry(["run-batch", "-i", "-", "-o", "-", *_flags(tiny_llama)], data)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.endswith(b"\n")
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(data)
    assert main(["run-batch", "-i", str(source), "-o", str(target), *_flags(tiny_llama)]) == 0
    piped, written = _normalised(done.stdout), _normalised(target.read_bytes())
    assert piped == written
    assert [o["custom_id"] for o in piped] == ["c0", None, "chat", "bad-model", "c1"]
    assert [o["response"]["status_code"] for o in piped] == [200, 400, 200, 404, 200]
    assert piped[0]["response"]["body"]["usage"]["completion_tokens"] == 5
    assert b"wrote 5 results to stdout (2 failed)" in done.stderr


def test_stdout_holds_only_the_results_whatever_else_prints(tiny_llama: Path, tmp_path: Path) -> None:
    # Something in the process writes to standard output while the batch runs (a library's print,
    # a C extension writing to descriptor 1): it goes to standard error, never among the results.
    # Standard input is a file already read past its first line by the shell (as
    # `{ read header; ferry run-batch -i - …; } < file`): the run starts where stdin stands.
    source = tmp_path / "in.jsonl"
    header = b"# a header line the caller consumed\n"
    source.write_bytes(header + _requests())
    noisy = textwrap.dedent(
        """
        import os, sys
        import server.app
        from ferry.cli import main
        build_app = server.app.build_app
        def noisy_build_app(*args, **kwargs):
            print("noise from print")
            sys.stdout.flush()
            os.write(1, b"noise on descriptor 1\\n")
            return build_app(*args, **kwargs)
        server.app.build_app = noisy_build_app
        print("noise before the run", flush=True)
        code = main(sys.argv[1:])
        print("noise after the run", flush=True)
        raise SystemExit(code)
        """
    )
    fd = os.open(source, os.O_RDONLY)
    try:
        os.lseek(fd, len(header), os.SEEK_SET)
        done = subprocess.run(
            [sys.executable, "-c", noisy, "run-batch", "-i", "-", "-o", "-", *_flags(tiny_llama)],
            cwd=REPO,
            stdin=fd,
            capture_output=True,
            timeout=300,
        )
    finally:
        os.close(fd)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    # Before and after the run the process's stdout is its own again.
    assert done.stdout.startswith(b"noise before the run\n")
    assert done.stdout.endswith(b"noise after the run\n")
    results = done.stdout.removeprefix(b"noise before the run\n").removesuffix(b"noise after the run\n")
    out = _normalised(results)
    assert [o["custom_id"] for o in out] == ["c0", None, "chat", "bad-model", "c1"]
    assert b"noise from print\n" in done.stderr and b"noise on descriptor 1\n" in done.stderr


def test_bad_stdin_is_refused_before_the_model_loads(tiny_llama: Path, tmp_path: Path) -> None:
    # Standard input redirected from a file (seekable): read in place, the bad byte's offset told
    # in the whole input; standard output stays empty.
    source = tmp_path / "in.jsonl"
    good = _line("c0", "/v1/completions", {"prompt": PROMPT}).encode() + b"\n"
    source.write_bytes(good + b'{"custom_id": "\xff"}\n')
    with source.open("rb") as stdin:
        done = _ferry(["run-batch", "-i", "-", "-o", "-", *_flags(tiny_llama)], stdin.fileno())
    assert done.returncode == 2
    assert done.stdout == b""
    err = done.stderr.decode()
    assert err == (
        "ferry run-batch: error: cannot read stdin: 'utf-8' codec can't decode byte 0xff in position "
        f"{len(good) + 15}: invalid start byte\n"
    )


def test_stdin_pipe_is_copied_never_held_whole() -> None:
    # 16 MiB through a pipe on descriptor 0: copied to a temporary file a chunk at a time, every
    # line counted, the first and last read back from the copy. Python's allocations meanwhile
    # (tracemalloc: the feeding thread's too) stay far below the input's size (measured: 0.15 MiB).
    line = (_line("c", "/v1/completions", {"prompt": "x" * 1000}) + "\n").encode()
    count = 16 * 1024 * 1024 // len(line)
    read_end, write_end = os.pipe()
    saved = os.dup(0)

    def feed() -> None:
        with open(write_end, "wb") as f:
            for _ in range(count):
                f.write(line)

    writer = threading.Thread(target=feed, daemon=True)
    os.dup2(read_end, 0)
    os.close(read_end)
    tracemalloc.start()
    try:
        writer.start()
        lines = read_input("-")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        os.dup2(saved, 0)
        os.close(saved)
    writer.join(timeout=30)
    try:
        assert len(lines) == count
        assert isinstance(lines, FileLines) and peak < 1024 * 1024, peak
        first = last = None
        for last in lines:
            first = first or last
        assert first == last == line.decode().removesuffix("\n")
    finally:
        lines.close()
