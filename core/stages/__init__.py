"""Stage workers, each run as `python -m core.stages.<stage> job.json` under torchrun.

Under torchrun, a worker asks to die with its parent before anything heavy is imported: a rank still importing
torch when torchrun is killed would otherwise live on for seconds (core.launcher.worker_guard repeats this).
"""

import os
import sys

if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform == "linux":
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # torchrun already gone
        os._exit(1)
