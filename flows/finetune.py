"""The fine-tune flow, as the pipeline diagram:

    validate -> build -> (rollout -> update [-> checkpoint]) x iterations

(an export step, the HF export and its promotion, every storage.export_every iterations and at the last)

The steps are verlflow.core.orchestrate.pipeline's plan, walked by its one loop (the CLI's too); here each step is
one stage task (tasks/stages.py, hooks in flows/common.py). A stage whose committed manifest matches its key is reused, so
a rerun with the same run id, or the UI's Retry of a failed flow run, resumes at the first missing stage.
"""
# No `from __future__ import annotations`: served runs need the real Blueprint annotation for the run form.

from prefect import flow, get_run_logger
from prefect.context import get_run_context
from prefect.states import Cancelled

from verlflow.core.blueprint import Blueprint, OptionalText
from verlflow.core.errors import BlueprintError, VerlflowError
from verlflow.core.orchestrate.pipeline import checked_plan, run_pipeline
from verlflow.core.store.artifacts import open_store
from verlflow.core.store.lease import run_lease
from verlflow.flows.common import TURN_HOOKS, default_run_id, flow_hooks, name_flow_run, take_turn
from verlflow.flows.validate import checked_blueprint, refused
from verlflow.tasks.report import RunReport
from verlflow.tasks.stages import is_cancel


@flow(name="finetune", description="PPO/GRPO fine-tune of a blueprint: validate, build, then rollout -> update "
      "per iteration, an HF export (checkpoint) every storage.export_every and at the last. Stages committed with the "
      "same key are reused.", validate_parameters=False, **TURN_HOOKS)
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
    try:
        bp = checked_blueprint(blueprint, blueprint_file)
    except BlueprintError as e:
        return refused(e, blueprint_file)
    run_id = run_id or default_run_id(bp)
    name_flow_run(run_id)
    take_turn(bp)  # init_from=previous: the runs of a deployment go in the order they were scheduled
    try:
        steps, _ = checked_plan(bp, run_id, from_step)  # a bad run id or step fails before the store is touched
    except VerlflowError as e:
        return refused(e)
    log = get_run_logger()
    log.info("run %s: %d steps, artifact store %s", run_id, len(steps), bp.storage.uri)
    report = RunReport(bp, run_id)
    try:
        with run_lease(open_store(bp.storage), run_id, str(get_run_context().flow_run.id), log.info):
            run_pipeline(bp, run_id, on_step=report.step_done, force_from=from_step, hooks=flow_hooks(bp, run_id))
        report.finished()  # every background commit has landed: the summary names what the pointer says now
    except BaseException as e:  # a Cancel: the stage task's, or a served/worker run's SIGTERM between stages
        if is_cancel(e, get_run_context().flow_run.id):
            return Cancelled(message=f"{run_id}: cancelled; the running stage's job was killed")
        raise
    return {"run_id": run_id, "iterations": report.rows}
