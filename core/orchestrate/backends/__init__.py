"""Launch backends: where a stage's torchrun job runs.

- local: torchrun on this machine (verlflow.core.orchestrate.launcher.launch); with nnodes > 1 each node runs its own agent
  (static multi-node: node_rank + a c10d endpoint on node 0).
- slurm: one sbatch job per stage, one srun task per node running torchrun (verlflow.core.orchestrate.backends.slurm).
- kubernetes: one indexed batch/v1 Job + headless Service per stage (verlflow.core.orchestrate.backends.kubernetes).

Every backend has launch's contract: launch(spec, on_line, cancel) -> LaunchResult, and raises StageFailure
(kind, failing rank, traceback) on failure, timeout or cancel, after the job is gone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from verlflow.core.orchestrate.launcher import LaunchResult, LaunchSpec, launch

Launcher = Callable[..., LaunchResult]


def slurm_shared_dir(resources) -> Path:
    """The folder every Slurm node sees: job files, output, torchrun error files."""
    d = resources.slurm.shared_dir or os.path.join(os.getcwd(), ".verlflow", "slurm")
    return Path(d).expanduser().resolve()


def scratch_root(resources) -> Path | None:
    """Where run_stage puts a stage's scratch folder (its job file): None is the system's temp folder."""
    if resources.backend == "slurm":
        root = slurm_shared_dir(resources) / "scratch"
        root.mkdir(parents=True, exist_ok=True)
        return root
    return None


def launcher_for(resources) -> Launcher:
    """launch(spec, on_line=..., cancel=...) for the blueprint's backend."""
    if resources.backend == "slurm":
        from verlflow.core.orchestrate.backends.slurm import SlurmBackend

        return SlurmBackend(resources.slurm, shared_dir=slurm_shared_dir(resources)).launch
    if resources.backend == "kubernetes":
        from verlflow.core.orchestrate.backends.kubernetes import KubernetesBackend

        return KubernetesBackend(resources.kubernetes).launch
    return launch


__all__ = ["LaunchSpec", "launcher_for", "scratch_root", "slurm_shared_dir"]
