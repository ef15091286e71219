"""The job spec: what the runner (driver) tells a stage worker (rank) to do, written once as job.json by
verlflow.core.orchestrate.runner and read once by verlflow.core.stages.common. Both processes import it."""

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from verlflow.core.blueprint import Blueprint


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputRecord(_Spec):
    """What a stage knows of a committed input without reading its manifest again."""
    key: str
    metrics: dict = Field(default_factory=dict)
    lineage: list = Field(default_factory=list)


class InputRef(_Spec):
    stage: str  # its store path
    key: str


class ManifestDraft(_Spec):
    """The manifest fields the runner decides; the worker adds metrics, timings, env and world size, then commits."""
    stage: str
    run_id: str
    iteration: int | str
    key: str
    inputs: dict[str, InputRef]
    blueprint_hash: str
    blueprint_name: str
    code_version: str
    lineage: list


class JobSpec(_Spec):
    stage: str
    run_id: str
    iteration: int | str
    output: str  # the stage's store path
    scratch: str  # the job's local folder (a remote store's outputs are written there first)
    blueprint: Blueprint
    phase: int | None = None  # the index in blueprint.phases of the phase this step runs (None: no phases)
    inputs: dict[str, str]  # input name -> store path
    input_manifests: dict[str, InputRecord]
    manifest: ManifestDraft
    launched_at: float  # when the runner launched it (the worker's timings start there)
    # Inputs still committing in this job's warm pool's background: the worker waits for them where it reads them.
    pending_inputs: list[str] = Field(default_factory=list)
    # What the run's retention passes keep for the plan (pipeline.checkpoint_reads): the driver knows the plan.
    checkpoint_reads: list[tuple[str | None, str]] = Field(default_factory=list)
    # The runner's one retry after an out-of-memory error (resources.oom_retry): the stage's micro-batches at half
    # (core/checks/memplan.py at_half).
    oom_retry: bool = False

    @property
    def name(self) -> str:
        return f"{self.stage}[{self.iteration}]"

    def write(self, path: Path) -> Path:
        path.write_text(self.model_dump_json())
        return path

    @classmethod
    def read(cls, path: Path) -> "JobSpec":
        return cls.model_validate_json(path.read_text())
