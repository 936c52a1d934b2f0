"""``redis://`` and ``rediss://`` — KV blocks in Redis, shared by every replica of a model.

URL: ``redis[s]://[[user]:password@]host:port/db?ttl=S&timeout=S&connect_timeout=S
&max_connections=N&l1_bytes=N&breaker_failures=N&breaker_cooldown=S&flush_check=S``
(redis-py's own ``ssl_*`` and ``client_name`` parameters pass through).

* Reads are pipelined ``MGET`` s in chunks (one round trip for a whole prefix); writes are
  pipelined ``SET`` s, not ``MSET``: hiredis' command packer caps large ``MSET`` s at ~0.5 GB/s.
* ``contains_prefix`` runs a 4-line Lua script (``EVALSHA``): one round trip, the server stops
  at the first absent key. It declares ``#!lua flags=no-writes`` (Redis 7+), so lookups go on
  during ``CLIENT PAUSE WRITE``, on read-only replicas and over ``maxmemory``; a Redis before 7 runs
  it without the shebang. Where scripting is refused it pipelines one ``EXISTS`` per key.
  ``contains_prefix_many`` (the engine's batched admission lookups) pipelines one script call
  per key list: one round trip for them all.
* Every call is bounded by socket timeouts, no call is retried (the breaker decides when to
  try again; writes the server refuses while reachable, OOM, READONLY, MISCONF, are counted by
  reason and written again later by the writer, ``kvcache/writer.py``; a ``READONLY`` also closes
  the idle connections, so the next ones reach a failed-over endpoint's new primary), and
  eviction is Redis' own (``maxmemory`` + an LRU policy); ``ttl`` adds expiry after that many
  seconds without a write or a read of the block (a read sets it again, from a thread of its
  own: ``EXPIRE`` is a write, which ``CLIENT PAUSE WRITE`` holds, and a read must not wait for
  it).
* ``l1_bytes=N`` puts a process-local memory LRU of N bytes in front (see ``composite_tier``).
* A server that restarted (its ``run_id``, read with ``INFO server`` once per new connection, is
  not the one seen before) lost every block: it counts in ``epoch()``, so replicas re-publish what
  their prefix caches hold (``kvcache/republish.py``), even when the restart was too quick to open
  the breaker. A server that refuses ``INFO`` (ACLs, renamed on some managed Redis) is not watched.
* A ``FLUSHALL`` / ``FLUSHDB`` keeps the ``run_id``. Each tier client keeps a marker key of its own,
  ``ferry:kvmeta:marker:{client id}`` (outside the blocks' ``ferry:kv:`` key space; expires a day
  after its last check, so dead clients leave nothing), and every ``flush_check`` seconds (5; 0: never)
  the engine's step starts ``watch`` on a background thread (``GuardedTier.poll``): one round trip,
  ``EXISTS`` + ``SET``. A marker gone since the last check, with the same ``run_id``, means the
  server was flushed: that counts in ``epoch()`` too. Redis evicting single blocks (``maxmemory``)
  leaves no such trace and is not noticed; an evicted marker reads as a flush (one pass that finds
  the blocks present writes only what is missing). A server that refuses the marker (an ACL limited to
  ``ferry:kv:*``) is not watched for flushes; one that refuses it for a while (a read-only replica
  after a failover, OOM, MISCONF) counts a refusal per check and is watched again once it takes it.

This backend raises on I/O errors; the factory wraps it in ``GuardedTier`` so the tier that
``open_tier`` returns never does.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.retry import Retry

from kvcache.breaker import CircuitBreaker, GuardedTier
from kvcache.tier import PartialWriteError, Tier, TierURL, register_tier

logger = logging.getLogger(__name__)

# How many leading KEYS exist. Read-only (EXISTS only), so it is safe on replicas too.
PREFIX_SCRIPT_BODY = """
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 0 then return i - 1 end
end
return #KEYS
"""
# Redis 7+ (and Valkey): declared read-only, so the server treats it as a read. Without the flag a
# script counts as a possible write: ``CLIENT PAUSE WRITE`` (managed Redis pause writes during a
# failover or an upgrade) holds every lookup until the pause ends. Redis before 7 does not parse the
# shebang ("Error compiling script"): the tier then uses ``PREFIX_SCRIPT_BODY`` alone.
PREFIX_SCRIPT = "#!lua flags=no-writes\n" + PREFIX_SCRIPT_BODY
READ_CHUNK = 64  # keys per MGET: bounds one reply to ~16 MiB of 256 KiB blocks
EXISTS_CHUNK = 64  # keys per pipelined EXISTS round trip (contains_prefix without Lua)
WRITE_CHUNK_BYTES = 32 << 20  # flush a write pipeline every ~32 MiB
# ``ttl``: keys read, waiting for their ``EXPIRE`` on the touch thread (past that the oldest are not
# refreshed), and how many ``EXPIRE`` s one round trip sends.
TOUCH_BACKLOG = 8192
TOUCH_CHUNK = 1024
MARKER_PREFIX = "ferry:kvmeta:marker:"  # + a client id: one flush marker per tier client
MARKER_TTL_S = 24 * 3600  # a dead client's marker goes after a day; a live one sets it again
PASSTHROUGH_PARAMS = (
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_check_hostname",
    "client_name",
)
# The parameters ferry reads from a tier URL (``_open_redis``), which redis-py does not take.
TIER_PARAMS = (
    "ttl",
    "timeout",
    "connect_timeout",
    "max_connections",
    "l1_bytes",
    "breaker_failures",
    "breaker_cooldown",
    "flush_check",
)


def client_url(url: str) -> str:
    """``url`` for a plain redis-py client: a tier URL (``redis://h:6379/0?ttl=600&l1_bytes=…``) given
    as a ``--responses-store``, ``--register`` or ``--discovery`` URL or to the router's KV-event
    reader works there too. Ferry's tier parameters are dropped, any other (redis-py's) kept."""
    parsed = TierURL(url)
    if not any(name in TIER_PARAMS for name in parsed.params):
        return url
    return parsed.url_without_params({k: v for k, v in parsed.params.items() if k not in TIER_PARAMS})


def _refuses_flags(exc: redis.exceptions.ResponseError) -> bool:
    """Whether a ``SCRIPT LOAD`` / ``EVALSHA`` error says the server cannot read the script's
    ``#!lua flags=…`` shebang: Redis before 7 compiles it as Lua ("Error compiling script … unexpected
    symbol near '#'"), a server that knows shebangs but not a flag names it ("Unexpected flag in
    script shebang")."""
    text = str(exc).lower()
    return "compiling script" in text or "shebang" in text


