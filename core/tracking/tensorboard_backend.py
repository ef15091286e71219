"""TensorBoard: event files in <tracking root>/tensorboard/<run_id>/ (places.py; a local folder for s3:// stores,
since TensorBoard's own S3 support needs TensorFlow). A rerun appends a new event file to the same folder. Scalars
at their step number (core/metrics.step_numbers); a phased run's step names as the text verlflow/step there."""

from __future__ import annotations

from verlflow.core.tracking.tracker import TrackedRun

STEP_TEXT = "verlflow/step"


def log_dir(run: TrackedRun):
    return run.local_root / "tensorboard" / run.run_id


def open_backend(run: TrackedRun) -> "TensorboardBackend":
    from torch.utils.tensorboard import SummaryWriter

    folder = log_dir(run)
    folder.mkdir(parents=True, exist_ok=True)
    writer = SummaryWriter(log_dir=str(folder))
    writer.add_text("verlflow/run_id", run.run_id)
    return TensorboardBackend(writer, f"tensorboard:{folder}")


class TensorboardBackend:
    name = "tensorboard"

    def __init__(self, writer, target: str):
        self.writer, self.target = writer, target

    def log(self, step: int, values: dict[str, float], wall_s: float, name: str | None = None) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, global_step=step, walltime=wall_s)
        if name:  # a phased run's step: its name at its number
            self.writer.add_text(STEP_TEXT, name, global_step=step, walltime=wall_s)
        self.writer.flush()

    def tag_model(self, iteration: int | str, uri: str, step: int | None) -> None:
        self.writer.add_text("verlflow/promoted_model", uri, global_step=step)

    def close(self, status: str) -> None:
        self.writer.add_text("verlflow/status", status)
        self.writer.close()
