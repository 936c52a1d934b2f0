"""`ferry router`: build the app from the flags and serve it with uvicorn."""

from __future__ import annotations

import argparse
import gc
import logging
import socket
import sys
from types import FrameType

import uvicorn

logger = logging.getLogger("ferry.router")
# How long an idle client connection stays open. A proxy in front that pools connections to the
# router must drop its idle ones sooner (deploy/nginx: keepalive_timeout), or it can send a
# request down one the router is closing that instant, and answer its client 502.
KEEP_ALIVE_S = 60


class _Server(uvicorn.Server):
    """uvicorn that treats SIGTERM/SIGINT as "drain, then exit 0".

    uvicorn closes the listeners and waits up to ``timeout_graceful_shutdown`` (the router's
    ``--drain-timeout``) for in-flight requests; a second signal stops at once. Not recording
    the signal keeps uvicorn from re-raising it at exit, so a drained router exits with 0.
    """

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
            return
        logger.warning(
            "signal %d: draining in-flight requests (up to %.1f s)",
            sig,
            self.config.timeout_graceful_shutdown,
        )
        self.should_exit = True


def run_router(args: argparse.Namespace) -> int:
    from router.app import RouterApp
    from router.config import RouterConfig
    from router.pd_config import PDConfig
    from server.http_limits import HttpLimits, uvicorn_options

    try:
        config = RouterConfig.from_args(args)
        logging.basicConfig(
            level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        app = RouterApp(config, pd=PDConfig.from_args(args))
    except (ValueError, OSError) as e:  # flags out of range, a --model without a tokenizer: no traceback
        print(f"ferry router: error: {e}", file=sys.stderr)
        return 2
    from starlette.middleware.cors import CORSMiddleware

    # Outermost: a browser's preflight is answered before the API key is asked for.
    front = CORSMiddleware(
        app,
        allow_origins=list(config.allowed_origins),
        allow_methods=list(config.allowed_methods),
        allow_headers=list(config.allowed_headers),
        allow_credentials=config.allow_credentials,
    )
    uv_config = uvicorn.Config(
        front,
        host=config.host,
        port=config.port,
        uds=config.uds,
        root_path=config.root_path,
        log_level=config.log_level,
        access_log=False,
        lifespan="on",
        **uvicorn_options(HttpLimits(config.header_timeout, config.max_header_bytes)),
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=config.drain_timeout,
    )
    # Taken here, not by uvicorn, so a port in use (or a host that does not resolve) is one line
    # and exit 2, as for `ferry serve`, rather than uvicorn's log line and exit 3.
    sockets = None
    if not config.uds:
        try:
            sockets = [_bind(config.host, config.port)]
        except (OSError, OverflowError) as e:
            where = f"{config.host}:{config.port}"
            print(
                f"ferry router: error: cannot listen on {where}: {getattr(e, 'strerror', None) or e}",
                file=sys.stderr,
            )
            return 2
    # What startup built lives as long as the process: keep it out of the cyclic GC's full
    # collections, which would otherwise scan it (and stall every relayed stream) each time.
    gc.collect()
    gc.freeze()
    _Server(uv_config).run(sockets=sockets)
    return 0


def _bind(host: str, port: int) -> socket.socket:
    """The router's TCP socket bound to ``host:port``, as uvicorn would bind it (it listens)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock
