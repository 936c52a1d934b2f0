"""POST /v1/completions and /v1/chat/completions are served by ``GenerationRoutes``, around
FastAPI's request machinery: every answer and every error must be what FastAPI's own route
handlers give for the same body, and FastAPI must still declare both routes (OpenAPI schema).

Two apps over one engine, each under a real uvicorn on loopback: the app as ``build_app`` makes
it, and the same app with the fast path taken out, so FastAPI's handlers serve.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from server.app import build_app
from server.config import ServerConfig
from server.errors import validation_error
from server.generation_routes import ROUTES, GenerationRoutes
from tests.server.error_cases import CASES, CHAT, COMP, USER, bodies

CONFIG = ServerConfig(served_model_name="m")


@pytest.fixture(scope="module")
async def engine(tiny_llama) -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    yield eng
    await eng.shutdown()


def _fastapi_only(app):
    """The same app with FastAPI's route handlers serving the generation routes."""
    app.user_middleware = [m for m in app.user_middleware if m.cls is not GenerationRoutes]
    return app


def _comparable(body: dict) -> dict:
    """An answer without the parts that differ between any two calls (id, creation time)."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


async def _sse(client: httpx.AsyncClient, path: str, body: dict) -> tuple[dict, dict]:
    """A stream folded per choice (text, logprob tokens and values, token ids, finish reason), and
    its usage chunk: where chunk boundaries fall is timing (a writer behind the engine folds
    deltas), what they carry is not."""
    folded: dict[int, dict] = {}
    usage = {}
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for c in event["choices"]:
                f = folded.setdefault(c["index"], {"text": "", "tokens": [], "logprobs": [], "ids": []})
                f["text"] += c["delta"].get("content", "") if "delta" in c else c["text"]
                f["ids"] += c.get("token_ids") or []
                lp = c.get("logprobs") or {}
                for entry in lp.get("content") or []:  # chat
                    f["tokens"].append(entry["token"])
                    f["logprobs"].append(entry["logprob"])
                f["tokens"] += lp.get("tokens") or []  # completions
                f["logprobs"] += lp.get("token_logprobs") or []
                f["finish_reason"] = c.get("finish_reason") or f.get("finish_reason")
    return folded, usage


async def test_answers_and_errors_match_fastapis_own_routes(engine, serve_app) -> None:
    fast, slow = build_app(engine, CONFIG), _fastapi_only(build_app(engine, CONFIG))
    async with (
        serve_app(fast) as fast_url,
        serve_app(slow) as slow_url,
        httpx.AsyncClient(base_url=fast_url, timeout=60) as f,
        httpx.AsyncClient(base_url=slow_url, timeout=60) as s,
    ):
        for path, body, status, param, code in CASES:
            if path not in ROUTES:
                continue
            raw = json.dumps(body)  # NaN included, as test_errors sends it
            a, b = await f.post(path, content=raw), await s.post(path, content=raw)
            assert (a.status_code, a.json()) == (b.status_code, b.json()), (path, body)
            assert a.status_code == status and a.json()["error"]["param"] == param
            assert a.json()["error"]["code"] == code

        # JSON that pydantic's parser and json.loads read alike (NaN, duplicate keys, huge ints)
        for raw in (
            b'{"prompt": "x", "temperature": NaN}',
            b'{"prompt": "x", "max_tokens": 1e400}',
            b'{"prompt": "x", "prompt": 5}',
            b'{"prompt": "x", "max_tokens": 100000000000000000000000}',
            b'{"prompt": "x", "max_tokens": 2.0}',
            b'{"messages": [{"role": "user", "content": "hi"}], "n": true}',
        ):
            path = CHAT if b"messages" in raw else COMP
            a, b = await f.post(path, content=raw), await s.post(path, content=raw)
            assert a.status_code == b.status_code == 400 and a.json() == b.json(), raw

        # Not JSON, or not an object: the same status, type and code; pydantic's parser words
        # the message its own way (and says where).
        for raw in (b"{", b"[]", b"null", b'"text"', b"\xff\xfe", b"{" * 5000 + b"}" * 5000):
            for path in ROUTES:
                a, b = (
                    (await f.post(path, content=raw)).json()["error"],
                    (await s.post(path, content=raw)).json()["error"],
                )
                assert (a["type"], a["code"], a["param"]) == (b["type"], b["code"], b["param"]), raw
        err = (await f.post(COMP, content=b'{"prompt": "x",')).json()["error"]
        assert err["code"] == "invalid_json" and "line 1 column" in err["message"]

        # Answers, whole and streamed
        requests = [
            (COMP, {"prompt": "hello there", "max_tokens": 5, "temperature": 0, "logprobs": 2}),
            (COMP, {"prompt": [5, 6, 7], "max_tokens": 4, "n": 2, "seed": 3, "return_token_ids": True}),
            (
                CHAT,
                {"messages": USER, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 1},
            ),
        ]
        for path, body in requests:
            a, b = await f.post(path, json=body), await s.post(path, json=body)
            assert a.status_code == b.status_code == 200
            assert _comparable(a.json()) == _comparable(b.json())
            assert a.headers["content-type"] == b.headers["content-type"] == "application/json"
            stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
            (fast_choices, fast_usage), (slow_choices, slow_usage) = (
                await _sse(f, path, stream),
                await _sse(s, path, stream),
            )
            assert fast_choices == slow_choices and len(fast_choices) == body.get("n", 1)
            assert fast_usage == slow_usage and fast_usage["completion_tokens"] > 0
        # the request id is still echoed (EdgeMiddleware wraps the fast path)
        r = await f.post(COMP, json={"prompt": "x", "max_tokens": 1}, headers={"x-request-id": "abc-1"})
        assert r.headers["x-request-id"] == "abc-1" and r.json()["id"] == "cmpl-abc-1"
    assert engine.announced == 0


async def test_fastapi_declares_the_routes_but_does_not_serve_them(engine, serve_app) -> None:
    app = build_app(engine, CONFIG)
    async with serve_app(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            schema = (await client.get("/openapi.json")).json()
            assert set(ROUTES) <= set(schema["paths"])
            assert "post" in schema["paths"][COMP] and "post" in schema["paths"][CHAT]
            # Take FastAPI's generation routes away: the fast path still serves both.
            app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) not in ROUTES]
            sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
            done = await sdk.completions.create(model="m", prompt="hi", max_tokens=3, temperature=0)
            assert done.usage.completion_tokens == 3
            chat = await sdk.chat.completions.create(model="m", messages=USER, max_tokens=2)
            assert chat.usage.completion_tokens == 2
            # ... and only those: a route FastAPI lost is gone, other routes are FastAPI's as before
            assert (await client.get("/v1/models")).status_code == 200
            assert (await client.get(COMP)).status_code == 404


def _outcome(validate, data):
    try:
        return "ok", validate(data)
    except ValidationError as e:
        error = validation_error(e.errors(include_url=False))
        return error.status, error.param, error.code


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(body=bodies, path=st.sampled_from(sorted(ROUTES)))
def test_json_validation_agrees_with_fastapis_for_any_body(body: object, path: str) -> None:
    """The fast path validates the raw body in pydantic's JSON mode; FastAPI parses it with
    json.loads and validates the result in Python mode. For any JSON object (the fuzz's malformed
    and near-valid bodies) both must accept the same request, or refuse it naming the same field
    with the same code."""
    model = ROUTES[path][0]
    raw = json.dumps(body, allow_nan=False)
    fast = _outcome(model.model_validate_json, raw)
    if not isinstance(body, dict):  # FastAPI reads a non-object body as the whole model's input
        assert fast[0] == 400
        return
    assert fast == _outcome(model.model_validate, json.loads(raw)), raw


async def test_requests_do_not_consult_opentelemetry(engine, serve_app, monkeypatch) -> None:
    """FastAPI (0.165 on) asks OpenTelemetry's global providers on every request whether to trace
    it; ferry exports no OpenTelemetry, so its app has that off: a request asks nothing."""
    trace = pytest.importorskip("opentelemetry.trace")
    metrics = pytest.importorskip("opentelemetry.metrics")
    asked: list[str] = []
    for module, name in ((trace, "get_tracer_provider"), (metrics, "get_meter_provider")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda real=real, name=name: asked.append(name) or real())
    async with (
        serve_app(build_app(engine, CONFIG)) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        r = await client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1})
        assert r.status_code == 200 and (await client.get("/v1/models")).status_code == 200
    assert asked == []
