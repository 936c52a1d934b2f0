"""Installs ``bench/trace_hook/burst_events.py`` in a process started with this folder on
PYTHONPATH and ``FERRY_TRACE_DIR`` set (``bench/burst_trace.py`` starts `ferry serve` so: the
supervisor, the engine process and every API server process inherit both)."""

import os

if os.environ.get("FERRY_TRACE_DIR"):
    import burst_events

    burst_events.install(os.environ["FERRY_TRACE_DIR"])
