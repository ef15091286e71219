"""Polling until something is done, cancelled or past a deadline: the one loop the driver's waits share (a GPU
claim, a killed process tree, a Slurm job leaving the queue, a deleted Job's pods, ...). Standard library only:
rank processes use it too.
"""

import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(ready: Callable[[], T], *, interval_s: float, timeout_s: float | None = None,
               cancel: threading.Event | None = None, on_timeout: Callable[[], T] | None = None,
               on_cancel: Callable[[], T] | None = None) -> T | None:
    """Call `ready` every `interval_s` until it returns something truthy, and return that. Past `timeout_s` (None:
    no limit) return on_timeout() (which usually raises), or None; once `cancel` is set, likewise on_cancel().
    `ready` is always asked once more before giving up, so a wait that just succeeded is not reported lost."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if result := ready():
            return result
        if cancel is not None and cancel.is_set():
            return on_cancel() if on_cancel is not None else None
        if deadline is not None and time.monotonic() >= deadline:
            return on_timeout() if on_timeout is not None else None
        if cancel is not None:
            cancel.wait(interval_s)  # a cancel ends the pause at once
        else:
            time.sleep(interval_s)
