"""Timing that leaves out what a process does once (building the CPU kernels, each kernel's
first-use check): a first run's speed is then that of its prompt and its tokens, and the one-time
work is reported apart."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

_one_time = threading.local()  # how deep this thread is in one-time work
_one_time_lock = threading.Lock()
_one_time_total = [0.0]


@contextmanager
def one_time_work():
    """Time what a process does once (a build, a kernel's first-use check), apart from the work it
    came up in: a first run's prompt speed is then the prompt's (see `one_time_seconds`). Nested
    one-time work counts once, in the outermost."""
    depth = getattr(_one_time, "depth", 0)
    _one_time.depth = depth + 1
    started = time.perf_counter()
    try:
        yield
    finally:
        _one_time.depth = depth
        if depth == 0:
            with _one_time_lock:
                _one_time_total[0] += time.perf_counter() - started


def one_time_seconds() -> float:
    """Seconds this process has spent in one-time work so far, all threads together."""
    with _one_time_lock:
        return _one_time_total[0]


class Stopwatch:
    """Seconds since it started, less the one-time work done meanwhile."""

    def __init__(self):
        self.started, self._one_time_at_start = time.perf_counter(), one_time_seconds()

    def one_time(self) -> float:
        """The one-time work done since it started."""
        return one_time_seconds() - self._one_time_at_start

    def elapsed(self) -> float:
        return time.perf_counter() - self.started - self.one_time()
