"""``jsonl``: the user's own requests, one OpenAI request body per line (also how a saved
requests.jsonl is replayed exactly).

A line with ``messages`` goes to chat, one with ``prompt`` to completions. Streaming with usage is
forced (the bench measures from the stream); --max-tokens, --ignore-eos, --extra-body and an
explicit --model apply on top. A line may carry ``"ferry_bench": {"session_id": S, "turn": T}``
(stripped before sending): lines of one session form a conversation, sent in turn order, each
turn's messages appended to the conversation so far including the server's answers.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.client.datasets.common import DatasetContext, apply_request_options
from bench.client.types import ENDPOINT_PATHS, META_KEY, BenchRequest, Chain


class DatasetFileError(ValueError):
    pass


def _parse_line(path: Path, lineno: int, text: str, ctx: DatasetContext) -> BenchRequest:
    where = f"{path}:{lineno}"
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise DatasetFileError(f"{where}: not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise DatasetFileError(f"{where}: a line must be a JSON object (an OpenAI request body)")
    meta = body.pop(META_KEY, None) or {}
    if not isinstance(meta, dict):
        raise DatasetFileError(f"{where}: {META_KEY!r} must be an object")
    if meta.get("endpoint") in ENDPOINT_PATHS:  # written by this client when the body is ambiguous
        endpoint = meta["endpoint"]
    elif isinstance(body.get("messages"), list):
        endpoint = "chat"
    elif "prompt" in body:
        endpoint = "completions"
    elif isinstance(body.get("input"), (str, list)):
        endpoint = "responses"
    else:
        raise DatasetFileError(
            f"{where}: a body needs 'messages' (chat), 'prompt' (completions) or 'input' (responses)"
        )
    session = meta.get("session_id")
    if session is not None and endpoint == "completions":
        raise DatasetFileError(
            f"{where}: a session turn must be a chat ('messages') or responses ('input') body"
        )
    body = apply_request_options(ctx.cfg, body, ctx.model, endpoint)
    return BenchRequest(
        endpoint,
        body,
        session_id=None if session is None else str(session),
        turn=int(meta.get("turn", 0)),
        input_len=meta.get("input_len"),
        output_len=_output_len(ctx, meta, body),
    )


def _output_len(ctx: DatasetContext, meta: dict, body: dict) -> int | None:
    if "output_len" in meta and ctx.cfg.max_tokens is None:
        return meta["output_len"]
    value = body.get("max_tokens", body.get("max_completion_tokens"))
    return value if isinstance(value, int) else None


def build(ctx: DatasetContext, count: int | None) -> list[Chain]:
    path = Path(ctx.cfg.dataset_path or "")
    if not path.is_file():
        raise DatasetFileError(f"--dataset-path {path}: no such file")
    chains: list[Chain] = []
    by_session: dict[str, Chain] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            req = _parse_line(path, lineno, text, ctx)
            if req.session_id is None:
                chains.append([req])
            elif req.session_id in by_session:
                by_session[req.session_id].append(req)
            else:
                by_session[req.session_id] = [req]
                chains.append(by_session[req.session_id])
    for chain in by_session.values():
        chain.sort(key=lambda r: r.turn)
    if not chains:
        raise DatasetFileError(f"{path}: no requests")
    return chains if count is None else chains[:count]
