"""Static guarantees of kvcache/: no unsafe deserialization, and torch only where allowed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

KVCACHE = Path(__file__).resolve().parents[2] / "kvcache"
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
UNSAFE_CALLS = {"eval", "exec", "compile", "__import__"}
UNSAFE_ATTRS = {("torch", "load"), ("np", "load"), ("numpy", "load"), ("pickle", "loads"), ("pickle", "load")}


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in UNSAFE_MODULES:
            out.append(f"from {node.module} import")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in UNSAFE_CALLS:
                out.append(f"{f.id}()")
            if (
                isinstance(f, ast.Attribute)
                and isinstance(f.value, ast.Name)
                and (f.value.id, f.attr) in UNSAFE_ATTRS
            ):
                out.append(f"{f.value.id}.{f.attr}()")
    return [f"{path.name}:{v}" for v in out]


def test_no_pickle_eval_exec_or_torch_load_in_kvcache() -> None:
    files = sorted(KVCACHE.glob("*.py"))
    assert len(files) >= 10
    assert [v for f in files for v in _violations(f)] == []


def test_the_checker_catches_violations(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nfrom marshal import loads\nimport torch\neval('1')\ntorch.load('x')\n")
    assert _violations(bad) == [
        "bad.py:import pickle",
        "bad.py:from marshal import",
        "bad.py:eval()",
        "bad.py:torch.load()",
    ]


def test_tiers_events_and_breaker_are_torch_free() -> None:
    code = (
        "import sys, kvcache, kvcache.keys, kvcache.tier, kvcache.metrics, kvcache.breaker, kvcache.events,"
        " kvcache.memory_tier, kvcache.redis_tier, kvcache.composite_tier\n"
        "from kvcache.tier import open_tier\n"
        "t = open_tier('memory://'); t.put_many([('k', b'v')]); assert t.get_many(['k']) == [b'v']\n"
        "open_tier('redis://127.0.0.1:1/0?l1_bytes=10').close()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=KVCACHE.parent)
