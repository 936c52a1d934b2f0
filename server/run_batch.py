"""`ferry run-batch -i INPUT -o OUTPUT [serve flags]`: a JSONL file of OpenAI requests, offline.

As vLLM's ``vllm run-batch``: INPUT and OUTPUT are local paths or http(s) URLs (the input is
fetched with GET, the output sent with PUT, as to a pre-signed object-store URL), or ``-``: standard
input, standard output (which then carries the JSONL alone: see ``reserve_stdout``). One engine is
built from the same flags `ferry serve` takes, the replica's app over it, and every line is sent
through that app in this process (``server/batch_lines.py``), at most ``--max-batch-concurrency``
at once (default ``--max-num-seqs``). Output lines come in input order; a bad line gets an error
line and the rest still run. Nothing listens on a port.

Neither file is ever held whole: the input is counted and checked as UTF-8 before the model loads,
then read a line at a time as request slots free up (``read_ahead`` over a ``FileLines``); a URL's
body, or a pipe's, is first streamed to a temporary file, as the lines are read twice. Answers are
spooled to a temporary file as they come (``ResultSpool``) and copied from it in input order at the
end, to the output file or to a temporary file PUT with its length. This module must never build
a list of the lines or of the answers.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from server.batch_lines import FileLines
    from server.batch_results import ResultSpool

logger = logging.getLogger("ferry.batch")


def add_run_batch_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from server.args import add_serve_args

    p.add_argument(
        "-i",
        "--input-file",
        required=True,
        help="JSONL of batch requests: a local path, an http(s) URL, or - for standard input",
    )
    p.add_argument(
        "-o",
        "--output-file",
        required=True,
        help="where the results go: a local path, an http(s) URL they are PUT to, or - for standard output",
    )
    p.add_argument(
        "--output-tmp-dir",
        default=None,
        help="the directory the results are kept in until they are written (sent, for a URL); "
        "default: the system's temporary directory",
    )
    return add_serve_args(p)


STD = "-"  # standard input as the input file, standard output as the output file


def _is_url(where: str) -> bool:
    return where.startswith(("http://", "https://"))


def _shown(where: str, stream: str) -> str:
    return stream if where == STD else where


def read_input(where: str) -> FileLines:
    """The input's non-blank lines, counted and checked as UTF-8 now and read from an open file a
    line at a time later: a local file itself (standard input for "-", when it is one), or a
    temporary copy of a URL's body or of a pipe (``-i -``, ``-i /dev/stdin``), which could not be
    read twice. OSError, UnicodeDecodeError (at its offset in the file) or httpx.HTTPError when it
    cannot be read."""
    from server.batch_lines import FileLines

    file = _download(where) if _is_url(where) else _open_local(where)
    try:
        return FileLines(file, _count_lines(file))
    except BaseException:
        file.close()
        raise


def _download(url: str) -> IO[bytes]:
    """The body of a GET of ``url``, streamed to a temporary file as UTF-8: decoded as httpx's
    ``Response.text`` decodes it (its charset, else UTF-8, bad bytes replaced), a chunk at a time."""
    import httpx

    file = tempfile.TemporaryFile()
    try:
        with httpx.stream("GET", url, timeout=60.0, follow_redirects=True) as response:
            response.raise_for_status()
            for text in response.iter_text():
                file.write(text.encode("utf-8"))
    except BaseException:
        file.close()
        raise
    return file


def _open_local(path: str) -> IO[bytes]:
    # FileLines owns and closes it; "-": a handle of its own on descriptor 0, so closing it leaves
    # sys.stdin open.
    file = open(os.dup(0), "rb") if path == STD else open(path, "rb")
    if file.seekable() and file.tell() == 0:  # FileLines reads from offset 0 each time
        return file
    with file:  # a pipe, a terminal, or stdin part-read: read once, into a file that can be read again
        copy = tempfile.TemporaryFile()
        try:
            shutil.copyfileobj(file, copy)
        except BaseException:
            copy.close()
            raise
        return copy


def _count_lines(file: IO[bytes]) -> int:
    from server.batch_lines import file_lines

    file.seek(0)
    try:
        return sum(1 for _ in file_lines(file))
    except UnicodeDecodeError as e:  # the bad line was the last one read: it ends at tell()
        raise FileDecodeError(e, file.tell() - len(e.object)) from None


class FileDecodeError(UnicodeDecodeError):
    """A line's UnicodeDecodeError told at its place in the whole file (``line_at``: the offset of
    the line's first byte), as decoding the whole file at once tells it."""

    def __init__(self, e: UnicodeDecodeError, line_at: int) -> None:
        super().__init__(e.encoding, e.object, e.start, e.end, e.reason)
        self.line_at = line_at

    def __str__(self) -> str:
        start = self.line_at + self.start
        if self.end == self.start + 1:
            byte = self.object[self.start]
            return (
                f"'{self.encoding}' codec can't decode byte 0x{byte:02x} in position {start}: {self.reason}"
            )
        end = self.line_at + self.end - 1
        return f"'{self.encoding}' codec can't decode bytes in position {start}-{end}: {self.reason}"


