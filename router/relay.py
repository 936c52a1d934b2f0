"""Send a request to a replica and relay the answer, with retries before the first byte.

``Relay`` is the part every orchestration shares (plain routing today, prefill→decode later):

* ``open``: pick a replica from a ``Pool`` with a ``Policy`` and send; on connect errors, broken
  connections before the response head and 429/502/503/504 answers, re-send to a *different*
  replica with jittered backoff, as long as no byte has reached the client. A ``POST`` that changes
  what a replica keeps (Files, Batches, a cancel: ``replayable``) is re-sent only when the replica
  cannot have acted on it (a connect error, a 429 or 503), and a Files/Batches request goes to the
  next batch home. A 404 saying a model the replica's last-read list names does not exist (a LoRA
  adapter gone since that read) takes it off that list and re-sends to a replica that lists it.
  A name no replica lists goes to a replica that resolves LoRA adapters from a directory
  (``pool.serving``): the requests for it sent before that one answers follow it (``Pool.resolving``,
  so one replica loads the adapter), its success lists the name there at once, and its 404 (not in
  its directory) re-sends to another resolving replica, with no retry spent.
* ``forward``: relay any answer byte for byte as it arrives (non-generation routes).
* generation (completions and chat, with whole-answer retries and mid-stream failover) builds on
  these in ``router/generation.py``.

The relay owns the load counters of the replicas it uses: every ``acquire`` is paired with one
``release`` in a ``finally``, including when the client disconnects (the task is cancelled and
the upstream connection closed, which makes the replica abort the request). A request also counts
in its replica's ``prefilling`` from ``acquire`` until the first content that replica streams back
(``Opened.first_content``) or, failing that, its ``release``: exactly once either way. A
request that is its replica's half-open circuit trial carries the trial's number to its
``release``, which frees the trial slot when the request ended without a verdict.

Once an answer's head has reached the client, the relay can no longer change its status: an
answer whose upstream breaks mid-body is cut off (connection closed, no end of body) so that the
client sees a failure, never a shorter answer that looks complete.

What traffic tells the relay about a replica is logged where it learns it: a replica ejected by a
connect error and a circuit that opens, each time (the prober logs only what its probes change);
each retry and failover with its request id, rate-limited (``router/log_limit.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from router.http import RESPONSE_DROP, Send, error_body, send_bytes
from router.log_limit import RateLimitedLog
from router.metrics import RouterMetrics
from router.policies.base import Policy, RouteRequest
from router.pool import Pool, awake, serving
from router.replica import Circuit, Replica
from router.response_affinity import answer_reader, is_batch_path
from router.retry import RetryPolicy, counts_as_replica_failure, request_timed_out
from router.upstream import ConnectError, Response, UpstreamClient, UpstreamError, UpstreamTimeout
from server.error_types import error_type

log = logging.getLogger("ferry.router")
TRANSPORT_ERRORS = (UpstreamError,)
BodyFor = Callable[[Replica], tuple[bytes, bool]]
CLIENT_GONE = 499  # nginx's code for "client closed the request"
# Retried statuses that do not say the replica left the request alone (429 and 503 do): ``replayable``.
ACTED_STATUS = frozenset({502, 504})
# What a path segment may hold as it is (RFC 3986 pchar: sub-delims, ":" and "@"; quote keeps the
# unreserved ones); everything else is percent-encoded.
_PATH_SAFE = "/:@!$&'()*+,;="


@dataclass
class ProxyCall:
    """One client request as the relay needs it."""

    method: str
    path: str  # "/v1/chat/completions" (query string kept separately)
    query: bytes
    headers: list[tuple[bytes, bytes]]  # already filtered, with x-request-id
    body: bytes
    request_id: str
    route: RouteRequest
    json: dict[str, Any] | None = None  # parsed body of generation requests
    started: float = field(default_factory=time.perf_counter)
    # Told which replica answered, and its answer's head, once the answer starts (``forward``).
    on_answered: Callable[[Replica, Response], None] | None = None
    # Told the Responses API object a replica answered with (a whole 200 answer's JSON, a stream's
    # ``response.completed`` / ``response.incomplete``): what it stored (router/response_affinity.py).
    on_response: Callable[[dict[str, Any]], None] | None = None
    # Set when the answer could not be finished after its head went out (a body cut off, a stream
    # ended with an error event in place of the rest): an "error" in the latency metric.
    broken: bool = False
    # Tracing (router/tracing.py): the request's span, the replica whose answer it got, its re-sends.
    trace: Any = None
    replica: str | None = None
    retries: int = 0

    @property
    def url_path(self) -> str:
        """The request target sent upstream. ``path`` is the client's, percent-decoded (as ASGI
        gives it): sent as it is, a decoded ``%20`` or ``%0D%0A`` would end the request line early
        and let a client write headers, or a whole second request, to the replica. Encoded again,
        it reaches the replica's router as the same path it would decode from the client."""
        target = quote(self.path, safe=_PATH_SAFE)
        return target + ("?" + self.query.decode("latin-1") if self.query else "")


