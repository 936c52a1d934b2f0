"""`ferry run-batch -i INPUT -o OUTPUT [serve flags]`: a JSONL file of OpenAI requests, offline.

As vLLM's ``vllm run-batch``: INPUT and OUTPUT are local paths or http(s) URLs (the input is
fetched with GET, the output sent with PUT, as to a pre-signed object-store URL). One engine is
built from the same flags `ferry serve` takes, the replica's app over it, and every line is sent
through that app in this process (``server/batch_lines.py``), at most ``--max-batch-concurrency``
at once (default ``--max-num-seqs``). Output lines come in input order; a bad line gets an error
line and the rest still run. Nothing listens on a port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

logger = logging.getLogger("ferry.batch")


def add_run_batch_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from server.args import add_serve_args

    p.add_argument(
        "-i", "--input-file", required=True, help="JSONL of batch requests: a local path or an http(s) URL"
    )
    p.add_argument(
        "-o",
        "--output-file",
        required=True,
        help="where the results go: a local path, or an http(s) URL they are PUT to",
    )
    return add_serve_args(p)


def _is_url(where: str) -> bool:
    return where.startswith(("http://", "https://"))


def read_input(where: str) -> str:
    if _is_url(where):
        import httpx

        response = httpx.get(where, timeout=60.0, follow_redirects=True)
        response.raise_for_status()
        return response.text
    return Path(where).read_text(encoding="utf-8")


def write_output(where: str, text: str) -> None:
    if _is_url(where):
        import httpx

        response = httpx.put(where, content=text.encode(), timeout=60.0)
        response.raise_for_status()
        return
    Path(where).write_text(text, encoding="utf-8")


def unwritable(where: str) -> str | None:
    """Why a local output file could not be written (its directory missing or read-only, or it is
    a directory), or None; a URL is tried only when the results are there."""
    if _is_url(where):
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


def run_batch(args: argparse.Namespace) -> int:
    import httpx

    from server.batch_lines import input_lines
    from server.main import loop_factory, serve_configs

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
        lines = input_lines(read_input(args.input_file))
    except (OSError, UnicodeDecodeError, httpx.HTTPError) as e:
        return _error(f"cannot read {args.input_file}: {e}")
    problem = unwritable(args.output_file)
    if problem is not None:  # found now, not after every request has run
        return _error(f"cannot write {args.output_file}: {problem}")
    concurrency = args.max_batch_concurrency or engine_config.max_num_seqs
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            results = runner.run(_run(engine_config, config, lines, concurrency))
    except (ValueError, OSError) as e:  # the model directory, flags the model cannot meet
        return _error(e)
    answered = [line for line in results if line is not None]
    if len(answered) < len(results):
        print(
            f"ferry run-batch: interrupted: {len(answered)} of {len(results)} requests answered, "
            f"those written to {args.output_file}",
            file=sys.stderr,
        )
    text = "".join(json.dumps(line) + "\n" for line in answered)
    try:
        write_output(args.output_file, text)
    except (OSError, httpx.HTTPError) as e:
        return _error(f"cannot write {args.output_file}: {e}")
    failed = sum(1 for line in answered if line["error"] is not None)
    logger.info("wrote %d results to %s (%d failed)", len(answered), args.output_file, failed)
    return 0 if len(answered) == len(results) else 130


async def _run(engine_config: object, config: object, lines: list[str], concurrency: int) -> list:
    from engine import AsyncEngine
    from server.app import build_app
    from server.batch_lines import AppCaller, Progress, run_lines
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
            results = await run_lines(
                AppCaller(app, config.api_key), lines, concurrency, progress=progress, gone=gone
            )
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        state = app.state.ferry
        await state.background.close()
        if state.responses is not None:
            await state.responses.close()
        await state.batches.close()
        return results
    finally:
        await engine.shutdown()
