"""Installed by ``bench/soak.py --objects`` (this folder first on PYTHONPATH) in every process the
soak starts. On SIGUSR2 it collects garbage and writes, to ``$FERRY_SOAK_DUMPS/<pid>.json``:

* ``objects``: live objects tracked by the GC, by type (what ``gc.freeze`` froze at startup is
  not in ``gc.get_objects()``, so this counts what came after);
* ``state``: the sizes of the containers that ferry's own objects hold (and their ``num_*`` /
  ``*inflight*`` / ``*held*`` integers), found by walking references from ferry's modules and the
  GC's objects, so the objects frozen at startup (the engine, admission state, stores) are seen too;
* ``tasks``: the asyncio tasks of the event loop running on the main thread, if any;
* ``mem``: with ``PYTHONTRACEMALLOC`` set, the allocation sites (file:line) of live memory.

It changes nothing else in the process and never raises (an exception in a signal handler would
surface in whatever code the process was running).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import os
import signal
import sys
import tracemalloc
import types
from typing import Any

_OURS = ("engine.", "server.", "router.", "kvcache.")
_COUNTERS = ("num_", "_num")
_CONTAINERS = (dict, list, set, frozenset, collections.deque)


def _attributes(o: object) -> dict[str, Any]:
    attrs = dict(getattr(o, "__dict__", None) or {})
    for slot in getattr(type(o), "__slots__", ()):
        if hasattr(o, slot):
            attrs[slot] = getattr(o, slot)
    return attrs


def _state() -> collections.Counter[str]:
    sizes: collections.Counter[str] = collections.Counter()
    seen: set[int] = set()
    # Roots: ferry's modules (what startup froze is reachable from them) and every object the GC
    # tracks (what the event loop's frames hold: the router's app, a replica's state).
    todo: list[object] = [m for n, m in list(sys.modules.items()) if n.startswith(_OURS)]
    todo += gc.get_objects()
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, types.ModuleType) and not o.__name__.startswith(_OURS):
            continue  # another library's module: not walked
        cls = type(o)
        module = getattr(cls, "__module__", None)
        if not isinstance(module, str) or isinstance(o, (str, bytes, int, float)):
            continue
        if module.startswith(("torch", "numpy")):
            continue  # tensors hold no request state worth walking
        if module.startswith(_OURS) and not isinstance(o, type):
            for name, value in _attributes(o).items():
                key = f"{module}.{cls.__qualname__}.{name}"
                if isinstance(value, _CONTAINERS):
                    sizes[key] += len(value)
                elif type(value) is int and (
                    name.startswith(_COUNTERS) or "inflight" in name or "held" in name
                ):
                    sizes[key] += value
        todo.extend(r for r in gc.get_referents(o) if id(r) not in seen)
    return sizes


def _dump_now(path: str) -> None:
    gc.collect()
    counts = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())
    loop = asyncio._get_running_loop()  # the handler runs on the main thread, inside its loop
    tasks = len(asyncio.all_tasks(loop)) if loop is not None else None
    mem = {}
    if tracemalloc.is_tracing():
        stats = tracemalloc.take_snapshot().statistics("lineno")[:2000]
        mem = {f"{s.traceback[0].filename}:{s.traceback[0].lineno}": [s.size, s.count] for s in stats}
    dump = {"tasks": tasks, "objects": counts, "state": _state(), "mem": mem, "argv": sys.argv[:3]}
    with open(path + ".tmp", "w") as f:
        json.dump(dump, f)
    os.replace(path + ".tmp", path)


def _dump(signum: int, frame: object) -> None:
    path = os.path.join(os.environ["FERRY_SOAK_DUMPS"], f"{os.getpid()}.json")
    try:
        _dump_now(path)
    except Exception as e:  # noqa: BLE001 - reported to the soak instead
        with open(path, "w") as f:
            json.dump({"error": repr(e)}, f)


if os.environ.get("FERRY_SOAK_DUMPS"):
    signal.signal(signal.SIGUSR2, _dump)