@dataclass
class Opened:
    replica: Replica
    response: Response
    tokens: int
    router_logprobs: bool = False  # the router added logprobs to learn token ids (strip them)
    finished: bool = False  # load released and outcome recorded (exactly once)
    prefilling: bool = True  # counted in replica.prefilling until its first content (or the end)
    trial: int = 0  # the replica's circuit trial number this request is (0: none), for release

    def first_content(self) -> None:
        if self.prefilling:
            self.prefilling = False
            self.replica.first_content()


@dataclass
class Failed:
    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    reason: str = ""  # for the log: what went wrong ("unreachable: …"; empty: the replica answered)
    acted: bool = False  # the request reached the replica, which may have acted on it (no answer came)


class Relay:
    def __init__(
        self,
        client: UpstreamClient,
        policy: Policy,
        metrics: RouterMetrics,
        retry: RetryPolicy,
        *,
        max_failovers: int = 2,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.client = client
        self.policy = policy
        self.metrics = metrics
        self.retry = retry
        self.max_failovers = max_failovers
        self.clock = clock
        self.rng = rng or random.Random()
        self.request_log = RateLimitedLog(log)  # retries and failovers: one line per request

    # ---- picking and sending ------------------------------------------------------------------
    async def open(
        self, pool: Pool, call: ProxyCall, body: bytes | BodyFor, tried: set[str], attempt: list[int]
    ) -> Opened | Failed:
        """Send to replicas not in ``tried`` until one gives an answer that is not retried.
        ``body`` is the payload, or a function of the chosen replica giving (payload, router_logprobs)."""
        last: Failed | None = None
        while True:
            now = self.clock()
            candidates = awake(serving(call.route.model, pool.candidates(now, tried), pool))
            if not candidates:
                return last or _no_replica(pool, now, call.route.model)
            replica = _preferred(call.route, candidates)
            responses = not is_batch_path(call.path)  # a batch request's pin is no response's
            if replica is None and not responses:  # its home failed: the next home, as its next request
                replica = min(candidates, key=lambda r: r.url)  # finds it (response_affinity.batch_home)
            if replica is not None:
                if responses:
                    self.metrics.response_affinity.labels("hit").inc()
            else:
                if (
                    call.route.prefer_url is not None and responses
                ):  # known, but that replica cannot take it now
                    self.metrics.response_affinity.labels("miss").inc()
                replica = _following(pool, call.route.model, candidates) or self.policy.choose(
                    call.route, candidates
                )
            # A name no replica lists, sent to a replica that resolves adapters: the requests for it
            # that come before this one's answer follow it there (Pool.resolving).
            unlisted = _unlisted(replica, call.route.model)
            if unlisted:
                _follow(pool, replica, call.route.model)
            # Recorded at once, not when the answer starts: requests that share a prefix and
            # arrive together must see where the first of them went.
            self.policy.on_routed(call.route, replica)
            tokens = call.route.prompt_tokens
            trial = self._acquire(replica, tokens, now)
            payload, router_logprobs = body(replica) if callable(body) else (body, False)
            move_on = False  # a resolving replica without the adapter: the next one, no retry spent
            try:
                result = await self._send(replica, call, payload)
                if isinstance(result, Response):
                    status = result.status_code
                    model = call.route.model
                    if status == 404 and isinstance(model, str) and model in replica.models:
                        last = Failed(404, await _read_quietly(result), response_headers(result))
                        if not self._stale_model(replica, model, last.body) or not any(
                            model in r.models for r in pool.candidates(self.clock(), tried | {replica.url})
                        ):
                            self._release(replica, tokens, True, "404", trial)
                            return last
                        last.reason = f"does not serve model {model!r} (any more)"
                    elif unlisted and status == 404:
                        last = Failed(404, await _read_quietly(result), response_headers(result))
                        others = serving(model, pool.candidates(self.clock(), tried | {replica.url}), pool)
                        if not says_no_model(last.body) or not any(
                            model in r.models or r.lora_resolver for r in others
                        ):
                            if says_no_model(last.body) and any(model in r.models for r in pool):
                                # Held by a replica that cannot take it now: retry, as when
                                # no resolving replica could be asked (pool.serving).
                                last = _no_replica(pool, self.clock(), model)
                            _settle(pool, replica, model)
                            self._release(replica, tokens, True, "404", trial)
                            return last
                        move_on = True
                    elif (
                        not self.retry.should_retry_status(status, attempt[0])
                        or request_timed_out(status, result.headers)
                        or (status in ACTED_STATUS and not replayable(call))
                        or not serving(
                            call.route.model, pool.candidates(self.clock(), tried | {replica.url}), pool
                        )
                    ):
                        if call.route.predicted_hit_tokens:
                            self.metrics.cache_hit_tokens.inc(call.route.predicted_hit_tokens)
                        if unlisted:
                            _learn_resolved(pool, replica, model, status, self.clock())
                        call.replica = replica.url
                        return Opened(replica, result, tokens, router_logprobs, trial=trial)
                    else:
                        content = await _read_quietly(result)
                        last = Failed(status, content, response_headers(result))
                        if counts_as_replica_failure(status):
                            self.replica_failed(replica, f"answered {status}")
                else:
                    last = result
            except BaseException:  # the client left (task cancelled): give the load back
                if unlisted:  # the others sent there still follow it
                    _settle(pool, replica, call.route.model, ended=False)
                self._release(replica, tokens, True, str(CLIENT_GONE), trial)
                raise
            if unlisted:  # not served there: the next request for the name picks again
                _settle(pool, replica, call.route.model)
            self._release(replica, tokens, True, str(last.status), trial)
            tried.add(replica.url)
            if move_on:
                log.debug(
                    "request %s: %s has no LoRA adapter %r", call.request_id, replica.url, call.route.model
                )
                continue
            if not self.retry.can_retry(attempt[0]) or (last.acted and not replayable(call)):
                if last.reason:  # the router's own failure, which the client is told without the replica
                    self.request_log.warning("request %s: %s %s", call.request_id, replica.url, last.reason)
                return last
            attempt[0] += 1
            call.retries += 1
            self.metrics.retries.inc()
            self.log_retry(call, replica, last.reason or f"answered {last.status}", attempt[0])
            await asyncio.sleep(self.retry.backoff(attempt[0] - 1, self.rng))

    def log_retry(self, call: ProxyCall, replica: Replica, why: str, attempt: int) -> None:
        self.request_log.warning(
            "request %s: %s %s; re-sent to another replica (retry %d of %d)",
            call.request_id,
            replica.url,
            why,
            attempt,
            self.retry.max_retries,
        )

    @staticmethod
    def _stale_model(replica: Replica, model: str, body: bytes) -> bool:
        """``replica`` answered 404 for ``model``, which its last-read ``/v1/models`` lists: when the
        404 says no such model (it restarted without a LoRA adapter loaded at run time, or another
        router or client unloaded it, since that read), the router's view of it is stale: take the
        model off it and read its list again at its next probe. True when that was so."""
        if not says_no_model(body):
            return False
        replica.models = [m for m in replica.models if m != model]
        replica.lora_resolved.pop(model, None)
        replica.models_read_at = float("-inf")
        log.info("replica %s no longer serves model %r: reading its /v1/models again", replica.url, model)
        return True

    def replica_failed(self, replica: Replica, why: str) -> None:
        """A request failed on ``replica`` (a 5xx, a timeout, a broken answer): its circuit counts it."""
        before = replica.circuit.state
        replica.on_request_failure(self.clock())
        if replica.circuit.state is Circuit.OPEN and before is not Circuit.OPEN:
            log.warning(
                "replica %s: circuit open for %.1f s after %d failed requests (last: %s)",
                replica.url,
                replica.circuit.cooldown,
                replica.circuit.consecutive_failures,
                why,
            )

    async def _send(self, replica: Replica, call: ProxyCall, body: bytes) -> Response | Failed:
        try:
            return await self.client.request(
                call.method,
                replica.url,
                call.url_path,
                call.headers,
                body,
                replica.waiting,
                not replayable(call),
            )
        except ConnectError as e:
            before = replica.health
            replica.on_connect_error(self.clock())
            if replica.health is not before:  # ejected by this request, not by a probe: say so here
                log.warning(
                    "replica %s: %s -> %s (connect error: %s)",
                    replica.url,
                    before.value,
                    replica.health.value,
                    e,
                )
                if not replica.removed:
                    self.metrics.healthy.labels(replica.url).set(0)
            # The client's message names no replica (its address is the router's to know); the
            # reason, with the address, goes to the router's log.
            body = error_body("a replica could not be reached", error_type(502), 502)
            return Failed(502, body, reason=f"unreachable ({e})")
        except UpstreamTimeout:
            self.replica_failed(replica, "timed out")
            body = error_body("a replica timed out", error_type(504), 504)
            return Failed(504, body, reason="timed out", acted=True)
        except UpstreamError as e:
            self.replica_failed(replica, str(e))
            body = error_body(f"a replica failed: {e}", error_type(502), 502)  # (e names no address)
            return Failed(502, body, reason=f"failed ({e})", acted=True)

    def _acquire(self, replica: Replica, tokens: int, now: float) -> int:
        trial = replica.acquire(tokens, now)
        self._show_inflight(replica)
        return trial

    def _release(self, replica: Replica, tokens: int, prefilling: bool, status: str, trial: int) -> None:
        replica.release(tokens, prefilling, trial)
        self._show_inflight(replica)
        self.metrics.requests_of(replica.url, status).inc()

    def _show_inflight(self, replica: Replica) -> None:
        # A removed replica's series is gone (RouterMetrics.forget_replica): setting it would bring
        # it back, for a replica the router no longer has (or over a re-added one's at that URL).
        if not replica.removed:
            self.metrics.inflight_of(replica.url).set(replica.inflight)

    def finish(self, opened: Opened, ok: bool, status: int | None = None) -> None:
        if opened.finished:
            return
        opened.finished = True
        code = status if status is not None else opened.response.status_code
        if code == CLIENT_GONE:  # the client's doing: says nothing about the replica
            self._release(opened.replica, opened.tokens, opened.prefilling, str(CLIENT_GONE), opened.trial)
            return
        if ok and (code < 500 or request_timed_out(code, opened.response.headers)):
            opened.replica.on_request_success()
        elif not ok or counts_as_replica_failure(code):
            self.replica_failed(opened.replica, "broken answer" if not ok else f"answered {code}")
        outcome = str(code) if ok else "broken"
        self._release(opened.replica, opened.tokens, opened.prefilling, outcome, opened.trial)

    # ---- plain relay --------------------------------------------------------------------------
    async def forward(self, pool: Pool, call: ProxyCall, send: Send) -> None:
        """Any route: relay the answer as it arrives, byte for byte."""
        opened = await self.open(pool, call, call.body, set(), [0])
        if isinstance(opened, Failed):
            await send_bytes(send, opened.status, opened.body, with_request_id(opened.headers, call))
            return
        ok = False
        status = CLIENT_GONE  # until the answer starts
        try:
            response = opened.response
            headers = response_headers(response)
            if response.content_length is not None:  # relayed byte for byte: its length holds
                headers.append((b"content-length", b"%d" % response.content_length))
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": with_request_id(headers, call),
                }
            )
            status = response.status_code
            if call.on_answered is not None:
                call.on_answered(opened.replica, response)
            reader = None if call.on_response is None else answer_reader(response)
            async for chunk in response.aiter_raw():
                if reader is not None:
                    reader.add(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            ok = True
            if reader is not None and call.on_response is not None and (obj := reader.result()) is not None:
                call.on_response(obj)
        except TRANSPORT_ERRORS as e:
            # The head (a 200, often) is out. Ending the body now would pass a cut answer off as a
            # whole one: return without its last message instead, so that uvicorn closes the
            # connection with no end of body (no last chunk), which clients report as an error.
            call.broken = True
            log.warning("replica %s broke off its answer to %s: %s", opened.replica.url, call.path, e)
        except asyncio.CancelledError:
            status = CLIENT_GONE
            raise
        finally:
            await opened.response.aclose()
            self.finish(opened, ok, status)

    # ---- generation ---------------------------------------------------------------------------


def replayable(call: ProxyCall) -> bool:
    """Whether sending ``call`` again, to another replica, is harmless once a replica may have acted
    on it (it got the request but gave no answer, or answered 502/504): not for a ``POST`` that
    changes what a replica keeps (a file uploaded, a batch created or cancelled, a response
    cancelled), which is re-sent only when the replica cannot have acted on it (nothing listened;
    it answered 429 or 503). Generation and the other routes that only compute an answer are."""
    return call.method != "POST" or not (is_batch_path(call.path) or call.path.endswith("/cancel"))


def _preferred(route: RouteRequest, candidates: list[Replica]) -> Replica | None:
    if route.prefer_url is None:
        return None
    return next((r for r in candidates if r.url == route.prefer_url), None)


def _no_replica(pool: Pool, now: float, model: str | None = None) -> Failed:
    counts = pool.counts(now)
    serving_model = [r for r in pool if model is not None and model in r.models]
    if counts["total"] == 0:
        message = "no replica is registered with this router yet; retry when one has registered"
    elif serving_model and counts["routable"]:
        message = f"no replica serving model {model!r} is available now ({len(serving_model)} registered)"
    else:
        message = f"no healthy replica available ({counts['total']} registered, none routable now)"
    return Failed(503, error_body(message, error_type(503), 503), [(b"retry-after", b"1")])


async def _read_quietly(response: Response) -> bytes:
    try:
        return await response.aread()
    except TRANSPORT_ERRORS:
        return b""
    finally:
        await response.aclose()


def response_headers(response: Response) -> list[tuple[bytes, bytes]]:
    return [
        (k, response.local_location(v) if k == b"location" else v)
        for k, v in response.headers.raw  # names are lower case
        if k not in RESPONSE_DROP
    ]


def with_request_id(headers: list[tuple[bytes, bytes]], call: ProxyCall) -> list[tuple[bytes, bytes]]:
    return [*headers, (b"x-request-id", call.request_id.encode())]


def says_no_model(body: bytes) -> bool:
    """Whether a 404's body says the model it names does not exist (``model_not_found``)."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and (
        error.get("code") == "model_not_found" or error.get("param") == "model"
    )


def _unlisted(replica: Replica, model: object) -> bool:
    """``model`` is a name ``replica`` does not list, and it resolves LoRA adapters from a directory
    (``pool.serving`` sends such names to such replicas when no replica lists them)."""
    return replica.lora_resolver and isinstance(model, str) and model not in replica.models


def _following(pool: Pool, model: object, candidates: list[Replica]) -> Replica | None:
    """The resolving replica an earlier request for ``model`` (a name no replica lists) was sent to
    and has no answer from yet, when it is one of ``candidates``: this request goes there too, so one
    replica loads the adapter (its own resolver loads it once for both) rather than every replica the
    policy would pick."""
    url, _ = pool.resolving.get(model, (None, 0)) if isinstance(model, str) else (None, 0)
    if url is None:
        return None
    return next((r for r in candidates if r.url == url and _unlisted(r, model)), None)


def _follow(pool: Pool, replica: Replica, model: str) -> None:
    """A request for ``model`` (a name no replica lists) was sent to the resolving ``replica``: the
    next ones follow it there until an answer from it settles the name (``_settle``)."""
    url, sent = pool.resolving.get(model, (replica.url, 0))
    pool.resolving[model] = (replica.url, sent + 1 if url == replica.url else 1)


def _settle(pool: Pool, replica: Replica, model: str, ended: bool = True) -> None:
    """A request for ``model`` sent to ``replica`` is over there. ``ended``: it answered (listed there
    now, or not served there: the next request picks again), or failed; else (the client left)
    requests for the name follow it as long as others sent there have no answer yet."""
    url, sent = pool.resolving.get(model, (None, 0))
    if url != replica.url:
        return
    if ended or sent <= 1:
        del pool.resolving[model]
    else:
        pool.resolving[model] = (url, sent - 1)


def _learn_resolved(pool: Pool, replica: Replica, model: str, status: int, now: float) -> None:
    """A replica that resolves LoRA adapters answered a request naming a model it did not list
    (``_unlisted``). A success says it loaded it (``ferry serve --lora-resolver-dir``): the name is
    listed there at once (``Replica.lora_resolved``), so the next requests for it go there rather
    than to another resolving replica that would load it too, and its ``/v1/models`` is read at its
    next probe (``router/health.py``) for the adapter's card and weights digest."""
    _settle(pool, replica, model)
    if status < 400:
        replica.models = [*replica.models, model]
        replica.lora_resolved[model] = now
        replica.models_read_at = float("-inf")