def write_output(
    where: str, lines: Iterable[bytes], stdout: int | None = None, tmp_dir: str | None = None
) -> None:
    """``lines`` to a local file, to the descriptor ``stdout`` (``where`` is "-"), or PUT to a URL
    from a temporary file in ``tmp_dir`` (streamed, with a Content-Length, which a pre-signed
    object-store URL requires)."""
    if where == STD:
        assert stdout is not None, "reserve_stdout gives the descriptor"
        with open(stdout, "wb", closefd=False) as file:
            file.writelines(lines)
        return
    if _is_url(where):
        import httpx

        with tempfile.TemporaryFile(dir=tmp_dir) as body:
            body.writelines(lines)
            body.seek(0)
            response = httpx.put(where, content=body, timeout=60.0)
            response.raise_for_status()
        return
    with open(where, "wb") as file:
        file.writelines(lines)


def unwritable(where: str) -> str | None:
    """Why a local output file could not be written (its directory missing or read-only, or it is
    a directory), or None; a URL is tried only when the results are there."""
    if _is_url(where) or where == STD:
        return None
    path = Path(where)
    if path.is_dir():
        return "it is a directory"
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        return f"no such directory: {parent}"
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return "permission denied"
    return None


def _error(problem: object) -> int:
    print(f"ferry run-batch: error: {problem}", file=sys.stderr)
    return 2


def reserve_stdout() -> int:
    """For ``-o -``: a descriptor of the real standard output, kept for the results, while
    descriptor 1 points at standard error until ``release_stdout``, so nothing else the process
    writes there (a library's print, a C extension's message) can land among the JSONL lines."""
    sys.stdout.flush()
    results = os.dup(1)
    os.dup2(2, 1)
    return results


def release_stdout(results: int) -> None:
    sys.stdout.flush()
    os.dup2(results, 1)
    os.close(results)


def run_batch(args: argparse.Namespace) -> int:
    if args.output_file != STD:
        return _run_batch(args, None)
    try:
        stdout = reserve_stdout()
    except OSError as e:  # no standard output to write to (closed: `>&-`)
        return _error(f"cannot write stdout: {e}")
    try:
        return _run_batch(args, stdout)
    finally:
        release_stdout(stdout)


def _run_batch(args: argparse.Namespace, stdout: int | None) -> int:
    import httpx

    from server.main import serve_configs

    if args.api_server_count != 1:
        return _error("--api-server-count does not apply to run-batch (no API server runs)")
    try:
        config, engine_config = serve_configs(args)
    except ValueError as e:
        return _error(e)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        lines = read_input(args.input_file)
    except (OSError, ValueError, httpx.HTTPError) as e:  # ValueError: UnicodeDecodeError, a NUL in the path
        return _error(f"cannot read {_shown(args.input_file, 'stdin')}: {e}")
    try:
        return _run_and_write(args, config, engine_config, lines, stdout)
    finally:
        lines.close()


def _run_and_write(
    args: argparse.Namespace, config: object, engine_config: object, lines: FileLines, stdout: int | None
) -> int:
    import httpx

    from server.batch_results import ResultSpool
    from server.main import loop_factory

    output = _shown(args.output_file, "stdout")
    problem = unwritable(args.output_file)
    if problem is not None:  # found now, not after every request has run
        return _error(f"cannot write {args.output_file}: {problem}")
    tmp_dir = args.output_tmp_dir
    if tmp_dir is not None and not (os.path.isdir(tmp_dir) and os.access(tmp_dir, os.W_OK | os.X_OK)):
        return _error(f"cannot use --output-tmp-dir {tmp_dir}: not a writable directory")
    concurrency = args.max_batch_concurrency or engine_config.max_num_seqs
    results = ResultSpool(len(lines), tmp_dir)  # vLLM's --output-tmp-dir: the results before they go
    try:
        try:
            with asyncio.Runner(loop_factory=loop_factory()) as runner:
                runner.run(_run(engine_config, config, lines, results, concurrency))
        except (ValueError, OSError) as e:  # the model directory, flags the model cannot meet
            return _error(e)
        answered = len(results)
        if answered < len(lines):
            print(
                f"ferry run-batch: interrupted: {answered} of {len(lines)} requests answered, "
                f"those written to {output}",
                file=sys.stderr,
            )
        try:
            write_output(args.output_file, results.lines(), stdout, tmp_dir)
        except (OSError, httpx.HTTPError) as e:
            return _error(f"cannot write {output}: {e}")
        logger.info("wrote %d results to %s (%d failed)", answered, output, results.failed)
        return 0 if answered == len(lines) else 130
    finally:
        results.close()


async def _run(
    engine_config: object, config: object, lines: FileLines, results: ResultSpool, concurrency: int
) -> None:
    from engine import AsyncEngine
    from server.app import build_app
    from server.batch_lines import AppCaller, Progress, read_ahead, stream_lines
    from server.lora import preload

    engine = AsyncEngine(engine_config)  # inside the loop: it binds its output queues to it
    try:
        await preload(engine, config.lora_modules)
        app = build_app(engine, config)
        progress = Progress("run-batch", len(lines))
        logger.info("running %d requests, at most %d at once", len(lines), concurrency)
        # Ctrl-C or SIGTERM: no more lines start, those running are aborted, and what was answered
        # is still written (their places stay empty).
        gone = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, gone.set)
        try:
            # Only the lines counted: a file appended to meanwhile never runs past its results' places.
            counted = itertools.islice(lines, len(lines))
            await stream_lines(
                AppCaller(app, config.api_key),
                read_ahead(counted),
                concurrency,
                results.add,
                progress=progress,
                gone=gone,
            )
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        state = app.state.ferry
        await state.background.close()
        if state.responses is not None:
            await state.responses.close()
        await state.batches.close()
        if state.generation.tracing is not None:
            await asyncio.to_thread(state.generation.tracing.shutdown)
    finally:
        await engine.shutdown()
