"""The torch profiler around the engine loop (vLLM's ``POST /start_profile`` / ``/stop_profile``,
served when ``VLLM_TORCH_PROFILER_DIR`` names a directory; ``server/dev_routes.py``).

``AsyncEngine`` inherits ``EngineProfiling``: ``start_profile(directory)`` starts a
``torch.profiler`` on the engine loop's thread (the thread that runs the model: the profiler records
the thread it was started on), ``stop_profile()`` stops it there, which writes one Chrome trace,
``<host>_<pid>.engine.<timestamp>.pt.trace.json`` (torch's TensorBoard handler's name), into the
directory. Both run between steps, as commands on the loop's queue (engine/async_sleep.py resolves
them). Starting while it runs, or stopping while it does not, changes nothing (a warning).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class ProfileCommand:
    directory: str | None  # where the trace goes (start); None: stop
    done: concurrent.futures.Future
    outcome: tuple[bool, Any] | None = None


class EngineProfiling:
    """``AsyncEngine``'s profiler commands. Uses its ``_run_command`` and ``_check_alive``; the
    profiler itself (``_profiler``) is the loop thread's."""

    _profiler: Any = None

    async def start_profile(self, directory: str) -> None:
        self._check_alive()  # type: ignore[attr-defined]
        await self._run_command(ProfileCommand(directory, concurrent.futures.Future()))  # type: ignore[attr-defined]

    async def stop_profile(self) -> None:
        self._check_alive()  # type: ignore[attr-defined]
        await self._run_command(ProfileCommand(None, concurrent.futures.Future()))  # type: ignore[attr-defined]

    # -- on the loop thread ------------------------------------------------------------------------

    def _apply_profile(self, cmd: ProfileCommand) -> None:
        try:
            if cmd.directory is not None:
                self._start_profiler(cmd.directory)
            else:
                self._stop_profiler()
            cmd.outcome = (True, None)
        except Exception as exc:  # noqa: BLE001 - the caller's answer (a 500), not the loop's end
            logger.exception("the profiler failed")
            cmd.outcome = (False, exc)

    def _start_profiler(self, directory: str) -> None:
        if self._profiler is not None:
            logger.warning("the profiler is already running")
            return
        import torch  # the engine's own dependency, imported only when profiling

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        worker = f"{socket.gethostname()}_{os.getpid()}.engine"
        profiler = torch.profiler.profile(
            activities=activities,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(directory, worker_name=worker),
        )
        profiler.start()
        self._profiler = profiler
        logger.info("profiler started: traces go to %s", directory)

    def _stop_profiler(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            logger.warning("the profiler is not running")
            return
        profiler.stop()  # writes the trace (on_trace_ready)
        logger.info("profiler stopped")
