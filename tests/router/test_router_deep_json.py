"""A body nested deeper than Python's json parser recurses (``[[[[…``) is a client's error: the
router answers 400 in OpenAI's shape, as a replica does, never a bare 500 from a RecursionError;
the admin API alike. The router's one replica is a closed port: these answers come before routing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_harness import Proc, free_port

KEY = "router-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
DEEP = 50_000


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    port = free_port()
    args = ["router", "--replica", f"http://127.0.0.1:{free_port()}", "--port", str(port), "--api-key", KEY]
    proc = Proc(args, port, tmp_path_factory.mktemp("deep") / "router.log").start()
    try:
        yield proc.wait_http(ok=(200, 503))
    finally:
        proc.stop()


def _nested(depth: int) -> bytes:
    return b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"


def test_a_deeply_nested_body_is_a_400(router: Proc) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", content=_nested(DEEP), headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "request body is not valid JSON: nested too deeply"
    assert r.json()["error"]["type"] == "BadRequestError"


def test_a_deeply_nested_admin_body_is_a_400(router: Proc) -> None:
    body = b"[" * 30_000 + b"]" * 30_000  # under the admin API's 64 KiB
    r = httpx.post(router.url + "/admin/replicas", content=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "request body is not valid JSON: nested too deeply"
    assert "Traceback" not in Path(router.log).read_text()
