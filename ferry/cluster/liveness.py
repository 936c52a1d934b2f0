"""Liveness of `ferry up`'s children: a child whose process runs but no longer answers is killed, so
that the supervisor restarts it as it restarts one that crashed (a Kubernetes liveness probe's job).

* Workers and the router: a ``Prober`` thread per child GETs its ``/health`` every
  ``liveness.interval`` s, each on a new connection waiting at most ``liveness.timeout`` s. Any HTTP
  answer means alive, 503 included: a worker answers 503 while it drains or its engine is unwell, the
  router while no worker is ready; busy, not hung. Only a probe left unanswered counts (timed out,
  refused, reset). A child is hung when its last ``liveness.failure_threshold`` probes in a row went
  unanswered, all sent after its current process first answered (these probes or the supervisor's own
  while it waits for the child to be healthy); or when that process has answered none for
  ``startup_timeout`` s since it started. Before its first answer, refused connections are no
  sign of a hang: a worker binds its port but listens only once its model has loaded (minutes, for a
  large one). A hung child gets SIGTERM, then SIGKILL ``liveness.termination_grace_period`` s later
  (a stopped process acts on neither but the second; 0: SIGKILL alone), each to its whole process
  group; said once, with why.
* Our own redis-server: its hang is judged by the KV tier watcher's PINGs (``tier_watch.py``) and it
  gets SIGKILL at once, as it holds nothing to finish.

With ``liveness: false`` (no ``LivenessSpec``) nothing is probed and nothing, our own Redis
included, is ever killed as hung: ``check`` and ``check_redis`` decide nothing, the state file shows
no probe counts.

Nothing here restarts anything: the killed child exits and the supervisor's restart path (same port,
back-off) brings it back. Probes run on their own threads and only record what they saw; the
supervisor's main thread calls ``check`` and acts, so a hung child never holds up its loop.
"""

from __future__ import annotations

import http.client
import math
import signal
import threading
import time
from collections import deque
from collections.abc import Callable

from ferry.cluster import tier_watch
from ferry.cluster.child import Child
from ferry.cluster.spec import LivenessSpec
from ferry.cluster.tier_watch import TierCheck, TierWatcher


def probe_health(host: str, port: int, timeout: float) -> str | None:
    """GET ``/health`` on a new connection: None when any HTTP answer came back, else why not."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        conn.getresponse().read()
        return None
    except TimeoutError:
        return f"no answer in {timeout:g} s"
    except (OSError, http.client.HTTPException) as e:
        return getattr(e, "strerror", None) or str(e) or type(e).__name__
    finally:
        conn.close()


class Prober:
    """Probes one child's ``/health`` every ``spec.interval`` s (after the previous answer or timeout)
    on a daemon thread, across the child's restarts (its port stays)."""

    def __init__(self, child: Child, spec: LivenessSpec) -> None:
        self.host, self.port = child.spec.host, child.spec.port
        self.spec = spec
        self._answered = -math.inf  # when the latest probe that got an answer was sent (monotonic)
        # (sent, why) of the latest probes, all unanswered, oldest first: emptied by an answer.
        self._unanswered: deque[tuple[float, str]] = deque(maxlen=spec.failure_threshold)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"liveness-{child.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end; not waited for (a probe may be sitting out its timeout)."""
        self._stopped.set()

    def since(self, start: float) -> tuple[bool, list[str]]:
        """Of the probes sent at or after ``start`` (monotonic): whether any was answered, and why
        each of the latest ones, in a row, was not (at most ``failure_threshold``)."""
        with self._lock:
            return self._answered >= start, [why for sent, why in self._unanswered if sent >= start]

    def _run(self) -> None:
        while not self._stopped.wait(self.spec.interval):
            sent = time.monotonic()
            why = probe_health(self.host, self.port, self.spec.timeout)
            with self._lock:
                if why is None:
                    self._answered = sent
                    self._unanswered.clear()
                else:
                    self._unanswered.append((sent, why))


