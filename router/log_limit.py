"""Log lines about single requests (retries, failovers), kept to a rate a log can take: at most
``burst`` lines per ``window`` seconds, the count of those left out in the next line written. The
class lives in ``kvcache/log_limit.py`` (the KV connector uses it too)."""

from __future__ import annotations

from kvcache.log_limit import RateLimitedLog

__all__ = ["RateLimitedLog"]
