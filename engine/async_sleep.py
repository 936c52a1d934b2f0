"""The async engine's sleep mode and weight updates (``AsyncEngine`` inherits ``SleepCommands``).

They are commands on the engine loop's queue, run between steps (engine/async_engine.py). ``sleep``
first settles requests in flight by ``mode``, vLLM's: ``abort`` ends them, ``keep`` preempts them
(they recompute after the wake), ``wait`` lets them run. A ``wait`` sleep and a weight update are
*barriers*: they run once no request is unfinished (or the engine sleeps), the loop stepping until
then. While a barrier waits or the engine sleeps, new requests are *held* outside the scheduler, in
arrival order, and added once the engine is awake and no barrier waits. A command's future resolves
after the stats it changed are published, so its caller sees them.

Commands take effect in the order they reach the loop, and a barrier's place is where it was sent,
not where it ran: a ``wake_up`` sent while a ``wait`` sleep still waits cancels that sleep (its
caller gets ``SleepCancelledError``, a 409 over HTTP) rather than being undone by it a step later.
A weight update still waiting is not a sleep, and runs.

The engine-side work is ``LLMEngine``'s (engine/sleep_mode.py, engine/weight_update.py); this
module only orders it against the requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import SleepCancelledError
from engine.outputs import RequestOutput
from engine.sequence import Request, RequestStatus
from engine.sleep_mode import DISCARDED, check_level, check_mode, check_tags
from engine.stats import EngineStats

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.weight_update import Checkpoint


Outcome = tuple[bool, Any]  # (ok, result or exception)
# A wake-up's outcome when the weights it restores were discarded after its caller looked and sent
# no checkpoint: the loop thread leaves the read (seconds, all of the model) to the caller.
READ_FIRST = object()


@dataclass
class SleepCommand:
    level: int
    mode: str  # abort | wait | keep (engine/sleep_mode.py)
    done: concurrent.futures.Future
    outcome: Outcome | None = None  # set when it ran; ``done`` resolved once stats are published


@dataclass
class WakeUpCommand:
    tags: tuple[str, ...]
    checkpoint: Checkpoint | None  # discarded weights, read off the loop thread
    done: concurrent.futures.Future
    outcome: Outcome | None = None
    # Sleeps that still waited for running requests when this arrived: cancelled, resolved with it.
    cancelled: list[SleepCommand] = dataclasses.field(default_factory=list)


@dataclass
class LoadWeightsCommand:
    checkpoint: Checkpoint
    abort_running: bool
    done: concurrent.futures.Future  # -> the number of requests aborted
    aborted: int = 0
    outcome: Outcome | None = None


Lifecycle = SleepCommand | WakeUpCommand | LoadWeightsCommand
# Commands that run only once no request is running (the loop keeps stepping until then, new
# requests held meanwhile): a sleep in ``wait`` mode, a weight update.
Barrier = SleepCommand | LoadWeightsCommand


class SleepCommands:
    """``AsyncEngine``'s sleep mode and weight updates. Uses its ``engine``, ``config``,
    ``model_info``, ``_held`` / ``_barriers`` (set in its ``__init__``), ``_commands``, ``_submit``,
    ``_deliver`` and ``_check_alive``."""

    engine: LLMEngine
    model_info: Any
    _held: dict[str, Any]  # request id -> its queued add command
    _barriers: list[Barrier]

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's sleep: free the KV cache (prefix cache emptied) and offload (1) or discard (2) the
        weights. Requests in flight are, by ``mode``: aborted (``abort``, vLLM's default: their
        streams end with finish reason "abort"), run to their end first (``wait``), or preempted
        and resumed after waking (``keep``). Requests arriving while asleep are held until the
        engine is awake. ValueError without ``enable_sleep_mode`` or for a bad level or mode;
        SleepCancelledError if a ``wake_up`` came while it waited for running requests (``wait``)."""
        self._check_alive()
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is not enabled (start the engine with --enable-sleep-mode)")
        await self._run_command(
            SleepCommand(check_level(level), check_mode(mode), concurrent.futures.Future())
        )

    async def wake_up(self, tags: list[str] | tuple[str, ...] | None = None) -> None:
        """Restore ``tags`` (``weights``, ``kv_cache``; None: both); once both are back, held
        requests run. Discarded weights are read from the checkpoint again, in a worker thread. A
        ``wait`` sleep still waiting for running requests is cancelled (the engine stays awake)."""
        self._check_alive()
        tags = check_tags(tags)
        checkpoint = None
        if "weights" in tags and self.engine.sleep_state.weights == DISCARDED:
            checkpoint = await asyncio.to_thread(self.engine.read_checkpoint)
        woke = await self._run_command(WakeUpCommand(tags, checkpoint, concurrent.futures.Future()))
        if woke is READ_FIRST:
            # A level-2 sleep queued before this (another caller's) discarded the weights after the
            # check above: read them here, not on the loop thread, and send the wake-up again.
            checkpoint = await asyncio.to_thread(self.engine.read_checkpoint)
            await self._run_command(WakeUpCommand(tags, checkpoint, concurrent.futures.Future()))

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    async def reload_weights(
        self, path: str | None = None, load_format: str | None = None, abort_running: bool = False
    ) -> int:
        """Serve the weights of checkpoint ``path`` (None: the current one, read again): read and
        checked in a worker thread (ValueError if they cannot replace the served ones, which keep
        serving), installed between steps once no request runs: new requests are held meanwhile,
        running ones finish first (or are aborted with ``abort_running``). The prefix cache is
        emptied and the model fingerprint changes. Returns the number of requests aborted."""
        self._check_alive()
        checkpoint = await asyncio.to_thread(self.engine.read_checkpoint, path, load_format)
        return await self._run_command(
            LoadWeightsCommand(checkpoint, abort_running, concurrent.futures.Future())
        )

    async def _run_command(self, cmd: SleepCommand | WakeUpCommand | LoadWeightsCommand) -> Any:
        self._submit(cmd)
        result = await asyncio.wrap_future(cmd.done)
        self.model_info = self.engine.model_info  # a weight update changes the fingerprint
        return result

    # -- on the loop thread ------------------------------------------------------------------------

    def _has_work(self) -> bool:
        """A step to run, barriers whose running requests have all ended, or the KV connector's own
        work (``LLMEngine.idle_step``)."""
        return self._can_step() or bool(self._barriers) and self._barrier_ready() or self.engine.has_idle_work

    def _can_step(self) -> bool:
        engine = self.engine
        return engine.has_unfinished_requests() and (not engine.is_sleeping or engine.has_held_outputs)

    def _holding(self) -> bool:
        """New requests wait outside the scheduler: the engine sleeps or drains for a barrier."""
        return bool(self._barriers) or self.engine.is_sleeping

    def _apply_lifecycle(self, cmd: SleepCommand | WakeUpCommand | LoadWeightsCommand) -> None:
        engine = self.engine
        if isinstance(cmd, WakeUpCommand):
            self._cancel_waiting_sleeps(cmd)
            if "weights" in cmd.tags and cmd.checkpoint is None and engine.sleep_state.weights == DISCARDED:
                cmd.outcome = (True, READ_FIRST)  # its caller reads the checkpoint off this thread
                return
            cmd.outcome = run_outcome(lambda: engine.wake_up(cmd.tags, cmd.checkpoint))
            self._release_held()
            return
        if (
            isinstance(cmd, SleepCommand)
            and cmd.mode == "abort"
            or isinstance(cmd, LoadWeightsCommand)
            and cmd.abort_running
        ):
            aborted = self._abort_in_flight()
            if isinstance(cmd, LoadWeightsCommand):
                cmd.aborted = aborted
        elif isinstance(cmd, SleepCommand) and cmd.mode == "keep":
            engine.scheduler.preempt_all()
        if isinstance(cmd, SleepCommand) and cmd.mode != "wait" or self._barrier_ready():
            self._run_barrier(cmd)
        else:
            self._barriers.append(cmd)

    def _cancel_waiting_sleeps(self, wake: WakeUpCommand) -> None:
        """A wake-up sent after a sleep that still waits for running requests wins: the sleep is
        dropped (its caller told so when the wake-up resolves), so the engine stays awake."""
        waiting = [b for b in self._barriers if isinstance(b, SleepCommand)]
        if not waiting:
            return
        self._barriers[:] = [b for b in self._barriers if not isinstance(b, SleepCommand)]
        for sleep in waiting:
            why = "the sleep was cancelled by a wake_up sent while it waited for running requests"
            sleep.outcome = (False, SleepCancelledError(why))
        wake.cancelled += waiting

    def _resolve_lifecycle(self, cmd: Lifecycle) -> None:
        """Resolve a command that ran (stats published), and the sleeps a wake-up cancelled."""
        if isinstance(cmd, WakeUpCommand):
            for sleep in cmd.cancelled:
                resolve(sleep.done, sleep.outcome)  # type: ignore[arg-type]
        resolve(cmd.done, cmd.outcome)  # type: ignore[arg-type]

    def _barrier_ready(self) -> bool:
        """Nothing runs: the engine is idle, or asleep (requests kept by a ``keep`` sleep wait for the wake)."""
        engine = self.engine
        return not engine.has_unfinished_requests() or engine.is_sleeping

    def _run_barriers(self) -> list[Lifecycle]:
        """Run the barriers that waited for running requests to end; then let held requests in."""
        ran: list[Lifecycle] = list(self._barriers)
        self._barriers.clear()
        for cmd in ran:
            self._run_barrier(cmd)  # type: ignore[arg-type]
        return ran

    def _run_barrier(self, cmd: Barrier) -> None:
        engine = self.engine
        if isinstance(cmd, SleepCommand):
            cmd.outcome = run_outcome(lambda: engine.sleep(cmd.level))
        else:
            cmd.outcome = run_outcome(lambda: (engine.load_checkpoint(cmd.checkpoint), cmd.aborted)[1])
        self._release_held()

    def _abort_in_flight(self) -> int:
        """Abort every request in the engine (not those held); their streams end with "abort"."""
        engine = self.engine
        outputs = [out for rid in list(engine.requests) if (out := engine.abort_request(rid)) is not None]
        engine.scheduler.drain_loads()  # parked requests' blocks are freed once their load is done
        self._deliver(outputs)
        return len(outputs)

    def _release_held(self) -> None:
        if self._holding() or not self._held:
            return
        held = list(self._held.values())
        self._held.clear()
        for cmd in held:
            self.engine.add_request(cmd.request)

    def _engine_stats(self) -> EngineStats:
        stats = self.engine.stats()
        state = self.engine.sleep_state
        return dataclasses.replace(
            stats,
            num_waiting=stats.num_waiting + len(self._held),
            sleep_level=state.level if state.is_sleeping else 0,
        )

    def _fail_commands(self, error: BaseException) -> None:
        """Commands that will never run (shutdown, a dead loop) fail instead of hanging their callers."""
        for cmd in [*self._barriers, *self._commands]:
            done = getattr(cmd, "done", None)
            if done is not None and not done.done():
                done.set_exception(error)
        self._barriers.clear()


def run_outcome(function: Callable[[], Any]) -> Outcome:
    """What ``function`` returned, or what it raised (ValueError: the caller's bad input; the engine
    loop goes on either way)."""
    try:
        return True, function()
    except Exception as exc:  # noqa: BLE001 - the caller's to handle, not the loop's
        return False, exc


def resolve(done: concurrent.futures.Future, outcome: Outcome) -> None:
    if not done.done():
        if outcome[0]:
            done.set_result(outcome[1])
        else:
            done.set_exception(outcome[1])


def aborted_output(engine: LLMEngine, request: Request) -> RequestOutput:
    """The final output of a held request aborted before it reached the scheduler."""
    request.status = RequestStatus.FINISHED
    request.finish_reason = "abort"
    return engine.post.delta(request, [], "", None)
