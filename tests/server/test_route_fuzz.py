"""Every route the replica serves, fuzzed: no body, header or method a client sends gets a 5xx.

The route list comes from the live server's own OpenAPI document, so a route added later is
fuzzed without this file changing (a new route missing from the document fails
``test_openapi_lists_the_routes``). Each POST route gets hypothesis-built JSON bodies: arbitrary
JSON, and objects whose keys are the route's own field names (from its schema, or every field name
any route knows when the route reads its body by hand) with arbitrary values, so the values reach
the route's validation rather than stopping at "not an object". Whatever the answer, it is below
500 and, when an error, in the route's error shape (Anthropic's on ``/v1/messages``, OpenAI's
elsewhere). Valid bodies are kept cheap (a few tokens). After the fuzz the server still generates.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Routes whose fuzzing would change the shared server for the tests after this one.
_SKIP = frozenset({"/reset_prefix_cache"})
# Routes that read no body (SageMaker's health check answers any POST).
_BODYLESS = frozenset({"/ping"})
# Routes every replica must serve (the document must not lose them).
_EXPECTED = frozenset(
    "/v1/completions /v1/chat/completions /v1/embeddings /v1/responses /v1/messages"
    " /v1/messages/count_tokens /tokenize /detokenize /score /rerank /classify /invocations"
    " /v1/completions/render /v1/chat/completions/render /inference/v1/generate".split()
)
_USER = [{"role": "user", "content": "hi"}]
# A valid body per route: fuzzed keys are laid over it, so most values reach the route's deeper
# checks (and many requests run) instead of stopping at a missing required field.
_VALID: dict[str, dict] = {
    "/v1/completions": {"prompt": "hi"},
    "/invocations": {"prompt": "hi"},
    "/v1/chat/completions": {"messages": _USER},
    "/v1/completions/render": {"prompt": "hi"},
    "/v1/chat/completions/render": {"messages": _USER},
    "/inference/v1/generate": {"token_ids": [1, 2], "sampling_params": {"max_tokens": 3}},
    "/v1/responses": {"input": "hi"},
    "/v1/messages": {"model": "MODEL", "messages": _USER},
    "/v1/messages/count_tokens": {"model": "MODEL", "messages": _USER},
    "/v1/embeddings": {"input": "hi"},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
    "/score": {"text_1": "a", "text_2": "b"},
    "/v1/score": {"text_1": "a", "text_2": "b"},
    "/rerank": {"query": "a", "documents": ["b"]},
    "/v1/rerank": {"query": "a", "documents": ["b"]},
    "/v2/rerank": {"query": "a", "documents": ["b"]},
    "/classify": {"input": "hi"},
    "/v1/classify": {"input": "hi"},
}
_CAPS = {"max_tokens": 3, "max_completion_tokens": 3, "max_output_tokens": 3, "n": 2, "best_of": 2}


def _properties(schema: dict, components: dict, seen: frozenset[str] = frozenset()) -> set[str]:
    """Field names of a (possibly referenced, combined) JSON schema object."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return set() if name in seen else _properties(components.get(name, {}), components, seen | {name})
    names = set(schema.get("properties", {}))
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key, []):
            names |= _properties(sub, components, seen)
    return names


@pytest.fixture(scope="module", autouse=True)
def _clean_cache_after(server):
    """The fuzz's prompts leave cached (partial) blocks on the shared server: none for later tests."""
    yield
    httpx.post(server.url + "/reset_prefix_cache", timeout=60)


@pytest.fixture(scope="module")
def routes(server) -> dict[str, list[str]]:
    """POST route → its body's field names, from the server's OpenAPI document."""
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    components = doc.get("components", {}).get("schemas", {})
    out: dict[str, list[str]] = {}
    for path, ops in doc["paths"].items():
        post = ops.get("post")
        if post is None or path in _SKIP or "{" in path:
            continue
        content = post.get("requestBody", {}).get("content", {}).get("application/json", {})
        out[path] = sorted(_properties(content.get("schema", {}), components))
    every = sorted({name for names in out.values() for name in names})
    return {path: names or every for path, names in out.items()}


def test_openapi_lists_the_routes(routes) -> None:
    assert _EXPECTED <= set(routes), sorted(_EXPECTED - set(routes))


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(max_size=12),
)
# Values a field plausibly takes (small numbers, short texts, token ids, messages), beside any JSON.
_plausible = st.one_of(
    st.integers(min_value=-2, max_value=6),
    st.floats(min_value=-1, max_value=3, allow_nan=False),
    st.sampled_from(["", "hi", "auto", "none", "json_object", "stop", "user", "MODEL"]),
    st.lists(st.integers(min_value=-1, max_value=300), max_size=4),
    st.lists(st.text(max_size=4), max_size=3),
    st.just(_USER),
    st.dictionaries(
        st.sampled_from(["type", "name", "include_usage", "role"]), st.text(max_size=6), max_size=2
    ),
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _capped(body: object) -> object:
    if isinstance(body, dict):
        for key, cap in _CAPS.items():
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                body[key] = cap
        body.setdefault("max_tokens", 3)
    return body


@st.composite
def _request(draw, routes: dict[str, list[str]], model: str) -> tuple[str, object]:
    path = draw(st.sampled_from(sorted(routes)))
    names = routes[path]
    values = st.one_of(_plausible, _plausible, _json)
    fields = st.dictionaries(st.sampled_from(names), values, max_size=2) if names else st.just({})
    base = {k: model if v == "MODEL" else v for k, v in _VALID.get(path, {}).items()}
    mode = draw(st.sampled_from(["over_valid", "over_valid", "over_valid", "fields", "any"]))
    body = draw(_json) if mode == "any" else draw(fields)
    if mode == "over_valid":
        body = {**base, **body}
    if isinstance(body, dict) and body.get("model") == "MODEL":
        body["model"] = model
    return path, _capped(body)


def _assert_error_shape(path: str, r: httpx.Response) -> None:
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and isinstance(body["error"]["message"], str), body
        return
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


# Derandomized: the same bodies every run, so a failure reproduces (and later tests meet the same server).
@settings(
    max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True
)
@given(data=st.data())
def test_every_post_route_never_5xx(server, routes, data) -> None:
    path, body = data.draw(_request(routes, server.model_name))
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code >= 400:
        _assert_error_shape(path, r)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_every_post_route_rejects_non_json_bodies(server, routes, content_type) -> None:
    headers = {"content-type": content_type} if content_type else {}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path in sorted(set(routes) - _BODYLESS):
            r = http.post(path, content=b"\x00\xffnot json{", headers=headers)
            assert 400 <= r.status_code < 500, (path, content_type, r.status_code, r.text)
            _assert_error_shape(path, r)


def test_wrong_methods_are_4xx(server, routes) -> None:
    declared = httpx.get(server.url + "/openapi.json", timeout=30).json()["paths"]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path in sorted(routes):
            for method in {"GET", "PUT", "DELETE", "PATCH"} - {m.upper() for m in declared[path]}:
                r = http.request(method, path)
                assert 400 <= r.status_code < 500, (method, path, r.status_code, r.text)


def test_server_still_generates_after_the_fuzz(server) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(server.url + "/health").status_code == 200
