"""Validate-only flow: the `validate` stage (environment, devices, FSDP shard check, store, model, memory, and the
inputs: model config and weight files, dataset size, prompt lengths, a sample reward call; core/orchestrate/preflight.py)."""
# No `from __future__ import annotations`: served runs need the real Blueprint annotation for the run form.

from prefect import flow
from prefect.states import Cancelled

from verlflow.core.blueprint import Blueprint
from verlflow.core.orchestrate.launcher import FailureKind, StageFailure
from verlflow.core.orchestrate.pipeline import plan
from verlflow.flows.common import default_run_id, name_flow_run, resolve_blueprint
from verlflow.tasks.stages import stage_task


@flow(name="validate", description="Check a blueprint against this machine (always runs; nothing is reused).")
def validate(blueprint: Blueprint = Blueprint(), run_id: str | None = None,
             blueprint_file: str | None = None) -> dict:
    bp = resolve_blueprint(blueprint, blueprint_file)
    run_id = run_id or default_run_id(bp)
    name_flow_run(run_id)
    step = plan(bp, run_id)[0]
    try:
        res = stage_task(step.stage, step.iteration, bp)(step.stage, step.iteration, step.inputs, bp, run_id, True)
    except StageFailure as e:
        if e.kind is FailureKind.CANCELLED:  # in-process runs; served/worker runs are stopped by SIGTERM
            return Cancelled(message=f"{run_id}: cancelled; the validate job was killed")
        raise
    return {"run_id": run_id, **res.manifest["metrics"]}
