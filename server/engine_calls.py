"""The calls an API server makes to the engine process (``("call", call_id, name, arg)``, answered
by ``("reply", call_id, ok, value)``): ``abort``, ``compile``, ``reset_prefix_cache``, ``store`` (a
``MemoryRecords`` method of ``--responses-store memory``, kept here for every API server),
``sleep``, ``wake_up``, ``pause``, ``resume``, ``start_profile``, ``stop_profile``,
``reload_weights`` (its new ``model_info`` sent to every API server) and ``add_lora`` /
``remove_lora`` (answered once every API server has taken in the served adapters).

``EngineHost`` (``server/engine_host.py``) is built on it; split from there so that the requests'
path (add, relay, release) reads on its own. A failed call is answered with its kind (``value``: the
caller's mistake; ``dead``; ``sleep_cancelled``; ``other``), never raised into the connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.errors import EngineDeadError, SleepCancelledError
from server.responses_memory import MEMORY_OPS, MemoryRecords

if TYPE_CHECKING:
    from server.engine_host import _ApiServer

logger = logging.getLogger("ferry.engine_process")


class EngineCalls:
    """The API servers' calls ``EngineHost`` answers (the state it reads is ``EngineHost``'s, and
    the broadcasts are ``ApiServerFanout``'s)."""

    engine: Any
    responses: MemoryRecords | None
    _servers: set[_ApiServer]
    _send_stats: Callable[[_ApiServer], None]
    _broadcast_stats: Callable[[], None]
    _broadcast_loras: Callable[[], Any]

    async def _call(self, conn: _ApiServer, call_id: int, name: str, arg: Any) -> None:
        engine = self.engine
        try:
            if name == "abort":
                # The engine ends the stream with a final "abort" output, which its API server
                # still forwards (a timed-out request says so). One still compiling its
                # constraint is aborted once it started.
                compiling = conn.requests.get(arg)
                if compiling is not None:
                    await asyncio.wait({compiling})
                await engine.abort(f"{arg}@{conn.index}")
                value = None
            elif name == "compile":
                await engine.compile_structured(arg)
                value = None
            elif name == "reset_prefix_cache":
                value = await engine.reset_prefix_cache(bool(arg))
            elif name == "store":
                value = self._store(*arg)
            elif name == "sleep":
                value = await engine.sleep(*arg)
            elif name == "wake_up":
                value = await engine.wake_up(arg)
            elif name == "pause":
                value = await engine.pause_generation(*arg)
            elif name == "resume":
                value = await engine.resume_generation()
            elif name == "start_profile":
                value = await engine.start_profile(arg)
            elif name == "stop_profile":
                value = await engine.stop_profile()
            elif name == "reload_weights":
                value = await engine.reload_weights(*arg)
                for other in self._servers:
                    other.channel.send(("model_info", engine.model_info))
            elif name == "add_lora":
                value = await engine.add_lora(*arg)
                await self._broadcast_loras()
            elif name == "remove_lora":
                value = await engine.remove_lora(arg)
                await self._broadcast_loras()
            else:
                raise RuntimeError(f"unknown call {name!r}")
        except ValueError as e:
            conn.channel.send(("reply", call_id, False, ("value", str(e))))
        except EngineDeadError as e:
            conn.channel.send(("reply", call_id, False, ("dead", str(e))))
        except SleepCancelledError as e:  # a wake-up overtook it: the caller's answer, not a failure
            conn.channel.send(("reply", call_id, False, ("sleep_cancelled", str(e))))
        except Exception as e:  # noqa: BLE001
            logger.exception("call %s failed", name)
            conn.channel.send(("reply", call_id, False, ("other", repr(e))))
        else:
            self._send_stats(conn)
            conn.channel.send(("reply", call_id, True, value))
            self._broadcast_stats()

    def _store(self, op: str, *args: Any) -> Any:
        records = self.responses
        if records is None:
            raise RuntimeError("this engine process keeps no responses")
        if op not in MEMORY_OPS:
            raise RuntimeError(f"unknown store operation {op!r}")
        return getattr(records, op)(*args)
