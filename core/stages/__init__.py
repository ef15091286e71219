"""Rank side: the stage workers, each run as `python -m verlflow.core.stages.<stage> job.json` under torchrun (or
by a warm pool, `stages/pool.py`; core/stagespec.py names them), what they share (common: the entry point and the
job; loads: how models are read from files; collect, phase), and the runtime around them (runtime/: context,
models, writes and commits, the warm pool's memory and serve loop, a rank's start and exit).

Under torchrun, a worker asks to die with its parent before anything heavy is imported (verlflow.core.guard); the
runtime's worker_guard does it again with a stricter parent check, for workers outside this package too. Here
only an orphan leaves: other processes that import this package with torchrun's environment (a DataLoader or
compile worker) have a rank, not torchrun, as their parent.
"""

from verlflow.core.guard import die_with_parent, not_orphaned, under_torchrun

if under_torchrun():
    die_with_parent(not_orphaned)