def _refuses_scripts(exc: redis.exceptions.ResponseError) -> bool:
    """Whether an ``EVALSHA`` (or ``SCRIPT LOAD``) error says this server will not run scripts for
    us: an ACL without the scripting commands (redis-py raises ``NoPermissionError``, whose text is
    "no permissions to run the 'evalsha' command"), the commands renamed away or disabled
    ("unknown command 'EVALSHA'", as some managed Redis do), scripting turned off."""
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return True
    text = str(exc).lower()
    return any(sign in text for sign in ("script", "noperm", "unknown command"))


class RedisTier(Tier):
    """Raw Redis backend (may raise); see the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        ttl_s: int | None = None,
        socket_timeout: float = 1.0,
        connect_timeout: float = 0.5,
        max_connections: int = 16,
        use_script: bool = True,
        flush_check_s: float = 5.0,
    ) -> None:
        self.ttl_s = ttl_s
        self._run_id_lock = threading.Lock()
        self._run_id: str | None = None  # the server's, as the last new connection found it
        self._restarts = 0
        self._watch_restarts = True
        # The flush marker (see the module docstring): each client its own, since the first client
        # to find a shared one gone would set it again before the others looked.
        self.flush_check_s = flush_check_s
        self._marker = MARKER_PREFIX + uuid.uuid4().hex
        self._next_watch = 0.0  # monotonic time of the next check: the first step sets the marker
        self._marker_run_id: str | None = None  # the run_id the marker was last seen or set under
        self._marker_set = False  # this client's marker is known to be there (as of the last check)
        self._flushes = 0
        # No retries: a failing call returns at once and the breaker owns "try again later".
        # A blocking pool waits (bounded) for a free connection instead of failing when the
        # engine thread, loader and writer threads all call at once.
        self._pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=socket_timeout,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            redis_connect_func=self._on_connect,
        )
        self._client = redis.Redis(connection_pool=self._pool)
        # ``ttl``: the blocks read, whose expiry the touch thread sets again (``_touch``).
        self._touch_cond = threading.Condition()
        self._touch_keys: dict[str, None] = {}
        self._touch_thread: threading.Thread | None = None
        self._touch_busy = False  # the touch thread is sending keys it took
        self._closing = False
        # One round trip, one small reply, and the server stops at the first absent key.
        self._prefix_script: Script | None = (
            self._client.register_script(PREFIX_SCRIPT) if use_script else None
        )

    def _on_connect(self, conn: Any) -> None:
        """redis-py's connect hook: the usual handshake, then the server's ``run_id`` (one round trip
        per new connection; connections are pooled, so that is rare)."""
        conn.on_connect()
        if not self._watch_restarts:
            return
        try:
            conn.send_command("INFO", "server")
            info = conn.read_response()
        except redis.exceptions.ResponseError as exc:
            self._watch_restarts = False
            logger.warning("Redis refuses INFO (%s); a restart of the server goes unnoticed", exc)
            return
        run_id = _run_id(info)
        if run_id is None:
            return
        with self._run_id_lock:
            if self._run_id is not None and run_id != self._run_id:
                self._restarts += 1
                logger.warning(
                    "Redis KV tier restarted (run_id %s -> %s): its blocks are gone", self._run_id, run_id
                )
            self._run_id = run_id

    def epoch(self) -> int:
        return self._restarts + self._flushes

    def watch_due(self) -> bool:
        return self.flush_check_s > 0 and time.monotonic() >= self._next_watch

    def watch_due_in(self) -> float | None:
        if self.flush_check_s <= 0:
            return None
        return max(0.0, self._next_watch - time.monotonic())

    def watch(self) -> None:
        """Check this client's flush marker and set it again (one round trip); a marker gone since
        the last check under the same ``run_id`` counts a flush (a restart counted already)."""
        self._next_watch = time.monotonic() + self.flush_check_s
        pipe = self._client.pipeline(transaction=False)
        pipe.exists(self._marker)
        pipe.set(self._marker, b"1", ex=MARKER_TTL_S)
        found, stored = pipe.execute(raise_on_error=False)
        refused = found if isinstance(found, Exception) else stored if isinstance(stored, Exception) else None
        if refused is not None:
            with self._run_id_lock:
                self._marker_set = False  # unknown now: the next check only sets it
            # An ACL that refuses the marker refuses it for good; a read-only replica (the old primary
            # after a failover), a full Redis or MISCONF pass: tried again at the next check.
            if isinstance(refused, redis.exceptions.NoPermissionError):
                self.flush_check_s = 0.0
                logger.warning(
                    "Redis refuses the KV tier's flush marker (%s); a FLUSHALL goes unnoticed", refused
                )
                return
            raise refused  # counted and logged as the server's refusal (a full Redis): tried again later
        with self._run_id_lock:
            if not found and self._marker_set and self._marker_run_id == self._run_id:
                self._flushes += 1
                logger.warning(
                    "Redis KV tier was flushed (its marker %s is gone): its blocks are gone", self._marker
                )
            self._marker_set, self._marker_run_id = True, self._run_id

    def contains_many(self, keys: Sequence[str]) -> list[bool] | None:
        """One pipelined ``EXISTS`` per key, one round trip."""
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(found) for found in pipe.execute()]

    def contains_prefix(self, keys: Sequence[str]) -> int:
        while self._prefix_script is not None:
            try:
                return int(self._prefix_script(keys=list(keys)))
            except redis.exceptions.ResponseError as exc:
                self._script_refused(exc)
        return self._contains_prefix_pipelined(keys)

    def _script_refused(self, exc: redis.exceptions.ResponseError) -> None:
        """The server refused the lookup script: without its read-only shebang (a Redis before 7),
        or, scripting disabled (ACLs, some managed Redis), pipelined ``EXISTS`` from now on; any other
        error is raised again."""
        script = self._prefix_script
        if script is not None and script.script == PREFIX_SCRIPT and _refuses_flags(exc):
            logger.warning(
                "Redis does not take script flags (%s); the lookup script runs without its no-writes "
                "flag (lookups wait during a CLIENT PAUSE WRITE)",
                exc,
            )
            self._prefix_script = self._client.register_script(PREFIX_SCRIPT_BODY)
            return
        if not _refuses_scripts(exc):
            raise exc
        logger.warning("Redis refuses Lua scripts (%s); contains_prefix uses pipelined EXISTS", exc)
        self._prefix_script = None

    def contains_prefix_many(self, key_lists: Sequence[Sequence[str]]) -> list[int]:
        """Every list's ``contains_prefix`` in one pipelined round trip (one ``EVALSHA`` each)."""
        if len(key_lists) == 1:
            return [self.contains_prefix(key_lists[0])]
        while self._prefix_script is not None:
            try:
                return self._scripted_many(key_lists)
            except redis.exceptions.ResponseError as exc:
                self._script_refused(exc)
        pipe = self._client.pipeline(transaction=False)
        for keys in key_lists:
            for key in keys:
                pipe.exists(key)
        found = iter(pipe.execute())
        counts = []
        for keys in key_lists:
            flags = [next(found) for _ in keys]
            counts.append(next((i for i, f in enumerate(flags) if not f), len(keys)))
        return counts

    def _scripted_many(self, key_lists: Sequence[Sequence[str]]) -> list[int]:
        script = self._prefix_script
        assert script is not None
        for attempt in range(2):
            pipe = self._client.pipeline(transaction=False)
            for keys in key_lists:
                pipe.evalsha(script.sha, len(keys), *keys)
            replies = pipe.execute(raise_on_error=False)
            if attempt == 0 and any(isinstance(r, redis.exceptions.NoScriptError) for r in replies):
                # The server forgot the script (a restart, SCRIPT FLUSH): load it and ask again.
                self._client.script_load(script.script)
                continue
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return [int(r) for r in replies]
        raise AssertionError("unreachable")

    def _contains_prefix_pipelined(self, keys: Sequence[str]) -> int:
        found = 0
        for start in range(0, len(keys), EXISTS_CHUNK):
            pipe = self._client.pipeline(transaction=False)
            chunk = keys[start : start + EXISTS_CHUNK]
            for key in chunk:
                pipe.exists(key)
            for exists in pipe.execute():
                if not exists:
                    return found
                found += 1
        return found

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if len(keys) <= READ_CHUNK:
            out: list[bytes | None] = self._client.mget(keys)
        else:
            pipe = self._client.pipeline(transaction=False)
            for start in range(0, len(keys), READ_CHUNK):
                pipe.mget(keys[start : start + READ_CHUNK])
            out = [value for part in pipe.execute() for value in part]
        if self.ttl_s is not None:
            # A block read is in use: its expiry starts again (``ttl`` is an idle time).
            self._touch([key for key, value in zip(keys, out, strict=True) if value is not None])
        return out

    def _touch(self, keys: list[str]) -> None:
        """Hand ``keys`` to the touch thread, which sets their expiry again (best effort: a Redis
        that holds or refuses the ``EXPIRE`` s delays no read; the keys expire as if unread)."""
        if not keys:
            return
        with self._touch_cond:
            if self._closing:
                return
            self._touch_keys.update(dict.fromkeys(keys))
            while len(self._touch_keys) > TOUCH_BACKLOG:
                del self._touch_keys[next(iter(self._touch_keys))]
            if self._touch_thread is None:
                self._touch_thread = threading.Thread(
                    target=self._run_touch, name="kv-tier-touch", daemon=True
                )
                self._touch_thread.start()
            self._touch_cond.notify()

    def _run_touch(self) -> None:
        while True:
            with self._touch_cond:
                while not self._touch_keys and not self._closing:
                    self._touch_cond.wait()
                if self._closing:
                    return
                keys, self._touch_keys = list(self._touch_keys), {}
                self._touch_busy = True
            try:
                for start in range(0, len(keys), TOUCH_CHUNK):
                    pipe = self._client.pipeline(transaction=False)
                    for key in keys[start : start + TOUCH_CHUNK]:
                        pipe.expire(key, self.ttl_s)
                    pipe.execute(raise_on_error=False)
            except Exception as exc:  # noqa: BLE001 - best effort; the reads count the tier's health
                logger.debug("setting the ttl of %d read KV blocks again failed: %r", len(keys), exc)
            with self._touch_cond:
                self._touch_busy = False
                self._touch_cond.notify_all()

    def wait_touched(self, timeout: float = 5.0) -> bool:
        """Wait until the touch thread sent every key handed to it (tests); False at the timeout."""
        with self._touch_cond:
            return self._touch_cond.wait_for(
                lambda: not (self._touch_keys or self._touch_busy) or self._closing, timeout
            )

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        """Pipelined ``SET`` s, sent in chunks of ~``WRITE_CHUNK_BYTES``; each item's flag says whether
        Redis acknowledged it. A chunk with a refused write (OOM under ``noeviction``, a read-only
        replica) or a lost connection ends the call: ``PartialWriteError`` carries the flags (the
        writes of earlier chunks, and a chunk's writes Redis answered OK, stay counted as written)."""
        stored = [False] * len(items)
        start = 0
        while start < len(items):
            end, pending = start, 0
            pipe = self._client.pipeline(transaction=False)
            while end < len(items) and pending < WRITE_CHUNK_BYTES:
                key, value = items[end]
                pipe.set(key, value, ex=self.ttl_s)
                pending += len(value)
                end += 1
            try:
                replies = pipe.execute(raise_on_error=False)
            except Exception as exc:
                # The connection broke: what Redis did with this chunk is unknown, so none of it is
                # counted as written (a reader finds out by itself, and misses are safe).
                raise PartialWriteError(stored, exc) from exc
            refused: Exception | None = None
            for i, reply in enumerate(replies, start):
                if isinstance(reply, Exception):
                    refused = refused or reply
                else:
                    stored[i] = True
            if refused is not None:
                if isinstance(refused, redis.exceptions.ReadOnlyError):
                    # A replica now (a failover made it one): the idle connections go, so the next
                    # ones resolve the endpoint again (managed Redis points its name at the new
                    # primary). A new server's ``run_id`` counts as a restart: a re-publication pass.
                    self._pool.disconnect(inuse_connections=False)
                raise PartialWriteError(stored, refused)
            start = end
        return stored

    def close(self) -> None:
        with self._touch_cond:
            self._closing = True
            self._touch_cond.notify()
        self._client.close()
        self._pool.disconnect()


