"""Validate-only flow: the `validate` stage (environment, devices, FSDP shard check, store, model, memory, and the
inputs: model config and weight files, dataset size, prompt lengths, a sample reward call; core/checks/preflight.py).

Both flows take their blueprint through `checked_blueprint` and end a refused one with `refused`."""
# No `from __future__ import annotations`: served runs need the real Blueprint annotation for the run form.

import logging

from prefect import flow, get_run_logger
from prefect.exceptions import FailedRun
from prefect.states import Cancelled, Failed, State
from pydantic import ValidationError

from verlflow.core.blueprint import Blueprint, format_validation_error
from verlflow.core.errors import BlueprintError, VerlflowError
from verlflow.core.orchestrate.launcher import FailureKind, StageFailure
from verlflow.core.orchestrate.pipeline import plan
from verlflow.flows.common import default_run_id, name_flow_run, resolve_blueprint
from verlflow.tasks.stages import stage_task


def checked_blueprint(blueprint: Blueprint | dict, blueprint_file: str | None) -> Blueprint:
    """The run's blueprint: the file's if given, else the form's. The flows validate it here, not Prefect
    (validate_parameters=False): Prefect's refusal was a traceback with pydantic's words at its end."""
    bp = resolve_blueprint(blueprint, blueprint_file)
    if isinstance(bp, Blueprint):  # an in-process call
        return bp
    try:
        return Blueprint.model_validate(bp)
    except ValidationError as e:
        raise BlueprintError(format_validation_error(e, "blueprint parameter", {})) from None


REFUSED = "Nothing ran, and this run cannot succeed unchanged"


def refused(e: VerlflowError, blueprint_file: str | None = None) -> State:
    """The end of a flow run whose parameters are refused before anything ran: Failed (no retry), its message the
    one-paragraph error. The UI offers Retry on every failed run, so the message says what a Retry would do."""
    retry = (f"a Retry reads {blueprint_file} again: fix it first" if blueprint_file else
             "a Retry runs the same parameters and fails the same way: start a new run with the fix")
    message = f"{e}\n{REFUSED} ({retry})."
    get_run_logger().error(message)
    return Failed(message=message)


class _NoTracebackOfRefusals(logging.Filter):
    """A served or worker run that ends Failed makes Prefect's engine log its own traceback ("Engine execution
    exited with unexpected exception", Prefect's frames only): not for a refused run, whose error line and state
    message say it all."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, FailedRun) and REFUSED in str(exc))


logging.getLogger("prefect.flow_runs").addFilter(_NoTracebackOfRefusals())


@flow(name="validate", description="Check a blueprint against this machine (always runs; nothing is reused).",
      validate_parameters=False)
def validate(blueprint: Blueprint = Blueprint(), run_id: str | None = None,
             blueprint_file: str | None = None) -> dict:
    try:
        bp = checked_blueprint(blueprint, blueprint_file)
    except BlueprintError as e:
        return refused(e, blueprint_file)
    run_id = run_id or default_run_id(bp)
    name_flow_run(run_id)
    try:
        step = plan(bp, run_id)[0]
    except VerlflowError as e:  # the run id (the plan reads nothing: any error of it is the parameters')
        return refused(e)
    try:
        res = stage_task(step.stage, step.iteration, bp)(step.stage, step.iteration, step.inputs, bp, run_id, True)
    except StageFailure as e:
        if e.kind is FailureKind.CANCELLED:  # in-process runs; served/worker runs are stopped by SIGTERM
            return Cancelled(message=f"{run_id}: cancelled; the validate job was killed")
        raise
    return {"run_id": run_id, **res.manifest["metrics"]}
