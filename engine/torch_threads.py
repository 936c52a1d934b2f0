"""Torch intra-op thread counts of one thread at a time, leaving every other thread's alone.

With the OpenMP backend (torch's CPU build) the count is per thread: a thread takes it, at its first
parallel op, from a process-wide default, and ``torch.set_num_threads`` sets the caller's count *and*
overwrites that default (measured with torch 2.13: after a helper thread called
``set_num_threads(1)``, every thread started later computed on one thread). The KV tier's threads
run on one thread (their work is memcpy-shaped, and an OpenMP team of theirs competes with the
model's), so lowering theirs with ``torch.set_num_threads`` made every later thread of the process
(checkpoint reads of a weight update, LoRA adapter reads, the server's ``asyncio.to_thread`` work)
compute on one thread. ``set_this_thread_count`` sets the calling thread's OpenMP count alone, with
OpenMP's own per-thread call: the process default stays the builder's (``--num-threads``), which
only ``torch.set_num_threads`` on the thread that builds the model writes.

MKL's count (matrix products) is not lowered by it: the threads lowered to one do copies only.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)

PER_THREAD_NUM_THREADS = "parallel backend: OpenMP" in torch.__config__.parallel_info()


def _omp_set_num_threads() -> Callable[[int], object] | None:
    """OpenMP's ``omp_set_num_threads`` of the runtime torch uses (libtorch_cpu's dependency), which
    sets the calling thread's count only; None where it cannot be found."""
    if not PER_THREAD_NUM_THREADS:
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        fn = lib.omp_set_num_threads
    except (OSError, AttributeError):
        logger.warning("OpenMP's omp_set_num_threads not found: torch thread counts stay as set")
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = None
    return fn


_OMP_SET = _omp_set_num_threads()


def set_this_thread_count(count: int) -> None:
    """Run the calling thread's torch ops on ``count`` threads, for its life or until changed again,
    without changing the count of any other thread nor the default of threads started later (no-op
    where the count is the process's, or OpenMP cannot be reached)."""
    if _OMP_SET is None:
        return
    torch.get_num_threads()  # the thread's first op: its count is taken from the default now, not over this
    _OMP_SET(count)


@contextmanager
def this_thread_count(count: int) -> Iterator[None]:
    """Run the calling thread's torch ops within the block on ``count`` threads."""
    before = torch.get_num_threads()
    if before == count or _OMP_SET is None:
        yield
        return
    set_this_thread_count(count)
    try:
        yield
    finally:
        set_this_thread_count(before)


def start_loop_thread(target: Callable[[], None], name: str = "ferry-engine-loop") -> threading.Thread:
    """Start ``target`` on a daemon thread whose torch ops use as many threads as the caller's (the
    caller's count may differ from the process default, e.g. a second engine of another count).
    Set with ``torch.set_num_threads``, which sets MKL's count (the model's matrix products) too:
    the default it writes is the count the engine was built with, as the builder's own call wrote."""
    count = torch.get_num_threads()

    def run() -> None:
        if PER_THREAD_NUM_THREADS:
            torch.get_num_threads()  # the thread's count taken from the default now, not later over this
            torch.set_num_threads(count)
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
