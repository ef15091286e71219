"""StageContext: what a stage worker's `run(ctx)` gets: its job, blueprint, store, rank, output folder, inputs,
timings, models (`ctx.models`) and writes (`ctx.write`)."""

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from verlflow.core.blueprint import Blueprint, PhaseSpec
from verlflow.core.job import InputRecord, JobSpec
from verlflow.core.ml.placement import Placement
from verlflow.core.stages.runtime.commit import Writes
from verlflow.core.store import retention
from verlflow.core.store.artifacts import ArtifactStore

if TYPE_CHECKING:
    from verlflow.core.stages.runtime.models import Models


@dataclass
class StageContext:
    job: JobSpec
    bp: Blueprint
    store: ArtifactStore
    rank: int
    world: int
    local_rank: int
    device: torch.device
    out: Path
    write: Writes  # ctx.write(fn): a file write, run now or by the stage's background commit (the runtime's choice)
    timings: dict = field(default_factory=dict)
    models: "Models" = None  # ctx.models: the stage's models, from a warm pool's memory or their checkpoints
    _inputs: dict = field(default_factory=dict, repr=False)

    @property
    def iteration(self):
        return self.job.iteration

    @property
    def phase(self) -> PhaseSpec | None:
        """The phase this step runs (JobSpec.phase), None outside a run of phases."""
        return None if self.job.phase is None else self.bp.phases[self.job.phase]

    def input(self, name: str) -> Path:
        """Local folder of a committed input stage, checksums verified (once per node and job: every rank asks for
        the same inputs in the same order, so a second call returns it without collectives). An input still
        committing in this pool's background: in a local store, its folder once its files are written (this pool
        wrote them, and its commit digests them); in a remote one, after its commit."""
        if name not in self._inputs:
            self._inputs[name] = self._input(name)
        return self._inputs[name]

    def _input(self, name: str) -> Path:
        key = self.job.inputs[name]
        if name in self.job.pending_inputs:
            folder = self.store.local_path(key)
            self.write.committer.wait(key, written=folder is not None)
            if folder is not None:
                return folder
        manifest = self.store.read_manifest(key)  # on every rank: each raises, none waits in the barrier below
        if manifest is not None and (gone := retention.needed_pruned(self.job.stage, name, manifest)):
            raise self.store.pruned_error(key, gone)
        cache = Path(self.job.scratch) / "inputs" / name
        path = None
        if self.local_rank == 0:
            path = self.store.materialize(key, cache)
        if self.world > 1:
            dist.barrier()
        return path if path is not None else self.store.local_path(key) or cache

    def input_manifest(self, name: str) -> InputRecord:
        return self.job.input_manifests[name]

    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def placement(self) -> Placement:
        return Placement(self.rank, self.world, self.device)

    def timed(self, name: str):
        return _Timer(self.timings, name)


class _Timer:
    def __init__(self, into: dict, name: str):
        self.into, self.name = into, name

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.into[self.name] = round(self.into.get(self.name, 0.0) + time.perf_counter() - self.t0, 4)
