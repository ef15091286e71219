"""TensorBoard: event files in <tracking root>/tensorboard/<run_id>/ (places.py; a local folder for s3:// stores,
since TensorBoard's own S3 support needs TensorFlow). A rerun appends a new event file to the same folder."""

from __future__ import annotations

from verlflow.core.tracking.tracker import TrackedRun


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

    def log(self, iteration: int, values: dict[str, float], wall_s: float) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, global_step=iteration, walltime=wall_s)
        self.writer.flush()

    def tag_model(self, iteration: int, uri: str) -> None:
        self.writer.add_text("verlflow/promoted_model", uri, global_step=iteration)

    def close(self, status: str) -> None:
        self.writer.add_text("verlflow/status", status)
        self.writer.close()
