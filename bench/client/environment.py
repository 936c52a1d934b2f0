"""Where the numbers came from: software versions, git revision, hardware, model identity, flags.

Collected without importing torch (its version comes from package metadata) and without failing:
anything that cannot be read is recorded as null.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

# Files above this size are fingerprinted by size plus their first and last MiB, so hashing a
# multi-GB checkpoint does not dominate a short benchmark; the method is recorded with the hash.
_FULL_HASH_LIMIT = 256 * 1024 * 1024
_EDGE = 1024 * 1024


def _run(cmd: list[str], cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_revision() -> dict[str, Any]:
    root = str(Path(__file__).resolve().parents[2])
    rev = _run(["git", "rev-parse", "HEAD"], cwd=root)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root) if rev else None
    return {"revision": rev, "dirty": bool(status) if rev else None}


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        return _run(["sysctl", "-n", "machdep.cpu.brand_string"])
    return platform.processor() or None


def gpu_models() -> list[str]:
    if shutil.which("nvidia-smi"):
        out = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
        if out:
            return [line.strip() for line in out.splitlines() if line.strip()]
    if shutil.which("rocm-smi"):
        out = _run(["rocm-smi", "--showproductname"])
        if out:
            return [line.strip() for line in out.splitlines() if "Card series" in line]
    return []


def model_dir_hash(directory: str | os.PathLike) -> dict[str, Any] | None:
    """sha256 over (relative path, size, content digest) of every file, in path order."""
    root = Path(directory)
    if not root.is_dir():
        return None
    total = hashlib.sha256()
    partial = False
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        size = path.stat().st_size
        h = hashlib.sha256()
        with path.open("rb") as f:
            if size <= _FULL_HASH_LIMIT:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            else:
                partial = True
                h.update(f.read(_EDGE))
                f.seek(size - _EDGE)
                h.update(f.read(_EDGE))
        total.update(f"{path.relative_to(root).as_posix()}\0{size}\0{h.hexdigest()}\n".encode())
    return {
        "path": str(root.resolve()),
        "sha256": total.hexdigest(),
        "method": "sha256-edges-for-large-files" if partial else "sha256-full",
    }


_REDACTED = "<redacted>"
_SECRET_HEADERS = ("authorization", "api-key", "x-api-key", "cookie")


def _redact_header(header: str) -> str:
    name = header.partition(":")[0]
    return f"{name}: {_REDACTED}" if name.strip().lower() in _SECRET_HEADERS else header


def redact_flags(flags: dict[str, Any]) -> dict[str, Any]:
    """The flags with secrets (API key, auth-like headers) replaced, so results can be shared."""
    out = dict(flags)
    if out.get("api_key"):
        out["api_key"] = _REDACTED
    if out.get("header"):
        out["header"] = [_redact_header(h) for h in out["header"]]
    return out


def _secret_flag(arg: str) -> str | None:
    """``--api-key`` or ``--header`` when ``arg`` (before any ``=``) names it, abbreviated as
    argparse accepts (``--api``, ``--hea``): the value is as secret however the flag is spelled."""
    name = arg.partition("=")[0]
    if len(name) < 3 or not name.startswith("--"):
        return None
    return next((flag for flag in ("--api-key", "--header") if flag.startswith(name)), None)


def redact_argv(argv: list[str]) -> list[str]:
    out: list[str] = []
    pending: str | None = None  # a flag whose value is the next argument
    for arg in argv:
        flag = _secret_flag(arg) if pending is None else None
        if pending == "--api-key":
            out.append(_REDACTED)
        elif pending == "--header":
            out.append(_redact_header(arg))
        elif flag is not None and "=" in arg:
            name, _, value = arg.partition("=")
            out.append(f"{name}={_REDACTED if flag == '--api-key' else _redact_header(value)}")
        else:
            out.append(arg)
        pending = flag if flag is not None and "=" not in arg else None
    return out


def collect_environment(flags: dict[str, Any], model_paths: list[str | None]) -> dict[str, Any]:
    """Everything above plus the flags and command line, with secrets redacted."""
    from ferry import __version__

    model = None
    for candidate in model_paths:
        if candidate and Path(candidate).is_dir():
            model = model_dir_hash(candidate)
            break
    return {
        "ferry_version": __version__,
        "git": git_revision(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "torch": _version("torch"),
        "httpx": _version("httpx"),
        "os": platform.platform(),
        "hostname": platform.node(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpus": gpu_models(),
        "model_dir": model,
        "argv": redact_argv(sys.argv),
        "flags": redact_flags(flags),
    }
