"""Run a ``ClusterPlan``: start in order, wait until healthy, restart crashes, drain and stop.

Life cycle:
1. Redis (when the plan has one) first, so no worker starts against a tier that is not there;
   then the workers and the router together. A child that exits before it has ever been healthy
   fails the start (a wrong flag should not loop), as does ``startup_timeout``.
2. Once everything answers, print the endpoint; from then on a child that exits is started again
   on the same port after an exponential back-off (``restart``), like a Kubernetes pod's
   CrashLoopBackOff; the router meanwhile sends requests to the healthy workers.
3. SIGTERM, Ctrl-C or SIGHUP (the terminal closed): SIGTERM to the router, which finishes its
   in-flight requests for up to ``drain_timeout`` while the workers still serve them; then the
   same for the workers; SIGKILL to what is left after each drain; then Redis. A second signal
   skips the drains. Every child runs in its own process group, which is what gets signalled.

A Redis KV tier (the child's or an existing one) is PINGed once the cluster is up and every
``--kv-tier-check-interval`` seconds after (``tier_watch.py``): its going away and coming back are
said once each and kept in the state file (``kv_tier_ok``); the workers serve on without it. From
then on too, each worker's and the router's ``/health`` is probed (``liveness.py``): a child whose
process runs but leaves ``liveness.failure_threshold`` probes in a row unanswered (a 503 is an
answer), or our own redis-server its PINGs, is hung; it is killed, said once with why, and comes
back as a crashed child does (``liveness: false``: none is ever killed as hung). An existing tier
is never touched.

All of it runs on the main thread (see ``child.py`` for why); log lines arrive on one thread per
child, the tier's PINGs on one more, each HTTP child's liveness probes on one more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from ferry.cluster import tier_watch
from ferry.cluster.child import Child, LogSink
from ferry.cluster.liveness import Liveness
from ferry.cluster.plan import ClusterPlan, redact_url
from ferry.cluster.router_view import PROBE_INTERVAL, RouterView, StartupFailed
from ferry.cluster.spec import ClusterConfig, RestartSpec
from ferry.cluster.tier_watch import TierCheck, TierWatcher, is_redis_url, ping_tier

TICK = 0.1  # seconds between looks at the children
KILL_GRACE = 10.0  # seconds after drain_timeout before SIGKILL (a worker aborts, then exits)
REDIS_STOP_TIMEOUT = 5.0
LOG_FLUSH_TIMEOUT = 2.0  # seconds to let an exited child's last log lines out before saying why


class Supervisor:
    def __init__(
        self,
        config: ClusterConfig,
        plan: ClusterPlan,
        sink: LogSink,
        state_file: Path | None = None,
        tier_check_interval: float | None = None,  # None: tier_watch.CHECK_INTERVAL_S
    ) -> None:
        self.config = config
        self.plan = plan
        self.sink = sink
        self.state_file = state_file
        self.redis = Child(plan.redis, sink) if plan.redis is not None else None
        self.redis_dir: str | None = None  # the child Redis' working directory, removed at exit
        self.servers = [Child(spec, sink) for spec in (*plan.workers, plan.router)]
        self.children = ([self.redis] if self.redis else []) + self.servers
        self.signals = 0
        self.first_signal: int | None = None
        self._signals_at_stop = 0  # signals seen when the stop began; any later one means "now"
        self.ready = False  # everything was healthy once and the endpoint is announced
        self._last_probe: dict[str, float] = {}
        pools = ", ".join(p.role for p in config.pools if p.replicas)
        self.router_view = RouterView(plan.router, plan.workers, pools)
        interval = tier_watch.CHECK_INTERVAL_S if tier_check_interval is None else tier_check_interval
        self.tier_watcher = (
            TierWatcher(plan.kv_tier_url, interval, tier_watch.CHECK_TIMEOUT_S)
            if plan.kv_tier_url is not None and is_redis_url(plan.kv_tier_url)
            else None
        )
        self.tier_check: TierCheck | None = None  # the last PING's result (None: not checked)
        self._tier_since: tuple[float, float] | None = None  # (wall, monotonic) when ok last changed
        self.liveness = Liveness(config.liveness, self.servers, config.startup_timeout, self.say)

    def say(self, text: str) -> None:
        self.sink.line("up", text)

    # ---- entry point ----------------------------------------------------------------------------
    def run(self) -> int:
        """Run until a signal; 0 after a clean stop, 1 if the cluster could not start."""
        stops = [signal.SIGINT, signal.SIGTERM]
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # under nohup it stays ignored
            stops.append(signal.SIGHUP)  # the terminal closed: stop as cleanly as on Ctrl-C
        redis = self.config.kv_tier.redis
        if self.redis is not None and redis is not None and "--dir" not in redis.args:
            # Redis loads the dump.rdb of its directory at start (and SAVE writes one there): in
            # the user's, a dump left by a Redis once run there would fill the fresh KV tier.
            self.redis_dir = self.redis.cwd = tempfile.mkdtemp(prefix="ferry-redis-")
        previous = {sig: signal.signal(sig, self._on_signal) for sig in stops}
        try:
            try:
                started = self._start_all()
            except StartupFailed as e:
                self.say(f"error: {e}")
                return 1
            if started:
                self._start_tier_watch()
                self.liveness.start()
                self._announce()
                self._watch()
            return 0
        finally:
            if self.tier_watcher is not None:
                self.tier_watcher.stop()
            self.liveness.stop()
            if self.first_signal is not None:
                name = signal.Signals(self.first_signal).name
                self.say(f"{name}: draining (a second signal stops at once)")
            self._stop_all()
            if self.redis_dir is not None:
                shutil.rmtree(self.redis_dir, ignore_errors=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.state_file is not None:
                with contextlib.suppress(FileNotFoundError):
                    self.state_file.unlink()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only take note: the main thread may be printing, inside the log sink's lock, when the
        # handler runs on it; a line said from here would wait for that lock forever.
        self.signals += 1
        if self.first_signal is None:
            self.first_signal = signum

    # ---- start ----------------------------------------------------------------------------------
    def _start_all(self) -> bool:
        """Start everything and wait until healthy. False when a signal interrupted the start."""
        deadline = time.monotonic() + self.config.startup_timeout
        if self.redis is not None:
            self._spawn(self.redis)
            if not self._wait_healthy([self.redis], deadline):
                return False
        for child in self.servers:
            self._spawn(child)
        if not self._wait_healthy(self.servers, deadline):
            return False
        # The router probes a starting worker with back-off: ready means it routes to all of them,
        # so that the first worker to fail is not the only one the router knows about.
        return self._wait_until(self.router_view.sees_all, deadline, "the router to see every worker")

    def _wait_healthy(self, children: list[Child], deadline: float) -> bool:
        waiting = list(children)

        def all_healthy() -> bool:
            waiting[:] = [c for c in waiting if not self._probe(c)]
            return not waiting

        return self._wait_until(all_healthy, deadline, lambda: ", ".join(c.name for c in waiting))

    def _wait_until(self, done: Callable[[], bool], deadline: float, what: str | Callable[[], str]) -> bool:
        """Poll ``done`` until true; False on a signal. A child that exits or the deadline fails."""
        while not self.signals:
            for child in self.children:
                code = child.exit_code()
                if code is not None:
                    child.join_logs(LOG_FLUSH_TIMEOUT)  # its last lines (the reason) before ours
                    raise StartupFailed(
                        f"{child.name} exited with {_status(code)} before the cluster was ready"
                        f" (its output is above, prefixed [{child.name}]): {shlex.join(child.spec.redacted_argv())}"
                    )
            if done():
                return True
            if time.monotonic() > deadline:
                waiting_for = what() if callable(what) else what
                raise StartupFailed(
                    f"not ready after startup_timeout ({self.config.startup_timeout:g} s), waiting for"
                    f" {waiting_for}"
                )
            time.sleep(TICK)
        return False

    def _spawn(self, child: Child) -> None:
        child.start()
        self.say(f"started {child.name} (pid {child.pid}) on {child.spec.url}")
        self._write_state()

    def _probe(self, child: Child) -> bool:
        now = time.monotonic()
        if now - self._last_probe.get(child.name, 0.0) < PROBE_INTERVAL:
            return False
        self._last_probe[child.name] = now
        if not child.probe():
            return False
        child.healthy_since = time.monotonic()
        child.ever_healthy = True
        return True

    # ---- run ------------------------------------------------------------------------------------
    def _start_tier_watch(self) -> None:
        """The tier's state at ready is a PING's, made now; the watcher's PINGs follow."""
        if self.tier_watcher is None:
            return
        self._note_tier(ping_tier(self.tier_watcher.url, self.tier_watcher.timeout_s))
        self.tier_watcher.start()

    def _note_tier(self, check: TierCheck | None) -> None:
        """Take a PING's result: any change goes to the state file, then the tier going away or
        coming back is said (once each way)."""
        if check is None or check == self.tier_check:
            return
        was, self.tier_check = self.tier_check, check
        line = None
        if was is None or was.ok != check.ok:
            now = time.monotonic()
            tier = redact_url(self.plan.kv_tier_url or "")
            if not check.ok:
                line = (
                    f"warning: {check.problem} the KV tier {tier}: {check.reason}; the workers serve on,"
                    " recomputing what they would have loaded, until it answers again"
                )
            elif was is not None and self._tier_since is not None:
                line = f"the KV tier {tier} answers again (after {now - self._tier_since[1]:.1f} s)"
            self._tier_since = (time.time(), now)
        self._write_state()  # before the line: whoever sees it finds the file saying so
        if line is not None:
            self.say(line)

    def _announce(self) -> None:
        counts = ", ".join(f"{p.replicas} {p.role}" for p in self.config.pools if p.replicas)
        tier = redact_url(self.plan.kv_tier_url or "none")
        self.ready = True
        self._write_state()  # before the ready line: whoever sees the line finds the file
        self.say(f"ready: {self.plan.endpoint} (router; {counts}; KV tier {tier})")
        model = self.router_view.served_model() or "MODEL"
        url = self.plan.endpoint
        body = json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
        )
        self.say("try it:")
        self.say(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'")
        self.say(
            f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='none');"
            f" print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user',"
            f" 'content': 'Hello!'}}], max_tokens=32).choices[0].message.content)\""
        )
        self.say("Ctrl-C (or SIGTERM) drains and stops everything.")

    def _watch(self) -> None:
        backoff = self.config.restart
        while not self.signals:
            now = time.monotonic()
            if self.tier_watcher is not None:
                self._note_tier(self.tier_watcher.latest())
                if self.liveness.check_redis(self.redis, self.tier_watcher, self.tier_check):
                    self._write_state()
            if self.liveness.check(now):
                self._write_state()
            for child in self.children:
                if child.running:
                    if child.healthy_since is None:
                        if self._probe(child):
                            self.say(f"{child.name} is healthy again (pid {child.pid})")
                            self._write_state()
                    elif child.crashes and now - child.healthy_since > backoff.reset_after:
                        child.crashes = 0
                elif child.restart_at is None:
                    code = child.exit_code()
                    child.signal_group(signal.SIGKILL)  # anything it started goes with it
                    child.join_logs(LOG_FLUSH_TIMEOUT)  # its last lines (a traceback) before ours
                    child.crashes += 1
                    delay = restart_delay(backoff, child.crashes)
                    child.restart_at = now + delay
                    self.say(
                        f"{child.name} (pid {child.pid}) exited with {_status(code)}; restarting in {delay:g} s"
                    )
                elif now >= child.restart_at:
                    child.restart_at = None
                    child.restarts += 1
                    self._spawn(child)
            time.sleep(TICK)

    # ---- stop -----------------------------------------------------------------------------------
    def _stop_all(self) -> None:
        # Dependents first, as `docker compose down` does: the router finishes its in-flight
        # requests while every worker still serves them (a draining worker refuses new work, so a
        # PD hand-off or a retry would fail), then the workers, then Redis.
        self._signals_at_stop = self.signals
        drain = self.config.drain_timeout
        router = [c for c in self.servers if c.spec.kind == "router"]
        workers = [c for c in self.servers if c.spec.kind != "router"]
        self._stop(router, drain + KILL_GRACE, f"stopping the router (drain up to {drain:g} s)")
        self._stop(workers, drain + KILL_GRACE, f"stopping workers (drain up to {drain:g} s)")
        if self.redis is not None:
            self._stop([self.redis], REDIS_STOP_TIMEOUT, "stopping redis")
        for child in self.children:
            child.join_logs(LOG_FLUSH_TIMEOUT)
        self.say("stopped")

    def _stop(self, children: list[Child], timeout: float, message: str) -> None:
        running = [c for c in children if c.running]
        if not running:
            return
        self.say(message)
        for child in running:
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(c.running for c in running):
            # A signal that arrives during the stop means "now" for every step left (the first
            # one started it).
            if time.monotonic() > deadline or self.signals > self._signals_at_stop:
                break
            time.sleep(TICK)
        for child in running:
            if child.running:
                self.say(f"{child.name} (pid {child.pid}) did not stop: SIGKILL")
            # Also reaps leftovers in its group (a child's own children).
            child.signal_group(signal.SIGKILL)
            child.wait(5.0)

    def _write_state(self) -> None:
        if self.state_file is None:
            return
        liveness = self.config.liveness
        state = {
            "pid": os.getpid(),
            "ready": self.ready,
            "endpoint": self.plan.endpoint,
            "kv_tier": self.plan.kv_tier_url and redact_url(self.plan.kv_tier_url),
            # The Redis tier's last PING: true / false (kv_tier_error says why) / null (not checked:
            # not started yet, or a tier with nothing to PING).
            "kv_tier_ok": None if self.tier_check is None else self.tier_check.ok,
            "kv_tier_error": None if self.tier_check is None else self.tier_check.reason,
            "kv_tier_since": None if self._tier_since is None else round(self._tier_since[0], 3),
            # How workers and the router are probed (null: `liveness: false`, never); each process'
            # unanswered_probes (in a row, of its current process since it first answered; null: not
            # probed) and hung_kills (liveness.py).
            "liveness": None if liveness is None else dataclasses.asdict(liveness),
            "processes": [
                {
                    "name": c.name,
                    "kind": c.spec.kind,
                    "pid": c.pid,
                    "pids": c.pids,
                    "url": c.spec.url,
                    "restarts": c.restarts,
                    **self.liveness.state(c),
                    "argv": list(c.spec.redacted_argv()),
                }
                for c in self.children
            ],
        }
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, self.state_file)  # readers never see half a file


def restart_delay(spec: RestartSpec, crashes: int) -> float:
    """Seconds before restart after the ``crashes``-th crash in a row: doubled each time, capped."""
    return min(spec.max_delay, spec.initial_delay * 2 ** (crashes - 1))


def _status(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
