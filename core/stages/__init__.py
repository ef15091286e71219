"""Rank side: the stage workers, each run as `python -m verlflow.core.stages.<stage> job.json` under torchrun (or
by a warm pool's serve loop, `stages/pool.py`), and what they share (common, committer, agree, modelcache).

Under torchrun, a worker asks to die with its parent before anything heavy is imported: a rank still importing
torch when torchrun is killed would otherwise live on for seconds (orchestrate/launcher.py's worker_guard repeats
this, for workers outside this package).
"""

import os
import sys

if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform == "linux":
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # torchrun already gone
        os._exit(1)


def module_of(stage: str) -> str:
    """The module torchrun runs for `stage` (or "pool", the warm pool's serve loop): the one place that spells it."""
    return f"{__name__}.{stage}"
