"""Metric names, one namespace for everything that reads a stage's metrics: promotion (promote.metric), the
trackers (MLflow, TensorBoard, W&B), the report's figures and `verlflow compare`.

A name is `<prefix>/<metric>`: the prefix says which stage of the iteration measured it, the rest is the key of
that stage's manifest `metrics`, e.g. rollout/reward_mean, update/kl_loss, eval/accuracy (all data sources) and
eval/openai/gsm8k/accuracy (one data source; the evaluate stage names its per-source metrics `<source>/<metric>`).
"""

from __future__ import annotations

import math

from verlflow.core.store.artifacts import ArtifactStore, stage_key

PREFIX = {"rollout": "rollout", "update": "update", "evaluate": "eval"}


def flat(stage: str, metrics: dict) -> dict[str, float]:
    """A stage's manifest metrics under their names; only finite numbers (no counts of text, no booleans)."""
    prefix = PREFIX[stage]
    return {f"{prefix}/{k}": float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def of_iteration(store: ArtifactStore, run_id: str, iteration: int) -> dict[str, float]:
    """Every named metric the committed stages of one iteration recorded (iteration 0: the initial evaluation)."""
    out: dict[str, float] = {}
    for stage in PREFIX:
        manifest = store.read_manifest(stage_key(run_id, iteration, stage))
        if manifest is not None:
            out.update(flat(stage, manifest.get("metrics", {})))
    return out
