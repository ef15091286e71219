"""The fine-tune flow, as the pipeline diagram:

    validate -> build -> (rollout -> update -> checkpoint) x iterations

Each step is one stage task (tasks/stages.py); a stage whose committed manifest matches its key is reused, so
a rerun with the same run id, or the UI's Retry of a failed flow run, resumes at the first missing stage.
"""
# No `from __future__ import annotations`: served runs need the real Blueprint annotation for the run form.

from prefect import flow, get_run_logger
from prefect.context import get_run_context
from prefect.states import Cancelled

from verlflow.core.blueprint import Blueprint, OptionalText
from verlflow.core.orchestrate.launcher import FailureKind, StageFailure
from verlflow.core.store.lease import run_lease
from verlflow.core.orchestrate.pool import warm_pools
from verlflow.core.orchestrate.pipeline import parse_from, plan, warm_start_source
from verlflow.core.orchestrate.runner import open_store
from verlflow.flows.common import default_run_id, name_flow_run, recomputed_here, resolve_blueprint, wait_for_earlier_runs
from verlflow.tasks.report import RunReport, iteration_row
from verlflow.tasks.stages import pipeline_slots, stage_task


@flow(name="finetune", description="PPO/GRPO fine-tune of a blueprint: validate, build, then rollout -> update "
      "-> checkpoint per iteration. Stages committed with the same key are reused.")
def finetune(blueprint: Blueprint = Blueprint(), run_id: OptionalText = None, blueprint_file: OptionalText = None,
             from_step: OptionalText = None) -> dict:
    """The run form's fields (Prefect reads their descriptions from here).

    Args:
        blueprint: The whole blueprint, section by section; a deployment fills it with its blueprint's values.
        run_id: The run to create or resume (its stages live under runs/<run_id>/ in the artifact store). Empty:
            a new id from the blueprint's name and this flow run. Give an earlier run's id to resume it: its
            committed stages with the same key are reused.
        blueprint_file: A blueprint YAML to use instead of the form: a path on the machine that runs the flow, or
            an fsspec URI such as s3://bucket/bp.yaml. Empty: the form's blueprint.
        from_step: Force a restart at this step and rerun every later one even if committed, e.g. update[2],
            rollout:3 or build. Empty: resume at the first missing stage.
    """
    bp = resolve_blueprint(blueprint, blueprint_file)
    run_id = run_id or default_run_id(bp)
    name_flow_run(run_id)
    wait_for_earlier_runs(bp)  # init_from=previous: the previous run's promotion first
    steps = plan(bp, run_id, warm_start_source(bp, run_id))
    first_forced = parse_from(from_step, steps)
    get_run_logger().info("run %s: %d steps, artifact store %s", run_id, len(steps), bp.storage.uri)
    report, done = RunReport(bp, run_id), {}
    try:
        # resources.warm_workers: the stage tasks share one torchrun job, which keeps its devices between stages,
        # so the flow holds their slots for as long (a task holding slots must never wait on an idle pool's GPUs).
        with run_lease(open_store(bp), run_id, str(get_run_context().flow_run.id), get_run_logger().info), \
                warm_pools() as pools, pipeline_slots(bp):
            for i, step in enumerate(steps):
                force = first_forced is not None and i >= first_forced and not recomputed_here(bp, run_id, step)
                task = stage_task(step.stage, step.iteration, bp)
                done[step.stage] = task(step.stage, step.iteration, step.inputs, bp, run_id, force, pools=pools)
                if step.stage == "checkpoint":
                    it = step.iteration
                    report.iteration_done(iteration_row(it, done["rollout"], done["update"], done["checkpoint"]))
    except StageFailure as e:
        if e.kind is FailureKind.CANCELLED:  # in-process runs; served/worker runs are stopped by SIGTERM
            return Cancelled(message=f"{run_id}: cancelled; the running stage's job was killed")
        raise
    return {"run_id": run_id, "iterations": report.rows}
