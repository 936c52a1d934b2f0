"""The replica's listening socket, taken before the model loads so that a port in use is said at
once: ``listen_unix`` (``--uds``) or ``bind_port`` (TCP, bound but not listening until the server
serves). Used by one-process ``ferry serve`` (``server/main.py``) and by the supervisor of
``--api-server-count`` (``server/api_servers.py``).
"""

from __future__ import annotations

import contextlib
import os
import socket


def listen_unix(path: str) -> socket.socket:
    """``--uds``: the replica's listening Unix socket (the supervisor accepts on it); a stale socket
    file left at ``path`` is replaced."""
    import stat

    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def bind_port(host: str, port: int) -> socket.socket:
    """The replica's TCP socket, bound to ``host:port`` (port 0: a free one), not listening yet:
    connections are refused until the API servers serve (``ConnectionBalancer.start``), as with
    one process. Refused (OSError) if anything else holds the port, another ferry replica
    included."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
    return _bound(sock, host, port)


def _bound(sock: socket.socket, host: str, port: int) -> socket.socket:
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
