"""Prefill/decode disaggregation: one client request served by a prefill and a decode worker.

The flow (DESIGN.md "A disaggregated request"):

1. The prompt's block hashes come from the router's keyer (``router/prompt_keys.py``, the same
   chat template and ``kvcache.keys`` as the replicas).
2. A prefill worker (``--prefill-policy``) gets the request non-streamed with ``max_tokens=1`` and
   ``kv_transfer={"role": "producer"}`` (with the client's budget fields as ``budget``): it checks
   the request as a replica does (that budget too), computes one token, writes the prompt's blocks
   to the shared tier and answers with the first token and the block hashes. Its 4xx is the
   client's answer. The router validates the client's body first, as a replica does (a field the
   producer request moves, such as the budget, would be checked late there).
3. A streamed request gets that first token at once (the role chunk and the first content chunk
   are written by the router), then a decode worker (``--decode-policy``) is sent the same request
   with ``resume.token_ids = [first]`` and ``kv_transfer={"role": "consumer", "block_hashes": …}``,
   and its chunks are relayed: the hand-off is a resume, exactly like a mid-stream failover, so
   ``router/sse.py``'s ``StreamTracker`` gives the client one stream (same ``id``, one role chunk,
   ``usage`` counting every token sent).

Not disaggregated (served whole by a mixed replica when the cluster has a routable one, else
prefilled locally by the decode worker, as Dynamo's conditional disaggregation does) when: the
prompt's uncached part is shorter than ``--pd-threshold``; no prefill worker is routable or all
are saturated; no decode worker is routable (no prefill is spent on a request nobody could
continue; with no mixed replica either, the answer is the 503 a router without a routable
replica gives; with neither pool routable, reason ``no_worker`` and a 503 that names both pools);
every prefill worker tried failed or timed out; the request names a model (a LoRA adapter) no decode
worker lists while one resolves adapters from a directory or a prefill worker lists it
(``model_not_on_decode``: the first token would reach the client before a decode worker's 404 could;
served whole, it is resolved there, and listed, so the next requests are disaggregated, each worker
loading it from its own directory); no prefill worker has a model the decode pool lists or resolves
(its 404, ``model_not_on_prefill``; these two are served whole by the mixed replicas only when they
list or resolve the model); or the request is one the
hand-off does not cover (``max_tokens`` = 1: it is all prefill; ``n`` > 1, several prompts,
``echo``, client ``logprobs``: their first token would need the prefill worker's per-choice
logprobs and text merged into the decode worker's, which a resume cannot reproduce exactly; chat
``tools`` unless ``tool_choice`` is "none": a tool call's first token is not text the router could
send the client itself; the client's own ``resume`` or ``kv_transfer``, which the hand-off's would
replace: a replica honours them, so the request is served whole).

Failures: a prefill worker that dies or is slower than ``--prefill-timeout`` is replaced by another,
then by local prefill; a tier miss on the decode worker is recomputed there (the replica's job); a
decode worker that dies mid-stream is replaced with ``resume`` carrying every token already sent.

``usage.prompt_tokens_details.cached_tokens`` is the prefill worker's (prompt tokens it did not
compute for this request); the decode worker's tier loads are its own ``/metrics``.
"""

from __future__ import annotations

import json
import time
from functools import partial
from typing import Any

from router.generation import Generation
from router.http import Send, error_body, send_bytes
from router.pd_config import PDConfig, PDMetrics
from router.pd_messages import (
    PDTracker,
    Prefilled,
    first_events,
    merge_answer,
    parse_prefill,
    prefill_body,
    request_error,
    requested_budget,
    wants_disaggregation,
)
from router.policies.cache_aware import CacheAware
from router.pool import Pool, serving
from router.prompt_keys import PromptKeyer, prompt_keys
from router.relay import (
    TRANSPORT_ERRORS,
    Failed,
    Opened,
    ProxyCall,
    response_headers,
    says_no_model,
    with_request_id,
)
from router.replica import Replica
from router.tracing import leg
from server.error_types import error_type
from server.streaming import SSE_HEADERS
from server.tracing import Tracing


class LocalPrefill(Exception):
    """The disaggregated path cannot serve this request now; serve it whole on the decode pool."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PDOrchestrator:
    """Serves generation requests with a prefill pool and a decode pool (module docstring)."""

    def __init__(
        self,
        config: PDConfig,
        prefill: Generation,
        decode: Generation,
        keyer: PromptKeyer | None,
        metrics: PDMetrics,
        block_size: int,
        tracing: Tracing | None = None,
    ) -> None:
        self.tracing = tracing  # a span per leg of a disaggregated request (router/tracing.py)
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self.keyer = keyer
        self.metrics = metrics
        self.block_size = block_size

    # ---- deciding -------------------------------------------------------------------------------
    def _uncached_tokens(self, call: ProxyCall, decode_pool: Pool) -> int:
        route = call.route
        policy = self.decode.policy
        if isinstance(policy, CacheAware) and route.block_hashes:
            matched = policy.index.match(route.block_hashes, [r.url for r in decode_pool])
            return route.prompt_tokens - max(matched.values(), default=0) * self.block_size
        return route.prompt_tokens

    async def _local_reason(self, call: ProxyCall, prefill_pool: Pool, decode_pool: Pool) -> str | None:
        reason = wants_disaggregation(call.path, call.json or {})
        if reason is not None:
            return reason
        if requested_budget(call.path, call.json or {}) == 1:
            return "single_token"  # the whole answer is the prefill: nothing to hand off
        if self.keyer is not None and not call.route.block_hashes:
            # A long prompt's keying goes off the event loop, as the other routes' does.
            hashes, tokens = await prompt_keys(self.keyer, call.path, call.json or {}, len(call.body or b""))
            call.route.block_hashes, call.route.prompt_tokens = hashes, tokens or call.route.prompt_tokens
        if self._uncached_tokens(call, decode_pool) < self.config.pd_threshold:
            return "short_prompt"
        candidates = prefill_pool.candidates(self.prefill.clock())
        if not candidates:
            if not decode_pool.candidates(self.decode.clock()):
                return "no_worker"  # neither pool can take it: the label must not blame one alone
            return "no_prefill_worker"
        if all(r.inflight >= self.config.prefill_max_inflight for r in candidates):
            return "prefill_saturated"
        if not decode_pool.candidates(self.decode.clock()):
            return "no_decode_worker"  # a prefill would be wasted: nobody could continue it
        model = call.route.model
        if isinstance(model, str) and not _lists(model, decode_pool, self.decode.clock()):
            decode = decode_pool.candidates(self.decode.clock())
            if any(r.lora_resolver for r in decode) or any(model in r.models for r in prefill_pool):
                # A LoRA adapter no decode worker lists (yet): the first token would reach the client
                # before a decode worker's 404 could. Served whole, it is resolved there (listed from
                # then on, and later requests disaggregated) or a clean 404.
                return "model_not_on_decode"
        return None

    async def generate(
        self,
        prefill_pool: Pool,
        decode_pool: Pool,
        call: ProxyCall,
        send: Send,
        whole: tuple[Generation, Pool] | None = None,
    ) -> None:
        """``whole``: the mixed replicas (and the Generation that routes to them), when the cluster
        has any: a request that is not disaggregated is served whole there, keeping its prefill off
        the decode workers; without them the decode pool serves it (local prefill)."""
        reason = await self._local_reason(call, prefill_pool, decode_pool)
        prefilled: Prefilled | None = None
        if reason is None:
            error = request_error(call.path, call.body)
            if error is not None:
                body = error.body().model_dump_json().encode()
                await send_bytes(send, error.status, body, with_request_id([], call))
                return
            try:
                with leg(self.tracing, call, "prefill", self.config.prefill_policy):
                    prefilled = await self._prefill(prefill_pool, call, send, decode_pool)
            except LocalPrefill as e:
                reason = e.reason
            if prefilled is None and reason is None:
                return  # the prefill worker's answer (a client error) was relayed
        if prefilled is None:
            self.metrics.fallbacks.labels(reason or "unknown").inc()
            if (
                whole is not None
                and whole[1].candidates(self.decode.clock())
                and (reason not in MODEL_REASONS or _knows(call.route.model, whole[1], self.decode.clock()))
            ):
                self.metrics.requests.labels("mixed").inc()
                await whole[0].generate(whole[1], call, send)
                return
            if reason == "no_worker":
                await self._unavailable(prefill_pool, decode_pool, call, send, whole)
                return
            self.metrics.requests.labels("local_prefill").inc()
            await self.decode.generate(decode_pool, call, send)
            return
        self.metrics.requests.labels("disaggregated").inc()
        started = time.perf_counter()
        try:
            with leg(self.tracing, call, "decode", self.config.decode_policy):
                if (call.json or {}).get("stream"):
                    await self._stream(decode_pool, call, prefilled, send)
                else:
                    await self._whole(decode_pool, call, prefilled, send)
        finally:
            self.metrics.decode_latency.observe(time.perf_counter() - started)

    async def _unavailable(
        self,
        prefill_pool: Pool,
        decode_pool: Pool,
        call: ProxyCall,
        send: Send,
        whole: tuple[Generation, Pool] | None,
    ) -> None:
        """The 503 when no pool has a routable replica. The decode pool's own 503 would count only
        its replicas and say nothing of the prefill pool, which is down too: name every pool."""
        pools = [prefill_pool, decode_pool] + ([whole[1]] if whole is not None else [])
        now = self.decode.clock()
        counted = ", ".join(f"{p.role} pool: {p.counts(now)['total']} registered" for p in pools)
        message = f"no healthy replica available ({counted}; none routable now)"
        body = error_body(message, error_type(503), 503)
        await send_bytes(send, 503, body, with_request_id([(b"retry-after", b"1")], call))

    # ---- prefill --------------------------------------------------------------------------------
    async def _prefill(self, pool: Pool, call: ProxyCall, send: Send, decode_pool: Pool) -> Prefilled | None:
        """The first token, or None when a client error was relayed; LocalPrefill when no worker can."""
        payload = json.dumps(prefill_body(call.json or {})).encode()
        started = time.perf_counter()
        tried: set[str] = set()
        attempt = [0]
        while True:
            opened = await self.prefill.open(pool, call, payload, tried, attempt)
            if isinstance(opened, Failed):
                if opened.status == 404 and self._model_on_decode_only(opened.body, call, decode_pool):
                    raise LocalPrefill("model_not_on_prefill")
                raise LocalPrefill("prefill_failed")
            status = opened.response.status_code
            content = None
            try:
                content = await opened.response.aread()
            except TRANSPORT_ERRORS:
                self.prefill.finish(opened, False)
            finally:
                await opened.response.aclose()
                if content is None:
                    self.prefill.finish(opened, False, 499)  # no-op unless the client left mid-read
            if content is None:
                tried.add(opened.replica.url)
                if not self.prefill.retry.can_retry(attempt[0]):
                    raise LocalPrefill("prefill_failed")
                attempt[0] += 1
                self.prefill.log_retry(call, opened.replica, "broke off its prefill answer", attempt[0])
                continue
            self.prefill.finish(opened, True)
            if status != 200:
                if status >= 500 or status in (408, 429):
                    raise LocalPrefill("prefill_failed")
                if status == 404 and self._model_on_decode_only(content, call, decode_pool):
                    raise LocalPrefill("model_not_on_prefill")
                # The client's error (bad field, prompt too long): a colocated replica says the same.
                await send_bytes(
                    send, status, content, with_request_id(response_headers(opened.response), call)
                )
                return None
            prefilled = parse_prefill(call.path, call.json or {}, content)
            if prefilled is None:
                raise LocalPrefill("prefill_answer_unreadable")
            self.metrics.prefill_latency.observe(time.perf_counter() - started)
            return prefilled

    def _model_on_decode_only(self, body: bytes, call: ProxyCall, decode_pool: Pool) -> bool:
        """A prefill 404 (``body``) says no prefill worker has the request's model, a LoRA adapter
        (not in its resolver directory either) that the decode pool lists or resolves: it is served
        whole there rather than answered 404."""
        return says_no_model(body) and _knows(call.route.model, decode_pool, self.decode.clock())

    # ---- decode, streamed -----------------------------------------------------------------------
    async def _stream(self, pool: Pool, call: ProxyCall, p: Prefilled, send: Send) -> None:
        body = call.json or {}
        chat = call.path.endswith("/chat/completions")
        tracker = PDTracker(chat=chat, client_wants_token_ids=bool(body.get("return_token_ids")))
        tracker.cached_tokens = p.cached_tokens
        done = self._finished_by_prefill(call, p)
        base = self._decode_body(body, p)
        failovers = 0
        tried: set[str] = set()
        opened: Opened | Failed | None = None
        try:
            # A replica's stream headers (``x-accel-buffering: no`` keeps a proxy from holding it back).
            headers = with_request_id(list(SSE_HEADERS), call)
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            out = []
            for event in first_events(call.path, body, p, done):
                relayed = tracker.process(event)
                if relayed is not None:
                    out.append(relayed + b"\n\n")
            if done:
                out.append(b"data: [DONE]\n\n")
            await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
            self.decode.metrics.ttft.observe(time.perf_counter() - call.started)
            if done:
                await send({"type": "http.response.body", "body": b""})
                return
            tracker.begin_failover()  # the hand-off is a resume: same id, no second role chunk, full usage
            opened = await self.decode.open(pool, call, partial(self._decode_payload, base=base), tried, [0])
            while True:
                if isinstance(opened, Failed) or opened.response.status_code != 200:
                    call.broken = True
                    event = await self._stream_error(opened, "no decode worker could continue this request")
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                    break
                ok = await self.decode.pump(opened, tracker, call, send)
                if ok or tracker.done:
                    break
                tried.add(opened.replica.url)
                opened.replica.next_probe_at = self.decode.clock()
                if tracker.finished:
                    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
                    break
                if not tracker.ids_complete or failovers >= self.decode.max_failovers:
                    call.broken = True
                    self.decode.log_stream_failure(call, opened.replica, tracker, None)
                    event = tracker.failure_end() or _error_event(
                        "the decode worker failed and the stream cannot be resumed"
                    )
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                    break
                failovers += 1
                self.decode.metrics.failovers.inc()
                self.decode.log_stream_failure(
                    call, opened.replica, tracker, (failovers, self.decode.max_failovers)
                )
                resumed = tracker.resume_body(base)
                opened = await self.decode.open(
                    pool, call, partial(self._decode_payload, base=resumed), tried, [0]
                )
            await send({"type": "http.response.body", "body": b""})
        finally:
            if isinstance(opened, Opened) and not opened.finished:
                await opened.response.aclose()
                self.decode.finish(opened, False, 499)

    async def _stream_error(self, opened: Opened | Failed | None, fallback: str) -> bytes:
        """The SSE error event for a decode worker that answered with an error (or none answered)."""
        message = fallback
        if isinstance(opened, Opened):
            try:
                content = await opened.response.aread()
                message = json.loads(content)["error"]["message"]
            except (*TRANSPORT_ERRORS, ValueError, KeyError, TypeError):
                pass
            finally:
                await opened.response.aclose()
                self.decode.finish(opened, True)
        elif isinstance(opened, Failed):
            try:
                message = json.loads(opened.body)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
        return _error_event(message)

    def _finished_by_prefill(self, call: ProxyCall, p: Prefilled) -> bool:
        # EOS or a stop string as the first token. (A producer answer that ends on its length
        # holds back what the decode worker will emit: see server/serving_common.delivered_text.)
        return p.finish_reason != "length"

    @staticmethod
    def _decode_body(body: dict[str, Any], p: Prefilled) -> dict[str, Any]:
        return {
            **body,
            "resume": {"token_ids": [p.first_token]},
            "kv_transfer": {"role": "consumer", "block_hashes": p.block_hashes},
        }

    def _decode_payload(self, replica: Replica, base: dict[str, Any]) -> tuple[bytes, bool]:
        """Ask for token ids (``return_token_ids``, or logprobs the relay strips) so a decode
        worker dying mid-stream can be resumed exactly."""
        extra: dict[str, Any] = {"return_token_ids": True}
        router_logprobs = not replica.emits_token_ids
        if router_logprobs:
            chat = "messages" in base
            extra.update(logprobs=True if chat else 0, return_tokens_as_token_ids=True)
        return json.dumps({**base, **extra}).encode(), router_logprobs

    # ---- decode, whole answer -------------------------------------------------------------------
    async def _whole(self, pool: Pool, call: ProxyCall, p: Prefilled, send: Send) -> None:
        if self._finished_by_prefill(call, p):
            await send_bytes(
                send, 200, merge_answer(call.path, call.json or {}, p, None), with_request_id([], call)
            )
            return
        payload = json.dumps(self._decode_body(call.json or {}, p)).encode()

        def merged(status: int, content: bytes) -> bytes:
            return merge_answer(call.path, call.json or {}, p, content) if status == 200 else content

        await self.decode.answer_whole(
            pool, call, payload, send, merged, "decode worker failed while answering"
        )


# Fallback reasons that say a pool lacks the request's model: served whole where it is served.
MODEL_REASONS = frozenset({"model_not_on_decode", "model_not_on_prefill"})


def _lists(model: str, pool: Pool, now: float) -> bool:
    """A replica of ``pool`` that can take a request now lists ``model`` (``pool.serving``'s rules)."""
    return any(model in r.models for r in serving(model, pool.candidates(now), pool))


def _knows(model: object, pool: Pool, now: float) -> bool:
    """A replica of ``pool`` that can take a request now lists ``model``, or resolves LoRA adapters
    from a directory (a name no replica lists is sent there: ``pool.serving``)."""
    if not isinstance(model, str):
        return True
    return any(model in r.models or r.lora_resolver for r in serving(model, pool.candidates(now), pool))


def _error_event(message: str) -> bytes:
    return b"data: " + error_body(message, error_type(502), 502) + b"\n\ndata: [DONE]\n\n"
