"""What `ferry up`'s supervisor asks its router over HTTP while the cluster starts: whether it
routes to every worker yet (``sees_all``), and which model it serves (``served_model``, for the
"try it" lines). Questions only: nothing here starts, stops or judges the liveness of a child."""

from __future__ import annotations

import http.client
import json
import time

from ferry.cluster.plan import ProcessSpec

PROBE_INTERVAL = 0.5  # seconds between looks at the router while waiting for it
ROUTER_UNREADY_LIMIT = 15.0  # seconds the router may stay unhealthy once it routes to every worker


class StartupFailed(RuntimeError):
    pass


class RouterView:
    def __init__(self, router: ProcessSpec, workers: tuple[ProcessSpec, ...], pools: str) -> None:
        self.router = router
        self.workers = workers
        self.pools = pools  # the pools' roles, for what is said when the router cannot serve them
        self._last_look = -PROBE_INTERVAL
        self._unready_since: float | None = None
        key = _flag_value(router.argv, "--api-key")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def sees_all(self) -> bool:
        """The router's ``/health`` answers 200 and every worker is routable in its
        ``/admin/replicas`` (where that API is closed to us, ``/health`` alone decides). Raises
        ``StartupFailed`` when every worker has long been routable but the router stays unready."""
        now = time.monotonic()
        if now - self._last_look < PROBE_INTERVAL:
            return False
        self._last_look = now
        health, health_body = http_get(self.router, "/health", {})
        status, body = http_get(self.router, "/admin/replicas", self.headers)
        if status != 200:
            return health == 200
        try:
            routable = {r["url"] for r in json.loads(body)["replicas"] if r.get("routable")}
        except (ValueError, KeyError, TypeError, AttributeError):
            return False
        if not all(w.url in routable for w in self.workers):
            return False
        if health == 200:
            return True
        # Every worker routable, yet the router is not ready: it cannot serve these pools.
        if self._unready_since is None:
            self._unready_since = now
        if now - self._unready_since > ROUTER_UNREADY_LIMIT:
            raise StartupFailed(
                f"the router routes to every worker but its /health answers {health}"
                f" ({health_body.decode('utf-8', 'replace').strip()}): this ferry router cannot serve"
                f" the pools {self.pools}"
            )
        return False

    def served_model(self) -> str | None:
        status, body = http_get(self.router, "/v1/models", self.headers)
        try:
            models = json.loads(body)["data"] if status == 200 else []
            return models[0]["id"] if models else None
        except (ValueError, KeyError, TypeError, IndexError):
            return None


def http_get(spec: ProcessSpec, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """GET from a child: (status, body), or (0, b"") when nothing answers."""
    conn = http.client.HTTPConnection(spec.host, spec.port, timeout=2.0)
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    except (OSError, http.client.HTTPException):
        return 0, b""
    finally:
        conn.close()


def _flag_value(argv: tuple[str, ...], flag: str) -> str | None:
    """The value of the last ``flag V`` or ``flag=V`` in ``argv`` (argparse: the last one wins)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value
