"""The admin API: list, add, drain and remove replicas at run time.

``GET /admin/replicas``; ``POST /admin/replicas`` ``{"url", "role"}``;
``POST /admin/replicas/drain`` ``{"url"}`` (no new requests, in-flight ones finish);
``DELETE /admin/replicas`` ``{"url"}`` (or ``?url=``). Guarded by ``--api-key`` (Bearer); with no key
only loopback clients may use it. A replica's view carries ``lora_pending``: the adapter restores and
unloads the router still owes it, when they are tried next, and the adapters it lists under another
path than the router's (``router/lora_admin.py``); the list's ``lora``: the adapters the router
restores, each ``loaded`` through it or ``adopted`` from a replica, those it will not adopt because
its last word on them was an unload, and the names replicas list under different paths
(``router/lora_learn.py``). Bodies are validated here, at the edge, with clear 4xx answers.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from router.discovery import ROLES
from router.http import (
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    bearer_ok,
    read_body,
    send_error,
    send_json,
)

if TYPE_CHECKING:
    from router.app import RouterApp
    from router.replica import Replica

_LOOPBACK = {"127.0.0.1", "::1", "localhost"}
_ADMIN_BODY_LIMIT = 64 << 10


async def handle_admin(app: RouterApp, scope: Scope, receive: Receive, send: Send) -> None:
    key = app.config.api_key
    if key is not None:
        if not bearer_ok(scope, key):
            await send_error(send, 401, "missing or wrong API key (Authorization: Bearer …)")
            return
    elif (scope.get("client") or ("",))[0] not in _LOOPBACK:
        await send_error(send, 403, "the admin API needs --api-key when used from another host")
        return

    path, method = scope["path"].rstrip("/"), scope["method"]
    now = app.clock()
    if path == "/admin/replicas" and method == "GET":
        replicas = [_describe(app, r, now) for r in app.replicas]
        await send_json(send, 200, {"replicas": replicas, "lora": app.lora.learn.view()})
        return
    if path not in ("/admin/replicas", "/admin/replicas/drain"):
        await send_error(send, 404, f"no admin route {path}")
        return
    if method not in ("POST", "DELETE") or (path.endswith("/drain") and method != "POST"):
        await send_error(send, 405, f"{method} is not allowed on {path}")
        return

    try:
        body = await _json_body(scope, receive)
    except BodyTooLarge:
        await send_error(send, 413, "admin request body too large")
        return
    except ClientGone:
        return
    except ValueError as e:
        await send_error(send, 400, str(e))
        return
    url = body.get("url")
    if not isinstance(url, str) or not url.strip():
        await send_error(send, 400, "'url' (a replica base URL such as http://10.0.0.7:8000) is required")
        return

    if path.endswith("/drain"):
        r = app.replicas.drain(url)
        if r is None:
            await send_error(send, 404, f"no replica {url}")
            return
        app.metrics.healthy.labels(r.url).set(0)
        await send_json(send, 200, _describe(app, r, now))
    elif method == "DELETE":
        r = app.replicas.remove(url)
        if r is None:
            await send_error(send, 404, f"no replica {url}")
            return
        await send_json(send, 200, {"removed": r.url})
    else:
        role = body.get("role", "mixed")
        if role not in ROLES:
            await send_error(send, 400, f"'role' must be one of {', '.join(ROLES)}")
            return
        try:
            r, created = app.replicas.add(url, role, source="admin")
        except ValueError as e:
            await send_error(send, 409 if "already" in str(e) else 400, str(e))
            return
        await app.health.probe(r, timeout=2.0)
        await send_json(send, 201 if created else 200, _describe(app, r, app.clock()))


def _describe(app: RouterApp, replica: Replica, now: float) -> dict[str, Any]:
    return {**replica.describe(now), "lora_pending": app.lora.pending(replica)}


async def _json_body(scope: Scope, receive: Receive) -> dict[str, Any]:
    raw = await read_body(receive, _ADMIN_BODY_LIMIT)
    if not raw.strip():
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        return {k: v[0] for k, v in query.items()}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"request body is not valid JSON: {e}") from e
    except RecursionError:  # [[[[…: a 400 as any other body that does not parse, not a 500
        raise ValueError("request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return body
