"""Weights & Biases: wandb.init with an id derived from the run id and resume="allow" (a rerun continues the same
W&B run), the blueprint as config, metrics against the `iteration` step metric (its step number,
core/metrics.step_numbers, so steps a warm pool committed in its background may land after later ones; a phased
run's step names in the config as verlflow.step.<n>). The API key is read by wandb from WANDB_API_KEY only; nothing
here passes it, and the config is the redacted blueprint params. WANDB_MODE=offline writes the run folder only."""

from __future__ import annotations

import hashlib
import re

from verlflow.core.tracking.tracker import TrackedRun

STEP = "iteration"


def wandb_id(run_id: str) -> str:
    """W&B run ids take letters, digits, - and _; the hash keeps two run ids apart that the cleaning would merge."""
    clean = re.sub(r"[^A-Za-z0-9_-]", "-", run_id)[:64]
    return f"{clean}-{hashlib.sha256(run_id.encode()).hexdigest()[:8]}"


def open_backend(run: TrackedRun) -> "WandbBackend":
    import wandb

    folder = run.local_root
    folder.mkdir(parents=True, exist_ok=True)
    settings = wandb.Settings(console="off", save_code=False, disable_git=True, silent=True,
                              x_disable_stats=True)  # no driver stdout, code or system metrics in the run
    handle = wandb.init(project=run.experiment, entity=run.bp.tracking.wandb_entity, id=wandb_id(run.run_id),
                        name=run.run_id, resume="allow", config=run.params, dir=str(folder),
                        reinit="create_new", settings=settings)
    handle.define_metric(STEP)
    handle.define_metric("*", step_metric=STEP)
    return WandbBackend(handle, f"wandb:{run.bp.tracking.wandb_entity or ''}/{run.experiment}/{handle.id}")


class WandbBackend:
    name = "wandb"

    def __init__(self, handle, target: str):
        self.handle, self.target = handle, target

    def log(self, step: int, values: dict[str, float], wall_s: float, name: str | None = None) -> None:
        if name:  # a phased run's step: its name in the config, by number
            self.handle.config.update({f"verlflow.step.{step}": name}, allow_val_change=True)
        self.handle.log({**values, STEP: step})

    def tag_model(self, iteration: int | str, uri: str, step: int | None) -> None:
        self.handle.summary["verlflow/promoted_model"] = uri
        self.handle.summary["verlflow/promoted_iteration"] = iteration

    def close(self, status: str) -> None:
        self.handle.finish(exit_code=0 if status == "FINISHED" else 1)
