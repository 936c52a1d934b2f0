"""A Redis URL's password never reaches a client or a log: the response store's failure (a 503 a
client reads) and the registration heartbeat's warnings name the URL with the password masked, as
`ferry up` masks it in its own logs. The Redis named here is a closed port, so both fail."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx

SECRET = "s3cret-pw"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_redis_passwords_are_masked(tiny_llama: Path, serve_logs: Path, server_process) -> None:  # noqa: ANN001
    port = _closed_port()
    store = f"redis://user:{SECRET}@127.0.0.1:{port}/0"
    register = f"redis://:{SECRET}@127.0.0.1:{port}/1"
    srv = server_process(tiny_llama, ["--responses-store", store, "--register", register], serve_logs).start()
    try:
        body = {"model": srv.model_name, "input": "hi", "max_output_tokens": 2, "background": True}
        r = httpx.post(srv.url + "/v1/responses", json=body, timeout=60)
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert f"the response store at redis://user:***@127.0.0.1:{port}/0 failed" in message, message
        assert SECRET not in r.text
        warned = f"replica heartbeat to redis://:***@127.0.0.1:{port}/1 failed"
        deadline = time.monotonic() + 60
        while warned not in srv.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    assert warned in log, log[-2000:]
    assert SECRET not in log