class Liveness:
    """The supervisor's liveness decisions over its HTTP children (``check``) and its own Redis
    (``check_redis``); ``unanswered`` and ``kills`` are what the state file shows of them."""

    def __init__(
        self,
        spec: LivenessSpec | None,
        children: list[Child],
        startup_timeout: float,
        say: Callable[[str], None],
    ) -> None:
        self.spec = spec  # None: switched off
        self.children = children
        self.startup_timeout = startup_timeout
        self.say = say
        self.probers = {} if spec is None else {c.name: Prober(c, spec) for c in children}
        self.unanswered: dict[str, int] = {}  # probes in a row the current process left unanswered
        self.kills: dict[str, int] = {}  # times each child was killed as hung
        self._started = math.inf  # when the probes began (monotonic)
        self._killing: dict[str, tuple[int | None, float]] = {}  # name: (pid, when SIGKILL is due)
        self._killed_redis: int | None = None  # pid of the child Redis killed as hung (said once)

    def start(self) -> None:
        """Begin probing: once the cluster is ready, every child having answered."""
        self._started = time.monotonic()
        for prober in self.probers.values():
            prober.start()

    def stop(self) -> None:
        for prober in self.probers.values():
            prober.stop()

    def check(self, now: float) -> bool:
        """Kill what is hung, SIGKILL what outlived its grace; True when what the state file shows of
        liveness changed."""
        if self.spec is None:
            return False
        grace = self.spec.termination_grace_period
        changed = False
        for child in self.children:
            if not child.running or child.started_at is None:
                continue
            pid, due = self._killing.get(child.name, (None, math.inf))
            if pid == child.pid:  # SIGTERM sent: SIGKILL when due
                if now >= due:
                    child.signal_group(signal.SIGKILL)
                    self._killing[child.name] = (pid, math.inf)
                continue
            # Only the current process' probes count, and only from when the probes began.
            start = max(child.started_at, self._started)
            prober = self.probers[child.name]
            answered, unanswered = prober.since(start)
            if not answered and child.healthy_since is not None:
                # It answered the supervisor's own probe: only the probes sent since then count (the
                # refused ones of its start, still the latest, would look like a hang).
                answered, unanswered = True, prober.since(max(start, child.healthy_since))[1]
            count = len(unanswered) if answered else 0  # before its first answer, not counted
            if count != self.unanswered.get(child.name, 0):
                self.unanswered[child.name] = count
                changed = True
            if answered and count >= self.spec.failure_threshold:
                why = f"answered none of the last {count} /health probes (the last: {unanswered[-1]})"
            elif not answered and unanswered and now - start > self.startup_timeout:
                why = f"answered no /health probe in startup_timeout ({self.startup_timeout:g} s) since it started"
            else:
                continue
            self.kills[child.name] = self.kills.get(child.name, 0) + 1
            if grace > 0:
                self.say(
                    f"{child.name} (pid {child.pid}) runs but {why}: hung; SIGTERM, then SIGKILL in"
                    f" {grace:g} s, to restart it"
                )
                child.signal_group(signal.SIGTERM)
                self._killing[child.name] = (child.pid, now + grace)
            else:
                self.say(f"{child.name} (pid {child.pid}) runs but {why}: hung; SIGKILL, to restart it")
                child.signal_group(signal.SIGKILL)
                self._killing[child.name] = (child.pid, math.inf)
            changed = True
        return changed

    def check_redis(self, redis: Child | None, watcher: TierWatcher, check: TierCheck | None) -> bool:
        """SIGKILL our own redis-server when it runs but left the last ``HUNG_AFTER`` PINGs, all
        sent since it was last healthy, unanswered: the supervisor's restart then brings it back as
        a crashed child. Only PINGs since it was healthy count, so a Redis just restarted is not
        judged by what its predecessor (or its own start) missed. One that SIGKILL cannot end at
        once (asleep in the kernel on a stuck disk) is not killed or spoken of again; with liveness
        switched off, none is. True: killed."""
        if (
            self.spec is None
            or redis is None
            or not redis.running
            or redis.healthy_since is None
            or redis.pid == self._killed_redis
        ):
            return False
        if watcher.unanswered_since(redis.healthy_since) < tier_watch.HUNG_AFTER:
            return False
        self._killed_redis = redis.pid
        self.kills[redis.name] = self.kills.get(redis.name, 0) + 1
        reason = f" (the last: {check.reason})" if check is not None and check.reason else ""
        self.say(
            f"redis (pid {redis.pid}) runs but answered none of the last {tier_watch.HUNG_AFTER} PINGs"
            f"{reason}: hung; SIGKILL, to restart it"
        )
        redis.signal_group(signal.SIGKILL)
        return True

    def state(self, child: Child) -> dict[str, int | None]:
        """A child's liveness fields in the state file (``unanswered_probes`` null: not probed)."""
        probed = child.name in self.probers
        return {
            "unanswered_probes": self.unanswered.get(child.name, 0) if probed else None,
            "hung_kills": self.kills.get(child.name, 0),
        }
