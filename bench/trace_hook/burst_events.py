"""Timestamps of a burst's way through a replica's processes, for ``bench/burst_trace.py``.

``install(directory)`` wraps a few functions as their modules are imported (the channel's frames,
the engine's ``start``, its burst gathering and steps, the ASGI edge and the generation routes)
and records ``(time.monotonic_ns(), thread, event, detail)``; a daemon thread appends them to
``directory/trace-<pid>.jsonl`` every half second. CLOCK_MONOTONIC is one clock for every process
of the machine, so the files merge into one timeline. The wrappers cost a few microseconds per
event; they name private functions and follow them when those change.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import time
from typing import Any

EVENTS: list[tuple[int, int, str, tuple[Any, ...]]] = []
_now = time.monotonic_ns


def record(name: str, *detail: Any) -> None:
    EVENTS.append((_now(), threading.get_ident() & 0xFFFF, name, detail))


def _kinds(messages: list[tuple[Any, ...]]) -> tuple[dict[str, int], list[str]]:
    """How many messages of each kind, and the request ids of the adds and outputs."""
    kinds: dict[str, int] = {}
    ids = []
    for m in messages:
        kinds[m[0]] = kinds.get(m[0], 0) + 1
        if m[0] in ("add", "out"):
            ids.append(str(m[1]))
    return kinds, ids


def _patch_ipc(module: Any) -> None:
    channel = module.Channel
    flush, receive = channel._flush, channel.receive

    def traced_flush(self: Any) -> None:
        if not self._outbox:
            return flush(self)
        kinds, ids = _kinds(self._outbox)
        start = _now()
        flush(self)
        EVENTS.append((start, 0, "flush", (kinds, ids, _now() - start)))

    async def traced_receive(self: Any) -> Any:
        messages = await receive(self)
        if messages is not None:
            record("recv", *_kinds(messages))
        return messages

    channel._flush, channel.receive = traced_flush, traced_receive


def _patch_async_engine(module: Any) -> None:
    engine = module.AsyncEngine
    start, gather = engine.start, engine._gather_burst

    def traced_start(self: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        record("start", request_id)
        try:
            return start(self, request_id, *args, **kwargs)
        finally:
            record("started", request_id)

    def traced_gather(self: Any, loop: Any) -> Any:
        record("gather_in")
        try:
            return gather(self, loop)
        finally:
            record("gather_out", len(self._commands))

    engine.start, engine._gather_burst = traced_start, traced_gather


def _patch_async_streams(module: Any) -> None:
    hand_over = module._hand_over

    def traced_hand_over(items: list[Any]) -> None:
        record("handover", len(items))
        hand_over(items)

    module._hand_over = traced_hand_over


def _patch_llm_engine(module: Any) -> None:
    engine = module.LLMEngine
    step = engine.step

    def traced_step(self: Any) -> Any:
        record("step_in")
        outputs = step(self)
        record("step_out", len(outputs))
        return outputs

    engine.step = traced_step


def _request_id(scope: dict) -> str:
    return dict(scope["headers"]).get(b"x-request-id", b"").decode()


def _patch_middleware(module: Any) -> None:
    edge = module.EdgeMiddleware
    call = edge.__call__

    async def traced_call(self: Any, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            record("edge_in", _request_id(scope))
        await call(self, scope, receive, send)

    edge.__call__ = traced_call


def _patch_routes(module: Any) -> None:
    routes = module.GenerationRoutes
    call = routes.__call__

    async def traced_call(self: Any, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await call(self, scope, receive, send)
        rid = _request_id(scope)
        record("route_in", rid)

        async def traced_send(message: dict) -> None:
            if message.get("type") == "http.response.body" and message.get("body"):
                record("body_send", rid)
            await send(message)

        await call(self, scope, receive, traced_send)

    routes.__call__ = traced_call


PATCHES = {
    "server.engine_ipc": _patch_ipc,
    "engine.async_engine": _patch_async_engine,
    "engine.async_streams": _patch_async_streams,  # the output hand-over (``OutputDelivery``)
    "engine.llm_engine": _patch_llm_engine,
    "server.middleware": _patch_middleware,
    "server.generation_routes": _patch_routes,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, name: str) -> None:
        self.inner, self.name = inner, name

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        PATCHES[self.name](module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = _Loader(spec.loader, name)
        return spec


def install(directory: str) -> None:
    """Wrap the modules above (now, or when they are imported); write this process's events under
    ``directory``. Once per process."""
    sys.meta_path.insert(0, _Finder())
    for name, patch in PATCHES.items():  # imported already: wrapped now
        if name in sys.modules:
            patch(sys.modules[name])
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"trace-{os.getpid()}.jsonl")

    def write() -> None:
        with open(path, "a") as out:
            while True:
                time.sleep(0.5)
                count = len(EVENTS)
                batch = EVENTS[:count]
                del EVENTS[:count]
                for event in batch:
                    out.write(json.dumps([event[0], os.getpid(), event[1], event[2], event[3]]) + "\n")
                out.flush()

    threading.Thread(target=write, daemon=True, name="burst-events").start()
