"""The replica pods run `ferry serve` with `readOnlyRootFilesystem: true` and one writable emptyDir
at /tmp, relying on the environment the manifest sets (HOME, FERRY_CACHE_DIR, TRITON_CACHE_DIR …)
to keep every write there. This runs the real server that way: in a private mount namespace
(`unshare --mount --map-root-user`) the root filesystem is remounted read-only and a tmpfs stands in
for the emptyDir (at /mnt, since /tmp itself is read-only then); the environment is the rendered
manifest's, with /tmp moved to /mnt. A write anywhere else fails with EROFS.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from deploy_support import MODEL, FerryProcess, env_of, ferry_containers, one

WRITABLE = "/mnt"


@pytest.fixture
def read_only_root() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("util-linux `unshare` is not installed: cannot give the server a read-only root")
    prefix = [
        unshare, "--mount", "--map-root-user", "sh", "-c",
        f'mount -o remount,bind,ro / && mount -t tmpfs -o size=512m tmpfs {WRITABLE} && exec "$0" "$@"',
    ]  # fmt: skip
    probe = subprocess.run([*prefix, "sh", "-c", f"! touch /ro-probe 2>/dev/null && touch {WRITABLE}/w"],
                           capture_output=True, text=True, timeout=30)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"mount namespaces are not allowed here (unshare said: {probe.stderr.strip()[:200]})")
    return prefix


def test_replica_serves_with_a_read_only_root(
    read_only_root: list[str],
    rendered: dict[str, list[dict]],
    tiny_llama: Path,
    redis_server,
    deploy_logs: Path,  # noqa: ANN001
) -> None:
    docs = rendered["disaggregated"]
    (container,) = ferry_containers(one(docs, "Deployment", "ferry-decode"))
    manifest_env = env_of(container, docs, "ferry")
    env = {
        k: v.replace("/tmp", WRITABLE)
        for k, v in manifest_env.items()
        if k not in ("MODEL_PATH", "FERRY_KV_TIER")
    }
    env["TMPDIR"] = WRITABLE  # what /tmp being the emptyDir gives the pod for free
    assert env["HOME"] == WRITABLE and env["FERRY_CACHE_DIR"].startswith(WRITABLE)
    args = ["--model", str(tiny_llama), "--served-model-name", MODEL, "--num-threads", "1", "--num-kv-blocks", "64",
            "--kv-tier", redis_server.url]  # fmt: skip
    replica = FerryProcess("serve", args, deploy_logs, env=env, prefix=read_only_root).start()
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        resp = httpx.post(replica.url + "/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert httpx.get(replica.url + "/metrics", timeout=10).status_code == 200
    finally:
        replica.stop()
    assert "Read-only file system" not in replica.log()