def _run_id(info: bytes | str) -> str | None:
    """The ``run_id`` line of an ``INFO server`` reply (None if it has none)."""
    text = info.decode("utf-8", "replace") if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        if line.startswith("run_id:"):
            return line[len("run_id:") :].strip()
    return None


@register_tier("redis", "rediss")
def _open_redis(url: TierURL) -> Tier:
    ttl_s = url.pop_int("ttl", None, minimum=1)
    timeout = url.pop_float("timeout", 1.0, minimum=0.001)
    connect_timeout = url.pop_float("connect_timeout", 0.5, minimum=0.001)
    max_connections = url.pop_int("max_connections", 16, minimum=1)
    l1_bytes = url.pop_int("l1_bytes", None, minimum=1)
    failures = url.pop_int("breaker_failures", 3, minimum=1)
    cooldown = url.pop_float("breaker_cooldown", 1.0, minimum=0.0)
    flush_check = url.pop_float("flush_check", 5.0, minimum=0.0)
    passthrough = {k: url.params.pop(k) for k in PASSTHROUGH_PARAMS if k in url.params}
    url.check_consumed()
    assert max_connections is not None and failures is not None
    backend = RedisTier(
        url.url_without_params(passthrough),
        ttl_s=ttl_s,
        socket_timeout=timeout,
        connect_timeout=connect_timeout,
        max_connections=max_connections,
        flush_check_s=flush_check,
    )
    guarded = GuardedTier(
        backend, CircuitBreaker(failures, cooldown), name=f"{url.scheme}://{url.parts.hostname}"
    )
    if l1_bytes is None:
        return guarded
    from kvcache.composite_tier import CompositeTier
    from kvcache.memory_tier import MemoryTier

    return CompositeTier(MemoryTier(l1_bytes), guarded)
