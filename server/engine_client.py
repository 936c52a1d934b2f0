"""``EngineClient``: an API server process's engine, across a Unix socket to the engine process.

It has ``AsyncEngine``'s interface as the server uses it (``generate``, ``abort``, ``announce``,
``compile_structured``, ``reset_prefix_cache``, ``sleep`` / ``wake_up`` / ``is_sleeping`` /
``reload_weights``, ``pause_generation`` / ``resume_generation`` / ``is_paused``, ``start_profile`` /
``stop_profile``, ``stats``, ``is_healthy``, ``shutdown``, and ``config`` / ``model_info`` /
``tokenizer``), so ``build_app`` takes either; and what only one API server of several needs:
``sequences_elsewhere`` (admission), ``report_load`` and ``load_elsewhere`` (``GET /load``). The engine
process (``server/engine_host.py``) validates each request as ``AsyncEngine.generate`` does; a refusal
arrives as the stream's first message and is raised as ``ValueError`` before anything is yielded, as in
process. It also admits each request's sequences over every API server's (``generate``'s ``admission``;
``end_admission``): a full queue is raised as ``AdmissionRefused``, also before anything is yielded.
``stats()`` is the latest snapshot the engine process pushed (with every step's outputs, and every
0.1 s while idle).
If the engine process goes away, every stream and call fails with ``EngineDeadError`` and
``is_healthy()`` turns False (``/health`` answers 503); if it stays connected but sends nothing,
not even its heartbeat, for ``ENGINE_SILENCE_S`` (stopped, wedged), ``is_healthy()`` is False and
new requests are refused until it is heard from again, so a load balancer moves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.errors import EngineDeadError, SleepCancelledError
from engine.multimodal import EMBEDS_PLACEHOLDER_ID
from engine.outputs import RequestOutput, gather_interval, merge_pending
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.stats import EngineStats
from engine.tokenizer import Tokenizer
from server.admission import Admission, AdmissionRefused
from server.engine_ipc import Channel

logger = logging.getLogger("ferry.engine_client")
# An engine process sends a heartbeat every second (server/engine_fanout.py HEARTBEAT_S): this long
# without a message and it is taken as stopped or wedged (/health 503, new requests refused).
ENGINE_SILENCE_S = 5.0

# A change of this API server's load (``report_load``) waits this long to leave, with the changes
# after it: a burst's arrivals and ends cost the engine process one message, not one each.
LOAD_REPORT_DELAY_S = 0.05


class EngineClient:
    # ``Generation`` passes each sequence's ``admission``: the engine process checks the limit.
    checks_admission = True

    def __init__(self, channel: Channel, hello: dict[str, Any]) -> None:
        self._channel = channel
        self.config = hello["config"]
        self.model_info = hello["model_info"]
        self.instance_id: str = hello["instance_id"]  # the engine's (AsyncEngine.instance_id)
        self.tokenizer = Tokenizer.from_dir(
            hello["tokenizer_dir"],
            self.config.chat_template,
            self.config.chat_template_content_format,
            config_dir=hello["model_dir"],
        )
        self._stats: EngineStats = hello["stats"]
        self._healthy: bool = hello["healthy"]
        self._heard = time.monotonic()  # when the engine process last sent anything
        self._silence_logged = False
        # The LoRA adapters the engine serves (``AsyncEngine.served_loras``), kept current by it.
        self.served_loras: dict[str, Any] = hello["loras"]
        # Sequences the other API servers have in the engine (``Generation.queued`` adds them).
        self.sequences_elsewhere = 0
        # The other API servers' requests on the engine's routes (``GET /load`` adds them), and
        # this one's as told to the engine process (``report_load``).
        self.load_elsewhere = 0
        self._load = self._load_sent = 0
        self._load_report: asyncio.TimerHandle | None = None
        # request id -> (its outputs' queue, its prompt's token ids: the engine process does not
        # send them back with every output)
        self._streams: dict[str, tuple[asyncio.Queue[RequestOutput | BaseException], list[int]]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        # Admission key -> sequences of that request not sent yet, for requests of several whose
        # first went out: the engine process holds their places until they come or it hears
        # ``end_admission``.
        self._unsent: dict[int, int] = {}
        # Admission keys of leasing requests (beam searches) whose first step went out: the engine
        # process holds their places until ``end_admission``.
        self._leases: set[int] = set()
        self._ids = itertools.count()
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def connect(cls, path: str, timeout: float = 30.0) -> EngineClient:
        """Connect to the engine process listening at ``path`` (retrying until ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.05)
        channel = Channel(reader, writer)
        frame = await channel.receive()
        if not frame or frame[0][0] != "hello":
            channel.close()
            raise ConnectionError(f"the engine process at {path} did not greet")
        client = cls(channel, frame[0][1])
        for message in frame[1:]:
            client._dispatch(message)
        return client

    # -- AsyncEngine's interface -------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: Any,  # token ids, or prompt embeddings (a tensor, pickled to the engine process)
        params: SamplingParams,
        resume_token_ids: list[int] | None = None,
        kv_transfer: dict[str, Any] | None = None,
        pooling: bool = False,
        lora_request: Any = None,
        priority: int = 0,
        cache_salt: str | None = None,
        images: list[Any] | None = None,
        admission: Admission | tuple[int, int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream DELTA outputs of one request, as ``AsyncEngine.generate`` does (``images``: PIL
        images, pickled to the engine process). ``admission``: (key, number of sequences, lease)
        of the HTTP request it is one sequence (or beam search step) of; the engine process admits
        them all or none over every API server's (else ``AdmissionRefused``). None: not counted."""
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        ids = prompt if isinstance(prompt, list) else [EMBEDS_PLACEHOLDER_ID] * len(prompt)
        self._streams[request_id] = (queue, ids)
        if admission is not None and Admission(*admission).lease:
            self._leases.add(admission[0])
        elif admission is not None and admission[1] > 1:
            key = admission[0]
            unsent = self._unsent.get(key, admission[1]) - 1
            if unsent > 0:
                self._unsent[key] = unsent
            else:
                self._unsent.pop(key, None)
        self._channel.send(
            (
                "add",
                request_id,
                admission,
                prompt,
                params,
                resume_token_ids,
                kv_transfer,
                pooling,
                lora_request,
                priority,
                cache_salt,
                images,
            ),
            # At once: the engine process takes each request in while this process parses the
            # next ones of a burst (the flush at the end of the pass would send them all at once).
            now=True,
        )
        finished = False
        # vLLM's stream_interval: after the first output, wait for that many tokens (or the last).
        interval, sent = params.stream_interval or 1, False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    finished = True  # the engine process ended it: nothing to abort
                    raise out
                out = merge_pending(out, queue)
                if interval > 1 and sent:
                    out = await gather_interval(out, queue, interval)
                sent = True
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished and not self._channel.closed:
                self._channel.send(("call", -1, "abort", request_id))

    def end_admission(self, key: int) -> None:
        """The request of admission ``key`` ended: the places of its sequences that were never sent,
        or that it leased, are free (the engine process holds them from its first sequence on)."""
        held = self._unsent.pop(key, None) is not None
        if key in self._leases:
            self._leases.discard(key)
            held = True
        if held and not self._channel.closed:
            self._channel.send(("release", key))

    def end_beam(self, key: int, prompt_index: int) -> None:
        """The beam search of prompt ``prompt_index`` of the leasing request ``key`` was counted here:
        the engine process, which counts the searches of an API server that died, forgets it."""
        if key in self._leases and not self._channel.closed:
            self._channel.send(("beam_end", key, prompt_index))

    async def compile_structured(self, spec: StructuredOutputsParams) -> None:
        """Compile (and keep, in the engine process) a constraint; ValueError if it is not valid."""
        await self._call("compile", spec)

    def announce(self) -> Callable[[], None]:
        """``AsyncEngine.announce`` across the socket (the engine process gathers bursts)."""
        token = next(self._ids)
        announcement = ("announce", token)
        self._channel.send(announcement)
        pending = True

        def submitted() -> None:
            # Submitted (or dropped) before the announcement left, in the same event-loop pass:
            # the pair would cancel out in the engine process, so neither is sent (the request's
            # add, if any, goes out at once after this: the engine sees it as an unannounced add).
            nonlocal pending
            if pending:
                pending = False
                if not self._channel.retract(announcement):
                    self._channel.send(("submitted", token))

        return submitted

    async def abort(self, request_id: str) -> None:
        """Finish the request now; returns once the engine freed its blocks."""
        if self._channel.closed:
            return
        with contextlib.suppress(EngineDeadError):
            await self._call("abort", request_id)

    async def store(self, op: str, *args: Any) -> Any:
        """The engine process's stored responses (``--responses-store memory``, shared by every API
        server): ``MemoryRecords.<op>(*args)`` there (get -> JSON bytes or None, put -> kept, …)."""
        self._check_alive()
        return await self._call("store", (op, *args))

    # The engine process sends every API server the whole served set ("loras") after a call that
    # may have changed it, and replies once all have taken it in: that message alone writes
    # ``served_loras``. Patching the entry from the reply would undo a later change of the same
    # name that came in meanwhile.
    async def add_lora(self, lora_request: Any, reload: bool = False) -> Any:
        """``AsyncEngine.add_lora`` in the engine process (every API server hears of it)."""
        return await self._call("add_lora", (lora_request, reload))

    async def remove_lora(self, lora_name: str) -> bool:
        return await self._call("remove_lora", lora_name)

    def report_load(self, requests: int) -> None:
        """This API server's requests on the engine's routes now (``server.middleware.ReplicaLoad``),
        for the engine process to add to the others' ``load_elsewhere`` (within LOAD_REPORT_DELAY_S)."""
        self._load = requests
        if self._load_report is None and not self._channel.closed:
            self._load_report = asyncio.get_running_loop().call_later(LOAD_REPORT_DELAY_S, self._send_load)

    def _send_load(self) -> None:
        self._load_report = None
        if self._load != self._load_sent:
            self._load_sent = self._load
            self._channel.send(("load", self._load))

    async def reset_prefix_cache(self, reset_running: bool = False) -> int | bool:
        self._check_alive()
        return await self._call("reset_prefix_cache", reset_running)

    # Sleep mode and weight updates: the engine process runs them (``AsyncEngine``'s methods).
    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        await self._call("sleep", (level, mode))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call("wake_up", tags)

    def is_sleeping(self) -> bool:
        """From the stats the engine pushed (before the reply to any call that changed it)."""
        return self._stats.sleep_level > 0

    async def reload_weights(
        self, path: str | None = None, load_format: str | None = None, abort_running: bool = False
    ) -> int:
        return await self._call("reload_weights", (path, load_format, abort_running))

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        await self._call("pause", (mode, clear_cache))

    async def resume_generation(self) -> None:
        await self._call("resume", None)

    async def start_profile(self, directory: str) -> None:
        await self._call("start_profile", directory)

    async def stop_profile(self) -> None:
        await self._call("stop_profile", None)

    def is_paused(self) -> bool:
        """From the pushed stats, as ``is_sleeping``; asleep counts as paused (vLLM's)."""
        return self._stats.paused or self._stats.sleep_level > 0

    def stats(self) -> EngineStats:
        return self._stats

    def is_healthy(self) -> bool:
        return self._healthy and not self._channel.closed and not self._silent()

    def _silent(self) -> bool:
        """Whether the engine process sent nothing (not even its heartbeat) for
        ``ENGINE_SILENCE_S``: it is stopped or wedged, though its socket stays open. Bytes
        waiting unread are not silence: this loop (lagging under load) has not read them yet."""
        silent = time.monotonic() - self._heard > ENGINE_SILENCE_S and not self._channel.pending()
        if silent != self._silence_logged:
            self._silence_logged = silent
            if silent:
                logger.error(
                    "the engine process sent nothing for %.0f s: reported unhealthy", ENGINE_SILENCE_S
                )
            else:
                logger.warning("the engine process is heard from again")
        return silent

    async def shutdown(self) -> None:
        """Close this API server's connection (the engine process aborts what it still runs)."""
        self._channel.close()
        if self._load_report is not None:
            self._load_report.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        self._fail_all("the engine connection was closed")

    # -- the socket --------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._channel.closed:
            raise EngineDeadError("the engine process is gone")
        if not self._healthy:
            raise EngineDeadError("the engine is not healthy")
        if self._silent():
            raise EngineDeadError(f"the engine process sent nothing for {ENGINE_SILENCE_S:.0f} s")

    async def _call(self, name: str, arg: Any) -> Any:
        self._check_alive()
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._channel.send(("call", call_id, name, arg))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    async def _read(self) -> None:
        try:
            while (frame := await self._channel.receive()) is not None:
                self._heard = time.monotonic()
                if self._silence_logged:  # log the recovery now, not at the next health check
                    self._silent()
                for message in frame:
                    self._dispatch(message)
        finally:
            if not self._channel.closed:
                logger.error("the engine process closed its connection")
            self._channel.close()
            self._fail_all("the engine process is gone")

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "out":
            stream = self._streams.get(message[1])
            if stream is not None:
                out = message[2]
                out.prompt_token_ids = stream[1]
                stream[0].put_nowait(out)
        elif kind == "probe":
            # The engine gathers a burst: answer after two passes of this loop, which announce
            # the requests whose bytes have arrived (see AsyncEngine._gather_burst).
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, self._channel.send, ("probe_back", message[1]))
        elif kind == "loras":
            self.served_loras = message[1]
        elif kind == "model_info":  # new weights: a new fingerprint
            self.model_info = message[1]
        elif kind == "beat":
            return  # only its arrival counts (_heard, set by _read)
        elif kind == "stats":
            _, self._stats, self._healthy, self.sequences_elsewhere, self.load_elsewhere = message
        elif kind == "err":
            stream = self._streams.get(message[1])
            if stream is not None:
                stream[0].put_nowait(_error(message[2], message[3]))
        elif kind == "reply":
            future = self._calls.get(message[1])
            if future is not None and not future.done():
                if message[2]:
                    future.set_result(message[3])
                else:
                    future.set_exception(_error(*message[3]))

    def _fail_all(self, why: str) -> None:
        for queue, _ in self._streams.values():
            queue.put_nowait(EngineDeadError(why))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(why))


def _error(kind: str, message: str) -> BaseException:
    if kind == "value":
        return ValueError(message)
    if kind == "overloaded":
        return AdmissionRefused(message)
    if kind == "dead":
        return EngineDeadError(message)
    if kind == "sleep_cancelled":
        return SleepCancelledError(message)
    return RuntimeError(message)
