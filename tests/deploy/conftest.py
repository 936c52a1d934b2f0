"""Fixtures for the deploy/ tests: rendered Kubernetes overlays, ferry processes and nginx on loopback."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip(
            "kubectl is not installed: cannot render the kustomize overlays (install kubectl to run this)"
        )
    return path


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    """Every overlay rendered by `kubectl kustomize`, as lists of parsed objects."""
    binary = kubectl()
    out: dict[str, list[dict]] = {}
    for name in OVERLAYS:
        proc = subprocess.run(
            [binary, "kustomize", str(K8S / "overlays" / name)], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, f"overlay {name} does not render:\n{proc.stderr}"
        out[name] = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FerryProcess:
    """One `ferry <command>` subprocess on a free loopback port, healthy once /health answers 200."""

    def __init__(
        self, command: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.command = command
        self.args = args
        self.extra_env = env or {}
        self.log_path = log_dir / f"ferry-{command}-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> FerryProcess:
        cmd = [
            sys.executable,
            "-m",
            "ferry",
            self.command,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.args,
        ]
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            **self.extra_env,
        }
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ferry {self.command} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"ferry {self.command} did not become healthy:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.proc = None


def render_nginx_conf(workdir: Path, listen_port: int, router_ports: list[int]) -> Path:
    """deploy/nginx/ferry.conf.template rendered for loopback ports (as envsubst would: only the
    template's own variables are replaced), wrapped in a minimal main config whose every path is
    inside ``workdir``. Returns the main config's path."""
    servers = " ".join(f"server 127.0.0.1:{p} max_fails=2 fail_timeout=5s;" for p in router_ports)
    template = string.Template((ROOT / "deploy" / "nginx" / "ferry.conf.template").read_text())
    site = template.safe_substitute(FERRY_LISTEN=f"127.0.0.1:{listen_port}", FERRY_ROUTER_SERVERS=servers)
    (workdir / "ferry.conf").write_text(site)
    temp = {d: workdir / d for d in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")}
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name};" if os.geteuid() == 0 else ""
    main = f"""
{user}
worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log {workdir}/access.log;
    client_body_temp_path {temp["client_body"]};
    proxy_temp_path {temp["proxy"]};
    fastcgi_temp_path {temp["fastcgi"]};
    uwsgi_temp_path {temp["uwsgi"]};
    scgi_temp_path {temp["scgi"]};
    include {workdir}/ferry.conf;
}}
"""
    conf = workdir / "nginx.conf"
    conf.write_text(main)
    return conf


def nginx_binary() -> str:
    path = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)
    if path is None:
        pytest.skip(
            "nginx is not installed (Debian/Ubuntu: apt-get install nginx): cannot run the nginx checks"
        )
    return path


MODEL = "tiny"


@pytest.fixture(scope="session")
def deploy_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deploy-logs")


@pytest.fixture(scope="session")
def replica(tiny_llama: Path, redis_server, deploy_logs: Path) -> Iterator[FerryProcess]:  # noqa: ANN001
    """One `ferry serve` (tiny Llama, served as "tiny", KV tier in the private Redis) for the session."""
    redis_server.flush()
    args = ["--model", str(tiny_llama), "--served-model-name", MODEL, "--num-threads", "1", "--num-kv-blocks", "256",
            "--max-num-seqs", "8", "--kv-tier", redis_server.url, "--drain-timeout", "5"]  # fmt: skip
    proc = FerryProcess("serve", args, deploy_logs).start()
    yield proc
    proc.stop()
