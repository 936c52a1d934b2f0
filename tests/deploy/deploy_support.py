"""Helpers shared by the deploy/ tests: ferry processes and nginx on loopback, and readers of rendered
Kubernetes objects. A module of its own (not conftest.py) so test modules import it by a name that
no other test directory uses."""

from __future__ import annotations

import math
import os
import pwd
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ferry.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
MODEL = "tiny"  # the served model name of the replicas the tests start
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip(
            "kubectl is not installed: cannot render the kustomize overlays (install kubectl to run this)"
        )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FerryProcess:
    """One `ferry <command>` subprocess on a free loopback port, healthy once /health answers 200."""

    def __init__(
        self,
        command: str,
        args: list[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        self.port = free_port()
        self.command = command
        self.args = args
        self.extra_env = env or {}
        self.prefix = prefix or []  # e.g. an `unshare …` wrapper
        self.log_path = log_dir / f"ferry-{command}-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> FerryProcess:
        cmd = [
            *self.prefix,
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


GPU_OVERLAYS = {"disaggregated-gpu", "production"}
SAMPLE_SECRETS = {
    ("ferry-kv-tier", "url"): "rediss://default:s3cret@redis.example.com:6380/0",
    ("ferry-api-key", "key"): "sample-api-key",
}
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")


def of_kind(docs: list[dict], *kinds: str) -> list[dict]:
    return [d for d in docs if d["kind"] in kinds]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def is_ferry_image(image: str) -> bool:
    return image.split("@")[0].rsplit(":", 1)[0].rsplit("/", 1)[-1] == "ferry"


def ferry_containers(workload: dict) -> list[dict]:
    return [c for c in pod_spec(workload)["containers"] if is_ferry_image(c["image"]) and c.get("args")]


def env_of(container: dict, docs: list[dict], namespace: str, pod_ip: str = "10.244.0.7") -> dict[str, str]:
    """The container's environment as the kubelet would build it (Secrets: the sample values)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        src = item["valueFrom"]
        if "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            data = one(docs, "ConfigMap", ref["name"])["data"]
            if ref.get("optional") and ref["key"] not in data:
                continue  # the kubelet leaves the variable unset
            env[item["name"]] = data[ref["key"]]
        elif "secretKeyRef" in src:
            ref = src["secretKeyRef"]
            env[item["name"]] = SAMPLE_SECRETS[(ref["name"], ref["key"])]
        elif src.get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[item["name"]] = namespace
        elif src.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[item["name"]] = pod_ip
        elif "resourceFieldRef" in src:
            ref = src["resourceFieldRef"]
            assert ref["containerName"] == container["name"] and ref["divisor"] == "1", ref
            kind, resource = ref["resource"].split(".")
            env[item["name"]] = str(math.ceil(cpu_cores(container["resources"][kind][resource])))
        else:
            raise AssertionError(f"unexpected env source {src}")
    return env


def cpu_cores(quantity: str) -> float:
    """A Kubernetes CPU quantity ("2", "500m") in cores."""
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of container args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def parsed_args(workload: dict, docs: list[dict], pod_ip: str = "10.244.0.7"):  # noqa: ANN201 - Namespace
    (container,) = ferry_containers(workload)
    env = env_of(container, docs, workload["metadata"]["namespace"], pod_ip)
    return build_parser().parse_args(expand(container["args"], env))


def container_ports(workload: dict) -> dict[str, int]:
    ports: dict[str, int] = {}
    for c in pod_spec(workload)["containers"]:
        for p in c.get("ports", []):
            ports[p.get("name", str(p["containerPort"]))] = p["containerPort"]
    return ports


def resolve_port(port: int | str, ports: dict[str, int]) -> int | None:
    if isinstance(port, int):
        return port if port in ports.values() else None
    return ports.get(port)


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector syntax: k=v, k==v, k!=v, k in (a,b), k notin (a,b), k, !k."""
    terms = re.findall(r"[^,(]+(?:\([^)]*\))?", selector)
    for term in (t.strip() for t in terms if t.strip()):
        if m := re.fullmatch(r"(\S+)\s+(in|notin)\s+\(([^)]*)\)", term):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            ok = (labels.get(key) in values) if op == "in" else (labels.get(key) not in values)
        elif "!=" in term:
            key, value = term.split("!=", 1)
            ok = labels.get(key) != value
        elif "=" in term:
            key, value = re.split(r"==?", term, maxsplit=1)
            ok = labels.get(key) == value
        elif term.startswith("!"):
            ok = term[1:] not in labels
        else:
            ok = term in labels
        if not ok:
            return False
    return True


def matches(match_labels: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match_labels.items())


def to_bytes(size: str) -> int:
    """Kubernetes quantities (4Gi, 512Mi) and Redis sizes (768mb, 24gb) as bytes."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|kb|mb|gb)?", size)
    assert m, size
    unit = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}
    return int(m.group(1)) * unit[m.group(2)]


def replica_pools(docs: list[dict]) -> list[dict]:
    return [
        d
        for d in of_kind(docs, "Deployment")
        if pod_labels(d).get("app.kubernetes.io/component") == "replica"
    ]
