"""The parent-death guard: a process that must not outlive its parent asks the kernel to kill it when the parent
goes (Linux's PR_SET_PDEATHSIG), and leaves at once if the parent is already gone.

Both sides use it: a rank under torchrun (first thing, before torch is imported: a rank still importing torch
when torchrun is killed would otherwise live on for seconds), and the launcher's torchrun child between fork and
exec. Standard library only, and cheap to import.
"""

import ctypes
import os
import signal
import sys
from typing import Callable

# A rank prints every thread's Python stack on this signal (faulthandler, installed by its worker_guard); the
# launcher sends it to a job stopped for its timeout, so a hang says where each rank waited.
STACK_SIGNAL = signal.SIGUSR1

_PR_SET_PDEATHSIG = 1
# Resolved at import: in a preexec_fn (after fork, before exec) the call itself must stay trivial.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def die_with_parent(parent_ok: Callable[[int], bool] | None = None) -> None:
    """SIGKILL this process when the thread that started it ends; then, if `parent_ok(parent pid)` is false (the
    parent died before the request: we were re-parented), leave now with exit code 1."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent_ok is not None:
        leave_if_parent_gone(parent_ok)


def leave_if_parent_gone(parent_ok: Callable[[int], bool]) -> None:
    """Exit now (code 1, no clean-up) unless `parent_ok(parent pid)`: for a wait that must end with its parent."""
    if not parent_ok(os.getppid()):
        os._exit(1)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def not_orphaned(ppid: int) -> bool:
    return ppid != 1


def is_torchrun(pid: int) -> bool:
    """Whether `pid` runs torchrun (a re-parented rank's parent is init or a subreaper instead)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"torch.distributed.run" in cmdline or b"torchrun" in cmdline
