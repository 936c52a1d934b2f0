"""The container files, read as Docker would read them (no Docker engine runs here, and no hadolint:
these checks are what can be verified without building): multi-stage, non-root, `ferry` as the
entrypoint, the ports ferry listens on, torch pinned before anything can pull another one, and
every package the project installs copied into the build."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ferry.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = ["Dockerfile.cpu", "Dockerfile.cuda"]


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages) of a Dockerfile: continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path.name}: dangling line continuation"
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest.strip(), flags=re.IGNORECASE)
            assert m, f"{path.name}: bad FROM {rest!r}"
            base = re.sub(r"\$\{(\w+)\}", lambda g: args[g.group(1)], m.group(1))
            stages.append(Stage(base=base, name=m.group(2)))
        elif op == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
        else:
            assert stages, f"{path.name}: {op} before FROM"
            stages[-1].instructions.append((op, rest.strip()))
    return args, stages


def copied_sources(stage: Stage) -> set[str]:
    out = set()
    for arg in stage.all("COPY"):
        if arg.startswith("--from"):
            continue
        *sources, _dest = arg.split()
        out.update(s.rstrip("/") for s in sources)
    return out


def project_packages() -> set[str]:
    # pyproject's [tool.setuptools.packages.find] include list (tomllib is 3.11+; ferry runs on 3.10).
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[tool.setuptools.packages.find]", 1)[1]
    include = re.search(r"^include\s*=\s*\[(.*?)\]", section, flags=re.M | re.S).group(1)
    return {p.rstrip("*") for p in re.findall(r'"([^"]+)"', include)}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_multi_stage_non_root_ferry_entrypoint(name: str) -> None:
    _, stages = parse_dockerfile(DOCKER / name)
    assert len(stages) >= 2 and stages[0].name == "build"
    for stage in stages:
        assert ":" in stage.base and not stage.base.endswith(":latest"), f"unpinned base {stage.base}"
    final = stages[-1]
    assert any(a.startswith("--from=build /opt/ferry") for a in final.all("COPY"))
    (user,) = final.all("USER")
    assert user == "10001:10001"
    assert "--uid 10001" in " ".join(final.all("RUN"))
    (entrypoint,) = final.all("ENTRYPOINT")
    assert json.loads(entrypoint) == ["ferry"]
    (cmd,) = final.all("CMD")
    args = build_parser().parse_args(json.loads(cmd))
    assert args.command == "serve" and args.host == "0.0.0.0"
    # The image exposes exactly the ports ferry listens on by default.
    exposed = {int(p) for e in final.all("EXPOSE") for p in e.split()}
    assert exposed == {build_parser().parse_args(["serve"]).port, build_parser().parse_args(["router"]).port}
    assert "HF_HUB_OFFLINE=1" in " ".join(final.all("ENV"))  # weights are mounted, never downloaded


@pytest.mark.parametrize("name", DOCKERFILES)
def test_torch_pinned_first_and_every_package_copied(name: str) -> None:
    _, stages = parse_dockerfile(DOCKER / name)
    runs = stages[0].all("RUN")
    torch_at = next(i for i, r in enumerate(runs) if "torch==2.13.0" in r)
    project_at = next(i for i, r in enumerate(runs) if re.search(r"pip install \"?\.\[", r))
    assert torch_at < project_at, "torch must be installed (pinned) before the project"
    assert "--index-url" in runs[torch_at]
    if name == "Dockerfile.cpu":
        assert "https://download.pytorch.org/whl/cpu torch==2.13.0" in runs[torch_at]
    # The router's Kubernetes discovery and --otlp-traces-endpoint (k8s/components/tracing) work.
    assert re.search(r'pip install "\.\[(triton,)?k8s,tracing\]"', runs[project_at])
    sources = copied_sources(stages[0])
    assert project_packages() <= sources, f"packages not copied: {project_packages() - sources}"
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such path in the repository"
    # The build context sends only what is copied (a .venv or .git must never be sent).
    ignore = (DOCKER / f"{name}.dockerignore").read_text().splitlines()
    assert ignore[ignore.index("**")] == "**"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert allowed == sources


def test_cuda_image_can_compile_triton_launchers() -> None:
    _, stages = parse_dockerfile(DOCKER / "Dockerfile.cuda")
    final = " ".join(stages[-1].all("RUN"))
    assert "gcc" in final and "python3-dev" in final
    assert '".[triton,k8s,tracing]"' in " ".join(stages[0].all("RUN"))
