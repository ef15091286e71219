"""Experiment tracking (driver side): the run's parameters and every committed step's metrics go to the trackers
the blueprint names (tracking.backends: mlflow, tensorboard, wandb), one backend per module behind one Tracker
that verlflow.core.orchestrate.pipeline.run_pipeline drives.

- One tracker run per verlflow run: a rerun or a Prefect Retry resumes it (MLflow: the run tagged
  verlflow.run_id; W&B: an id derived from the run id; TensorBoard: the same log folder).
- A step's metrics are logged at its step number (core/metrics.step_numbers: the iteration; a phased run's steps,
  named evaluate[base], sft[sft.1], in plan order) with, in a phased run, its name beside the number.
- The blueprint's values are params one a field, redacted (core/tracking/params.py, core/redact.py).
- A step is logged once: the ledger `tracking/<run_id>.json` in the artifact store records, per backend
  destination, the commit (committed_at) of each step logged there; a reused stage already logged is not logged
  again, a recomputed one (--from) is logged anew, one a failed backend missed is logged by the next rerun.
- A tracker that fails mid-run (a server down) is dropped with one warning: training goes on, untracked there.
"""

from verlflow.core.tracking.places import mlflow_run_url, summary_lines
from verlflow.core.tracking.tracker import Tracker, tracked

__all__ = ["Tracker", "tracked", "mlflow_run_url", "summary_lines"]
