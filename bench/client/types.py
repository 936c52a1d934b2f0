"""Typed hand-offs of the bench client: a planned request, a chain of them, a measured record."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# The key under which a saved request line carries bench metadata (session, turn). It is stripped
# before the body is sent, so a requests.jsonl line is otherwise a plain OpenAI request body.
META_KEY = "ferry_bench"

ENDPOINT_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "embeddings": "/v1/embeddings",
}


class ErrorKind:
    """How a request failed. HTTP errors are ``http_<status>``."""

    TIMEOUT = "timeout"
    CONNECT = "connect_error"  # connection refused / unreachable: the server is gone
    BROKEN_STREAM = "broken_stream"  # the stream stopped before its end ([DONE] / finish_reason)
    STREAM_ERROR = "stream_error"  # the server sent an error object inside the stream
    BAD_RESPONSE = "bad_response"  # unparseable chunk or body
    ABORTED = "aborted"  # the answer ended with finish_reason "abort": the server gave up on it
    NOT_SENT = "not_sent"  # never sent: the run ended early because the server was lost

    @staticmethod
    def http(status: int) -> str:
        return f"http_{status}"


@dataclass(frozen=True)
class BenchRequest:
    """One request as planned. ``body`` is the exact OpenAI body (stream options included);
    for a turn of a conversation it holds only that turn's new messages, and the client
    prepends the conversation so far (earlier turns and the server's answers) when sending."""

    endpoint: str  # "chat" | "completions" | "responses" | "embeddings"
    body: dict[str, Any]
    session_id: str | None = None
    turn: int = 0
    input_len: int | None = None  # planned prompt tokens (new tokens of this turn), if known
    output_len: int | None = None  # planned completion tokens, if known

    def to_line(self) -> dict[str, Any]:
        """The requests.jsonl line: the body plus bench metadata (omitted when empty)."""
        meta: dict[str, Any] = {}
        if self.endpoint == "embeddings":  # its body ({"input": ...}) alone reads as a Responses one
            meta["endpoint"] = self.endpoint
        if self.session_id is not None:
            meta["session_id"] = self.session_id
            meta["turn"] = self.turn
        if self.input_len is not None:
            meta["input_len"] = self.input_len
        if self.output_len is not None:
            meta["output_len"] = self.output_len
        line = dict(self.body)
        if meta:
            line[META_KEY] = meta
        return line


# A chain runs its requests one after another (a conversation); a single request is a chain of one.
Chain = list[BenchRequest]


@dataclass
class RequestRecord:
    """What happened to one request. Times in seconds; ``send_time_s`` is relative to the start
    of its run's measured phase (negative for warm-up requests)."""

    run: int
    concurrency: int | None
    request_rate: float | None
    repeat: int
    chain: int
    index: int  # position in the request set (requests.jsonl line number, 0-based)
    warmup: bool
    session_id: str | None
    turn: int
    input_len: int | None
    output_len: int | None
    send_time_s: float = 0.0
    ok: bool = False
    error_kind: str | None = None
    error: str | None = None
    http_status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if the server says
    stream_chunks: int = 0  # token chunks: carried output, or ended the choice (request.py)
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per token chunk (continuous usage only)
    usage_missing: bool = False
    token_count_mismatch: bool = False  # usage's completion_tokens != stream_chunks
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (n - 1)."""
        n = self.completion_tokens
        if not self.ok or n is None or n < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (n - 1)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["tpot_s"] = self.tpot_s
        return out
