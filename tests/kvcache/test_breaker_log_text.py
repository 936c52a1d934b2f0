"""A full Redis refusing a tier write: the log line says why, never the block's raw bytes."""

from __future__ import annotations

import logging

import pytest
import redis

from kvcache.breaker import ERROR_TEXT_LIMIT, error_text
from kvcache.tier import open_tier

BLOCK = b"FKVB\x00\x00\x01\x07\x1b[31m" + bytes(range(256)) * 64  # a header, NULs, an escape, binary


def test_a_refused_write_logs_the_servers_answer_not_the_block(
    private_redis, caplog: pytest.LogCaptureFixture
) -> None:
    srv = private_redis()
    admin = redis.Redis(port=srv.port)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)  # already over it: every write is refused, reads go on
    tier = open_tier(srv.url)
    try:
        with caplog.at_level(logging.WARNING, logger="kvcache.breaker"):
            assert tier.put_many([("ferry:kv:fp:00ff", BLOCK), ("ferry:kv:fp:0100", BLOCK)]) == [False, False]
        assert tier.get_many(["ferry:kv:fp:00ff"]) == [None]  # the server still answers reads
    finally:
        tier.close()
    (line,) = [r.getMessage() for r in caplog.records if "refused by the server" in r.getMessage()]
    assert line == (
        "redis://127.0.0.1 put_many refused by the server (treated as a miss): OutOfMemoryError: "
        "command not allowed when used memory > 'maxmemory'."
    )


def test_error_text_escapes_and_cuts_what_it_keeps() -> None:
    assert error_text(ValueError("bad\x00\x1b[0m\n value")) == "ValueError: bad\\x00\\x1b[0m\\n value"
    long = error_text(RuntimeError("x" * 10_000))
    assert long == "RuntimeError: " + "x" * ERROR_TEXT_LIMIT + "..."
