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

Pausing generation (vLLM's ``pause_generation`` / ``resume_generation``, for RL weight syncs) holds
new requests like a sleep does, but keeps the weights and the KV cache: ``abort`` ends the requests
in flight, ``wait`` lets them finish (a barrier: the call returns once they did), ``keep`` freezes
them where they are (nothing steps; their KV is kept, and they go on after ``resume``). A sleep or
a weight update that runs while requests are frozen preempts them first (they recompute), so new
weights never meet old KV. As in vLLM, a sleeping engine counts as paused, a wake-up that leaves it
fully awake resumes it too, and a ``resume`` cancels a ``wait`` pause still waiting.

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
from engine.profiler import ProfileCommand
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


@dataclass
class PauseCommand:
    mode: str  # abort | wait | keep, as a sleep's
    clear_cache: bool  # empty the prefix cache once drained (not for ``keep``)
    done: concurrent.futures.Future
    outcome: Outcome | None = None


@dataclass
class ResumeCommand:
    done: concurrent.futures.Future
    outcome: Outcome | None = None
    # ``wait`` pauses that still waited for running requests when this arrived: cancelled.
    cancelled: list[PauseCommand] = dataclasses.field(default_factory=list)


Lifecycle = SleepCommand | WakeUpCommand | LoadWeightsCommand | PauseCommand | ResumeCommand | ProfileCommand
# Commands that run only once no request is running (the loop keeps stepping until then, new
# requests held meanwhile): a sleep or a pause in ``wait`` mode, a weight update.
Barrier = SleepCommand | LoadWeightsCommand | PauseCommand
# What a pause leaves (``_pause_state``; vLLM's PauseState): new requests held while running ones
# step, or nothing steps at all (``keep``).
PAUSED_NEW, PAUSED_ALL = "new", "all"


class SleepCommands:
    """``AsyncEngine``'s sleep mode and weight updates. Uses its ``engine``, ``config``,
    ``model_info``, ``_held`` / ``_barriers`` / ``_pause_state`` (set in its ``__init__``),
    ``_commands``, ``_submit``, ``_deliver`` and ``_check_alive``."""

    engine: LLMEngine
    model_info: Any
    _held: dict[str, Any]  # request id -> its queued add command
    _barriers: list[Barrier]
    _pause_state: str | None  # None, PAUSED_NEW or PAUSED_ALL; the loop thread's

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

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's pause (RL weight syncs): new requests are held until ``resume_generation`` (or a
        wake-up); requests in flight are aborted (``abort``), run to their end before this returns
        (``wait``), or frozen with their KV and resumed after (``keep``). ``clear_cache`` empties
        the prefix cache once they are settled (not for ``keep``). Needs no sleep mode. ValueError
        for a bad mode; SleepCancelledError if a ``resume`` came while it waited (``wait``)."""
        self._check_alive()
        await self._run_command(
            PauseCommand(check_mode(mode), bool(clear_cache), concurrent.futures.Future())
        )

    async def resume_generation(self) -> None:
        """End a pause: held requests go in (a sleeping engine keeps holding them until it wakes)."""
        self._check_alive()
        await self._run_command(ResumeCommand(concurrent.futures.Future()))

    def is_paused(self) -> bool:
        """Paused, or asleep (vLLM's: sleeping pauses the scheduler too)."""
        return self.stats().paused or self.is_sleeping()

    async def _run_command(self, cmd: Lifecycle) -> Any:
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
        if self._pause_state == PAUSED_ALL:  # frozen by a ``keep`` pause
            return False
        return engine.has_unfinished_requests() and (not engine.is_sleeping or engine.has_held_outputs)

    def _holding(self) -> bool:
        """New requests wait outside the scheduler: the engine sleeps, is paused or drains for a barrier."""
        return bool(self._barriers) or self.engine.is_sleeping or self._pause_state is not None

    def _apply_lifecycle(self, cmd: Lifecycle) -> None:
        engine = self.engine
        if isinstance(cmd, WakeUpCommand):
            self._cancel_waiting_sleeps(cmd)
            if "weights" in cmd.tags and cmd.checkpoint is None and engine.sleep_state.weights == DISCARDED:
                cmd.outcome = (True, READ_FIRST)  # its caller reads the checkpoint off this thread
                return
            cmd.outcome = run_outcome(lambda: engine.wake_up(cmd.tags, cmd.checkpoint))
            if cmd.outcome[0] and not engine.is_sleeping:  # vLLM's: a full wake-up resumes generation
                self._unpause(cmd.cancelled)
            self._release_held()
            return
        if isinstance(cmd, ResumeCommand):
            self._unpause(cmd.cancelled)
            cmd.outcome = (True, None)
            self._release_held()
            return
        if isinstance(cmd, PauseCommand):
            self._apply_pause(cmd)
            return
        if isinstance(cmd, ProfileCommand):
            self._apply_profile(cmd)  # type: ignore[attr-defined]  # EngineProfiling's (engine/profiler.py)
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

    def _apply_pause(self, cmd: PauseCommand) -> None:
        if cmd.mode == "keep":
            self._pause_state = PAUSED_ALL
            cmd.outcome = (True, None)
            return
        self._pause_state = PAUSED_NEW  # frozen requests (an earlier ``keep``) step again to drain
        if cmd.mode == "abort":
            self._abort_in_flight()
        if self._barrier_ready():
            self._run_barrier(cmd)
        else:
            self._barriers.append(cmd)

    def _unpause(self, cancelled: list) -> None:
        """Leave the pause; ``wait`` pauses still waiting are cancelled (told with ``cancelled``)."""
        self._pause_state = None
        waiting = [b for b in self._barriers if isinstance(b, PauseCommand)]
        if not waiting:
            return
        self._barriers[:] = [b for b in self._barriers if not isinstance(b, PauseCommand)]
        for pause in waiting:
            why = "the pause was cancelled by a resume sent while it waited for running requests"
            pause.outcome = (False, SleepCancelledError(why))
        cancelled += waiting

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
        if isinstance(cmd, WakeUpCommand | ResumeCommand):
            for cancelled in cmd.cancelled:
                resolve(cancelled.done, cancelled.outcome)  # type: ignore[arg-type]
        resolve(cmd.done, cmd.outcome)  # type: ignore[arg-type]

    def _barrier_ready(self) -> bool:
        """Nothing runs: the engine is idle, asleep (requests kept by a ``keep`` sleep wait for the
        wake) or frozen by a ``keep`` pause."""
        engine = self.engine
        return not engine.has_unfinished_requests() or engine.is_sleeping or self._pause_state == PAUSED_ALL

    def _run_barriers(self) -> list[Lifecycle]:
        """Run the barriers that waited for running requests to end; then let held requests in."""
        ran: list[Lifecycle] = list(self._barriers)
        self._barriers.clear()
        for cmd in ran:
            self._run_barrier(cmd)  # type: ignore[arg-type]
        return ran

    def _run_barrier(self, cmd: Barrier) -> None:
        engine = self.engine
        if isinstance(cmd, PauseCommand):
            if cmd.clear_cache:
                engine.block_manager.reset_prefix_cache()
            cmd.outcome = (True, None)
            return
        if self._pause_state == PAUSED_ALL:
            engine.scheduler.preempt_all()  # frozen requests' KV is the old weights': recomputed
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
            paused=self._pause_state is not None,
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
