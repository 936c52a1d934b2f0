"""The engine loop thread of ``AsyncEngine`` (engine/async_engine.py): the commands callers queue
for it (``_submit``), and the loop that applies them between steps, gathers a burst of arrivals,
runs a step and hands its outputs over. Only this thread touches the ``LLMEngine``; a crash here
fails every in-flight request and queued command with ``EngineDeadError``, never leaving a caller
waiting. A mixin: ``AsyncEngine.__init__`` sets the state it reads (``_commands``, ``_wake``,
``_stopping``, ``_error``, ``_stats``, ``_step_since``, ``_held``, ``_barriers`` …).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING

from engine.async_sleep import Lifecycle, aborted_output
from engine.async_streams import _Abort, _Add, _Command, _ResetPrefixCache
from engine.errors import EngineDeadError

if TYPE_CHECKING:
    import threading
    from collections import deque

    from engine.llm_engine import LLMEngine

logger = logging.getLogger("engine.async_engine")


class EngineLoop:
    """The loop thread's half of ``AsyncEngine``."""

    engine: LLMEngine
    _commands: deque[_Command]
    _wake: threading.Condition
    _stopping: bool
    _error: BaseException | None

    def _submit(self, cmd: _Command) -> None:
        """Queue a command for the loop thread; EngineDeadError if the loop died or is stopping.

        Checked under ``_wake``, which the loop takes to record its death (and ``shutdown`` to
        stop it): a command is either queued before, and then failed with the rest, or refused
        here. A caller's own earlier check may be stale: a request is built, a checkpoint read,
        between it and this."""
        with self._wake:
            self._check_alive()
            self._commands.append(cmd)
            if isinstance(cmd, _Add):
                self._num_adds += 1
                if self._gathering:
                    # Waking the gathering thread for it would cost a GIL hand-off per request of
                    # a burst (the submitter's loop waits for the GIL back), and it waits for
                    # probes and announced requests, not adds.
                    return
            self._notify()

    def _notify(self) -> None:
        """Wake the loop thread, also out of a step that waits on the KV tier. ``_wake`` held."""
        self._wake.notify()
        if not self.engine.step_interrupt.done():
            self.engine.step_interrupt.set_result(None)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop died: {self._error!r}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._wake:
                    while not self._commands and not self._stopping and not self._has_work():
                        # Until a command, or the KV connector's next due check (None: none).
                        self._wake.wait(engine.idle_wake_in)
                    if self._stopping:
                        return
                    if (
                        self.arrival_wait_s > 0
                        and self._commands
                        and not engine.has_unfinished_requests()
                        and isinstance(self._commands[0], _Add)
                    ):
                        gather_start = time.monotonic()
                        self._gather_loop = self._commands[0].loop
                        self._gather_burst(self._gather_loop)
                        if logger.isEnabledFor(logging.DEBUG):
                            logger.debug(
                                "burst: %d request(s) gathered in %.1f ms",
                                sum(isinstance(c, _Add) for c in self._commands),
                                1e3 * (time.monotonic() - gather_start),
                            )
                        if self._stopping:
                            return
                    commands = list(self._commands)
                    self._commands.clear()
                    if self.engine.step_interrupt.done():
                        self.engine.step_interrupt = concurrent.futures.Future()
                for cmd in commands:
                    self._apply(cmd)
                if self._barriers and self._barrier_ready():
                    commands += self._run_barriers()
                if commands:
                    self._stats = self._engine_stats()
                    # Resolve aborts only now, so a caller awaiting abort() sees the freed blocks.
                    for cmd in commands:
                        if isinstance(cmd, _Abort) and not cmd.done.done():
                            cmd.done.set_result(None)
                        elif isinstance(cmd, _ResetPrefixCache):
                            cmd.done.set_result(cmd.result)
                        elif isinstance(cmd, Lifecycle) and cmd.outcome is not None:
                            self._resolve_lifecycle(cmd)
                if self._can_step():
                    self._step_since = time.monotonic()
                    try:
                        outputs = engine.step()
                    finally:
                        self._step_since = None
                    # Publish stats first: a caller that sees its final output sees them updated.
                    self._stats = self._engine_stats()
                    self._deliver(outputs)
                elif engine.has_idle_work:
                    engine.idle_step()
        except BaseException as exc:  # noqa: BLE001 - any crash must fail requests, not hang them
            logger.exception("engine loop crashed")
            with self._wake:  # after this, ``_submit`` queues nothing more (see there)
                self._error = exc
            self._fail_all(EngineDeadError(f"the engine loop died: {exc!r}"))
            self._fail_commands(EngineDeadError(f"the engine loop died: {exc!r}"))

    def _apply(self, cmd: _Command) -> None:
        engine = self.engine
        if isinstance(cmd, _Add):
            if self._streams.get(cmd.request.request_id) is cmd.stream:
                if self._holding():
                    self._held[cmd.request.request_id] = cmd
                else:
                    engine.add_request(cmd.request)
            return
        if isinstance(cmd, _ResetPrefixCache):
            if cmd.reset_running:
                engine.scheduler.preempt_all()  # their blocks freed: none is in use after this
            busy = engine.has_unfinished_requests() and not cmd.reset_running
            cmd.result = False if busy else engine.block_manager.reset_prefix_cache()
            return
        if isinstance(cmd, Lifecycle):
            self._apply_lifecycle(cmd)
            return
        held = self._held.pop(cmd.request_id, None)
        if held is not None:
            self._deliver([aborted_output(engine, held.request)])
            return
        out = engine.abort_request(cmd.request_id)
        if out is not None:
            self._deliver([out])
