"""Rank side: the stage workers, each run as `python -m verlflow.core.stages.<stage> job.json` under torchrun (or
by a warm pool's serve loop, `stages/pool.py`), and what they share (common, committer, agree, modelcache).

Under torchrun, a worker asks to die with its parent before anything heavy is imported (verlflow.core.guard); the
launcher's worker_guard does it again with a stricter parent check, for workers outside this package too. Here
only an orphan leaves: other processes that import this package with torchrun's environment (a DataLoader or
compile worker) have a rank, not torchrun, as their parent.
"""

from verlflow.core.guard import die_with_parent, not_orphaned, under_torchrun

if under_torchrun():
    die_with_parent(not_orphaned)


def module_of(stage: str) -> str:
    """The module torchrun runs for `stage` (or "pool", the warm pool's serve loop): the one place that spells it."""
    return f"{__name__}.{stage}"
