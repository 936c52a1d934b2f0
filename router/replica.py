"""One replica as the router sees it: health state machine, circuit breaker, load counters.

Health comes from two sources:
* active probes of ``GET /health`` (``router/health.py``) with exponential backoff while a replica
  is down, and
* passive signals from real traffic: a connect error ejects at once, 5xx answers and timeouts
  feed a per-replica circuit breaker.

A replica that has never been healthy is ``STARTING``: refused connections and 503s are normal
while it loads its model and are not counted as failures. Every method takes ``now`` (monotonic
seconds) so the state machine is a pure function of its inputs and tests drive it with a fake clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.upstream_pool import cut_waiting

if TYPE_CHECKING:
    from router.upstream import Response


class Health(enum.Enum):
    STARTING = "starting"  # never seen healthy yet: not routable, failures not counted
    HEALTHY = "healthy"
    EJECTED = "ejected"  # was healthy, then failed: not routable until a probe succeeds


class Circuit(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class HealthPolicy:
    """Thresholds of the state machine (from RouterConfig)."""

    probe_interval: float = 1.0  # while healthy
    probe_backoff_max: float = 8.0  # while ejected / starting, probes back off up to this
    eject_after_probe_failures: int = 2  # consecutive failed probes of a healthy replica
    circuit_failures: int = 3  # consecutive request failures that open the circuit
    circuit_cooldown: float = 5.0  # seconds open before one trial request is let through
    circuit_cooldown_max: float = 60.0


class CircuitBreaker:
    """Closed → (N consecutive failures) → open → (cooldown) → half-open: one trial request.
    The trial's success closes it; its failure re-opens it with a doubled cooldown. A trial that
    ends with neither (its client left, it was answered 429 and re-sent elsewhere) gives its slot
    back: the circuit stays half-open and the next request is the trial."""

    def __init__(self, failures: int, cooldown: float, cooldown_max: float) -> None:
        self.threshold = failures
        self.base_cooldown = cooldown
        self.cooldown_max = cooldown_max
        self.state = Circuit.CLOSED
        self.consecutive_failures = 0
        self.cooldown = cooldown
        self.opened_at = 0.0
        self.trial_in_flight = False
        self.trials = 0  # trials sent so far: numbers them, so only the current one frees the slot

    def allows(self, now: float) -> bool:
        """May a request be sent now? (Pure: does not consume the half-open trial.)"""
        if self.state is Circuit.CLOSED:
            return True
        if self.state is Circuit.OPEN:
            return now - self.opened_at >= self.cooldown
        return not self.trial_in_flight

    def on_send(self, now: float) -> int:
        """A request was sent. Returns its trial number when it is the half-open trial, else 0."""
        if self.state is Circuit.OPEN and now - self.opened_at >= self.cooldown:
            self.state = Circuit.HALF_OPEN
        if self.state is not Circuit.HALF_OPEN:
            return 0
        self.trial_in_flight = True
        self.trials += 1
        return self.trials

    def on_trial_end(self, trial: int) -> None:
        """Trial ``trial`` (``on_send``'s number) ended. Without a verdict the circuit is still
        half-open with that trial in flight: free the slot. After a verdict, a reset, or for an
        older trial, nothing changes."""
        if trial and trial == self.trials and self.state is Circuit.HALF_OPEN:
            self.trial_in_flight = False

    def on_success(self) -> None:
        self.state = Circuit.CLOSED
        self.consecutive_failures = 0
        self.cooldown = self.base_cooldown
        self.trial_in_flight = False

    def on_failure(self, now: float) -> None:
        self.consecutive_failures += 1
        if self.state is Circuit.HALF_OPEN:
            self.cooldown = min(self.cooldown * 2, self.cooldown_max)
            self._open(now)
        elif self.state is Circuit.CLOSED and self.consecutive_failures >= self.threshold:
            self._open(now)

    def reset(self) -> None:
        self.on_success()

    def _open(self, now: float) -> None:
        self.state = Circuit.OPEN
        self.opened_at = now
        self.trial_in_flight = False


class Replica:
    """Mutable router-side state of one replica. Owned by the router's event loop (no locks)."""

    def __init__(
        self, url: str, role: str = "mixed", *, source: str = "static", policy: HealthPolicy | None = None
    ) -> None:
        self.url = url
        self.role = role
        self.source = source  # static | admin | discovery: who may remove it
        self.policy = policy or HealthPolicy()
        self.removed = False  # taken out of the router (admin, discovery): requests still in flight finish
        # Streams being relayed from it: cut when it is ejected, so they fail over (or end with an
        # error) at once instead of waiting on a replica that stopped answering.
        self.streams: set[Response] = set()
        self.waiting: set[Any] = set()  # connections whose answer's head is awaited (the same)
        self.health = Health.STARTING
        self.draining = False
        self.sleeping = False  # its /health says its engine sleeps (vLLM's sleep mode): used only when all do
        # Its /health says generation is paused (vLLM's /pause, for an RL weight sync): it holds new
        # requests until resumed, as a sleeping one does, so it too is used only when all are.
        self.paused = False
        # Its /health says it loads LoRA adapters it is asked for from a directory (ferry serve
        # --lora-resolver-dir): requests naming a model no replica lists go to such replicas (pool.serving).
        self.lora_resolver = False
        self.models: list[str] = []  # served model ids (from /v1/models)
        self.model_cards: list[dict] = []  # its /v1/models entries as last read (the router's fallback)
        # The role its /health names (a ferry replica's), when it names one; ``misrole``: it says
        # prefill while the router has it in a pool that sends whole requests (it would answer
        # each with one token), so it is not routable there.
        self.reported_role: str | None = None
        self.misrole = False
        # The engine instance its /health names (a ferry replica's, new at each start) and how often
        # it emptied its prefix cache, when it names them: a change means the KV blocks the router
        # believed it held are gone (router/health.py).
        self.instance_id: str | None = None
        self.prefix_cache_resets: int | None = None
        # LoRA adapter name -> the digest of its files (``lora_weights_id`` in /v1/models): salts
        # the adapter's block hashes (kvcache.keys.lora_extra).
        self.lora_weights: dict[str, str] = {}
        self.models_read_at = float("-inf")
        # Names it resolved from its directory (it answered a request naming them while it did not
        # list them) -> when that answer came: put in ``models`` at once (router/relay.py), and kept
        # there by a ``/v1/models`` read that began before the answer (it may not list them yet).
        self.lora_resolved: dict[str, float] = {}
        # LoRA adapters the router was told to unload whose unload this replica missed (it did not
        # answer): retried at its next good probe; requests for them never go here (pool.serving).
        self.lora_unloads: set[str] = set()
        # What the router learns LoRA adapters from (router/lora_learn.py): its adapter cards (name ->
        # ``root``) as last read while this instance ran, None when unknown (new, restarted, or one of
        # the router's own changes has an unknown outcome); the router's own load/unload sends to it
        # (counted at their start and end) and those in flight, so a read that overlaps one is not
        # taken for another party's change; the adapters it lists under another path than the
        # router knows them by (no request for them goes here).
        self.lora_seen: dict[str, str] | None = None
        self.lora_changes = 0
        self.lora_changing = 0
        self.lora_mismatch: set[str] = set()
        self.emits_token_ids = False  # seen answering return_token_ids (else the relay asks logprobs)
        self.circuit = CircuitBreaker(
            self.policy.circuit_failures, self.policy.circuit_cooldown, self.policy.circuit_cooldown_max
        )
        self.probe_failures = 0
        self.next_probe_at = 0.0
        self.probe_delay = self.policy.probe_interval
        # Load the router itself tracks (policies read these).
        self.inflight = 0
        self.inflight_tokens = 0
        self.prefilling = 0  # of those in flight: sent, no content back yet (still queued or prefilling)
        self.total_requests = 0

    # ---- routing view -------------------------------------------------------------------------
    def routable(self, now: float) -> bool:
        return (
            self.health is Health.HEALTHY
            and not self.draining
            and not self.misrole
            and self.circuit.allows(now)
        )

    @property
    def ever_healthy(self) -> bool:
        return self.health is not Health.STARTING

    # ---- load accounting ------------------------------------------------------------------------
    def acquire(self, tokens: int, now: float) -> int:
        """Count a request sent. Returns its circuit trial number (0: not a trial), for ``release``."""
        self.inflight += 1
        self.prefilling += 1
        self.inflight_tokens += tokens
        self.total_requests += 1
        return self.circuit.on_send(now)

    def release(self, tokens: int, prefilling: bool, trial: int = 0) -> None:
        """The request ended (after its verdict, if it got one)."""
        self.inflight -= 1
        self.inflight_tokens -= tokens
        if prefilling:
            self.prefilling -= 1
        self.circuit.on_trial_end(trial)

    def first_content(self) -> None:
        """A request's first content came back: it left the replica's prefill queue."""
        self.prefilling -= 1

    # ---- active probes ------------------------------------------------------------------------
    def on_probe_ok(self, now: float) -> None:
        if self.health is not Health.HEALTHY:
            self.circuit.reset()  # a replica that came back gets a clean slate
        self.health = Health.HEALTHY
        self.probe_failures = 0
        self.probe_delay = self.policy.probe_interval
        self.next_probe_at = now + self.probe_delay

    def on_probe_fail(self, now: float) -> None:
        if self.health is Health.HEALTHY:
            self.probe_failures += 1
            if self.probe_failures >= self.policy.eject_after_probe_failures:
                self.health = Health.EJECTED
                self._cut_streams()
            self.next_probe_at = now + self.policy.probe_interval
            return
        # Starting or ejected: back off so a dead replica costs little; starting ones are not errors.
        self.probe_delay = min(
            max(self.probe_delay * 2, self.policy.probe_interval / 4), self.policy.probe_backoff_max
        )
        self.next_probe_at = now + self.probe_delay

    def _cut_streams(self) -> None:
        """Ejected: a stream it still holds open, or a request still waiting for its answer's head,
        would wait out the read timeout (a hung process keeps its sockets): drop them, for their
        relays to resume or retry them elsewhere."""
        streams, self.streams = self.streams, set()
        for response in streams:
            response.abort()
        cut_waiting(self.waiting)

    # ---- passive signals from traffic ---------------------------------------------------------
    def on_connect_error(self, now: float) -> None:
        """Nothing listens: eject now and probe soon (a restart is readmitted by the next good probe)."""
        if self.health is Health.HEALTHY:
            self.health = Health.EJECTED
            self._cut_streams()
            self.probe_delay = self.policy.probe_interval / 4
            self.next_probe_at = now + self.probe_delay
        self.circuit.on_failure(now)

    def on_request_failure(self, now: float) -> None:
        """A 5xx, a timeout or a broken stream."""
        self.circuit.on_failure(now)

    def on_request_success(self) -> None:
        if self.circuit.state is not Circuit.CLOSED or self.circuit.consecutive_failures:
            self.circuit.on_success()

    def describe(self, now: float) -> dict:
        return {
            "url": self.url,
            "role": self.role,
            "reported_role": self.reported_role,
            "instance_id": self.instance_id,
            "prefix_cache_resets": self.prefix_cache_resets,
            "source": self.source,
            "health": self.health.value,
            "circuit": self.circuit.state.value,
            "failures": self.circuit.consecutive_failures,
            "draining": self.draining,
            "sleeping": self.sleeping,
            "paused": self.paused,
            "lora_resolver": self.lora_resolver,
            "routable": self.routable(now),
            "models": list(self.models),
            "inflight": self.inflight,
            "inflight_tokens": self.inflight_tokens,
            "prefilling": self.prefilling,
            "total_requests": self.total_requests,
        }
