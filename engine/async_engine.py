"""AsyncEngine: the engine loop on a background thread behind an asyncio API (the server's only door).

The loop thread owns the ``LLMEngine``: only it schedules, runs the model or touches blocks.
Callers talk to it through a command queue (add, abort) and receive outputs through per-request
sinks called on their event loop (``call_soon_threadsafe``, one wake-up per loop and step), so the
API's event loop never waits on a model step. Everything crossing the thread boundary is a typed
message (``Request``, ``RequestOutput``, ``EngineStats``), which is what crosses the process
boundary when the loop runs in an engine process of its own (``server/engine_process.py``). A crash of the loop fails every in-flight request with ``EngineDeadError`` and marks the
engine unhealthy; it never leaves a caller waiting forever.

``AsyncEngine`` inherits seven parts that live in files of their own: the loop thread itself, its
command queue and what it applies between steps (engine/async_loop.py), gathering a burst of arrivals
before an idle loop's first step (``announce``, engine/async_burst.py), a request's inputs prepared
in worker threads before it is submitted (engine/async_prepare.py), the LoRA adapters served by
name (engine/async_lora.py), sleep mode, pauses and weight updates (engine/async_sleep.py), the
torch profiler (engine/profiler.py), and the hand-over of outputs to the request streams
(engine/async_streams.py, with the loop's command messages).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from engine.async_burst import BurstGathering
from engine.async_loop import EngineLoop
from engine.async_lora import LoRAServing
from engine.async_prepare import RequestPreparation
from engine.async_sleep import Barrier, SleepCommands
from engine.async_streams import OutputDelivery, Sink, _Abort, _Add, _Command, _ResetPrefixCache, _Stream
from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.keyed_locks import KeyedLocks
from engine.llm_engine import LLMEngine
from engine.lora_request import LoRARequest, ServedLoRA
from engine.outputs import RequestOutput, gather_interval, merge_pending
from engine.profiler import EngineProfiling
from engine.prompt_embeds import PreparedEmbeds
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats, ModelInfo
from engine.torch_threads import start_loop_thread

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError"]


class AsyncEngine(
    EngineLoop,
    SleepCommands,
    EngineProfiling,
    BurstGathering,
    LoRAServing,
    RequestPreparation,
    OutputDelivery,
):
    def __init__(self, config: EngineConfig | None = None, **options: Any) -> None:
        if config is None:
            config = EngineConfig.from_options(**options)
        elif options:
            raise TypeError("pass either an EngineConfig or keyword options, not both")
        self.config = config
        # The most an idle loop holds its first step to gather a burst of arrivals (``_gather_burst``).
        self.arrival_wait_s = config.burst_wait_ms / 1000
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.model_info: ModelInfo = self.engine.model_info
        self.instance_id: str = self.engine.instance_id  # new at each start (LLMEngine's)
        self._streams: dict[str, _Stream] = {}
        # The LoRA adapters served by name (``add_lora``): what the server resolves ``model`` against.
        self.served_loras: dict[str, ServedLoRA] = {}
        # Per adapter name, the lock its changes take and how many hold or wait for it (``_lora_change``).
        self._lora_locks = KeyedLocks()  # one change of an adapter name at a time
        # Per adapter name, how many times it was removed or reloaded (``LoRAServing.load_lora``).
        self._lora_generations: dict[str, int] = {}
        self._commands: deque[_Command] = deque()
        self._wake = threading.Condition()
        self._num_adds = 0  # requests submitted so far
        self._num_announces = 0  # ``announce`` calls so far
        self._announced = 0  # requests on their way in (``announce``), not yet submitted
        # The loop thread waits in ``_gather_burst`` (for probes and announced requests, not adds).
        self._gathering = False
        self._probes_sent = self._probes_back = 0  # _gather_burst's round trips through a loop
        self._probe_base = (0, 0, 0)  # announces, adds, announced-pending when the latest probe left
        self._gather_id = 0  # the gather under way (or next); its rounds carry it
        self._round_gather = -1  # the gather whose round was begun last
        self._gathered = False  # the rounds found the burst in
        self._gather_loop: asyncio.AbstractEventLoop | None = None  # whose loop runs the rounds
        self._stopping = False
        self._error: BaseException | None = None
        # When the step under way began (None between steps), and whether it was found stuck:
        # one running over ``step_timeout_s`` makes the engine unhealthy until it ends.
        self.step_timeout_s = config.step_timeout_s
        self._step_since: float | None = None
        self._stuck_logged = False
        # Sleep mode and weight updates: requests that arrived while the engine sleeps or drains
        # (held, in arrival order, until it is awake and idle-barriers ran), and those barriers.
        self._held: dict[str, _Add] = {}
        self._barriers: list[Barrier] = []
        self._pause_state: str | None = None  # a pause's (engine/async_sleep.py)
        self._stats = self._engine_stats()
        self._thread = start_loop_thread(self._run)  # with the model's torch thread count

    # -- public API ----------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int] | torch.Tensor | PreparedEmbeds,  # a tensor: prompt embeddings
        params: SamplingParams,
        resume_token_ids: list[int] | None = None,
        kv_transfer: dict[str, Any] | None = None,
        pooling: bool = False,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        images: list[Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream DELTA outputs of one request; the last has ``finished=True`` (and, for a
        ``pooling`` request, the ``embedding``).

        Raises ValueError (before yielding anything) for bad input, EngineDeadError if the loop dies.
        Closing the iterator early (client gone) aborts the request.
        """
        grammar = None
        if params.structured_outputs is not None:
            self._check_alive()
            grammar = await self.compile_structured(params.structured_outputs)
        if images:
            images = await self.process_images(images)
        if not isinstance(prompt, (str, list)):
            prompt = await self.prepare_prompt_embeds(prompt)
        if lora_request is not None:
            # Last, with nothing awaited between it and ``start``: other requests' adapters, loaded
            # meanwhile, could evict it (``max_cpu_loras``), and ``start`` would read it again here.
            self._check_alive()
            await self.load_lora(lora_request)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.start(
            request_id,
            prompt,
            params,
            queue.put_nowait,
            resume_token_ids=resume_token_ids,
            kv_transfer=kv_transfer,
            grammar=grammar,
            pooling=pooling,
            lora_request=lora_request,
            priority=priority,
            cache_salt=cache_salt,
            images=images,
        )
        finished = False
        # vLLM's stream_interval: after the first output, wait for that many tokens (or the last).
        interval, sent = params.stream_interval or 1, False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    finished = True  # the loop ended it: nothing to abort
                    raise out
                out = merge_pending(out, queue)
                if interval > 1 and sent:
                    out = await gather_interval(out, queue, interval)
                sent = True
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.cancel(request_id)

    def start(
        self,
        request_id: str,
        prompt: str | list[int] | torch.Tensor | PreparedEmbeds,  # a tensor: prompt embeddings
        params: SamplingParams,
        sink: Sink,
        *,
        resume_token_ids: list[int] | None = None,
        kv_transfer: dict[str, Any] | None = None,
        grammar: Any = None,
        pooling: bool = False,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        images: list[Any] | None = None,
    ) -> None:
        """Submit a request whose outputs go to ``sink``, called on this event loop: each step's
        DELTA output (the last has ``finished=True``), or an ``EngineDeadError`` if the loop dies.

        ``generate`` is this with a queue for a sink. A caller that relays outputs on (the engine
        process serving API servers, server/engine_host.py) uses it directly: no task and no
        generator per request, and each output handled in the pass that delivered it.

        Raises ValueError (nothing submitted) for bad input. ``grammar``: the compiled
        ``params.structured_outputs`` (``compile_structured``); without it, it compiles here.
        ``lora_request``: its adapter, read here unless loaded (``load_lora`` reads it off this
        thread). ``cancel`` ends the request early.
        """
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = self.engine.make_request(
            request_id,
            prompt,
            params,
            resume_token_ids=resume_token_ids,
            kv_transfer=kv_transfer,
            grammar=grammar,
            pooling=pooling,
            lora_request=lora_request,
            priority=priority,
            cache_salt=cache_salt,
            images=images,
        )
        stream = _Stream(asyncio.get_running_loop(), sink, request_id, self._streams)
        self._streams[request_id] = stream
        try:
            self._submit(_Add(req, stream))
        except EngineDeadError:
            self._streams.pop(request_id, None)
            raise

    def cancel(self, request_id: str) -> None:
        """Stop delivering a ``start``ed request's outputs and abort it (its blocks are freed by the
        engine's next pass; ``abort`` waits for that). Nothing happens for a finished request."""
        if self._streams.pop(request_id, None) is not None:
            with contextlib.suppress(EngineDeadError):  # a dead loop frees nothing: nothing to abort
                self._submit(_Abort(request_id, concurrent.futures.Future()))

    async def abort(self, request_id: str) -> None:
        """Finish the request now (blocks freed before this returns); its stream ends with "abort"."""
        if self._error is not None or not self._thread.is_alive():
            return
        done: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._submit(_Abort(request_id, done))
        except EngineDeadError:
            return  # it died meanwhile
        await asyncio.wrap_future(done)

    async def reset_prefix_cache(self, reset_running: bool = False) -> int | bool:
        """Drop every cached, unused KV block (vLLM's /reset_prefix_cache). Runs on the loop thread
        between steps; returns the number of blocks dropped, or False while requests are running
        (``reset_running``: they are preempted first, and recompute)."""
        self._check_alive()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_ResetPrefixCache(done, reset_running))
        return await asyncio.wrap_future(done)

    def stats(self) -> EngineStats:
        """The snapshot the loop published after its latest step or command."""
        return self._stats

    def is_healthy(self) -> bool:
        return self._error is None and not self._stopping and self._thread.is_alive() and not self._stuck()

    def _stuck(self) -> bool:
        """Whether the step under way has run over ``step_timeout_s`` (logged once, with where the
        loop thread is, and again when it ends)."""
        since = self._step_since
        stuck = (
            bool(self.step_timeout_s) and since is not None and time.monotonic() - since > self.step_timeout_s
        )
        if stuck != self._stuck_logged:
            self._stuck_logged = stuck
            if stuck:
                frame = sys._current_frames().get(self._thread.ident or -1)
                where = "".join(traceback.format_stack(frame)) if frame is not None else "(unknown)\n"
                logger.error(
                    "an engine step has run for over %g s: the engine is reported unhealthy until it "
                    "ends. The engine loop is at:\n%s",
                    self.step_timeout_s,
                    where.rstrip(),
                )
            else:
                logger.warning("the stuck engine step ended: the engine is healthy again")
        return stuck

    async def shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            self._notify()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._fail_commands(EngineDeadError("the engine was shut down"))
        self.engine.connector.close()
