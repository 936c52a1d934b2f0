"""The engine loop's thread, started with the torch thread count its engine was built with.

With the OpenMP backend (torch's CPU build) the count is per thread, and a thread takes it, at its
first parallel op, from a process-wide default that every ``torch.set_num_threads`` overwrites. The
KV tier's threads set theirs to one (kvcache/writer.py) as the engine is built, so a loop thread
left to that default would run the model on one thread whatever ``--num-threads`` says.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

PER_THREAD_NUM_THREADS = "parallel backend: OpenMP" in torch.__config__.parallel_info()


def start_loop_thread(target: Callable[[], None], name: str = "ferry-engine-loop") -> threading.Thread:
    """Start ``target`` on a daemon thread whose torch ops use as many threads as the caller's."""
    count = torch.get_num_threads()

    def run() -> None:
        if PER_THREAD_NUM_THREADS:
            torch.get_num_threads()  # the thread's count taken from the default now, not later over this
            torch.set_num_threads(count)
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
