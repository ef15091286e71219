"""What both flows need: the blueprint (parameter or file/URI), the run id, the flow run's own facts."""

import datetime as dt

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterDeploymentId,
                                            FlowRunFilterExpectedStartTime, FlowRunFilterState, FlowRunFilterStateType)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.context import get_run_context

from verlflow.core.blueprint import Blueprint, load_blueprint
from verlflow.core.errors import StoreError
from verlflow.core.orchestrate.pipeline import PipelineHooks, Step
from verlflow.core.orchestrate.runner import open_store
from verlflow.core.store.artifacts import stage_key
from verlflow.core.wait import wait_until
from verlflow.tasks.stages import pipeline_slots, run_step_as_task


def resolve_blueprint(blueprint: Blueprint, blueprint_file: str | None) -> Blueprint:
    """A blueprint file (a path, or any fsspec URI such as s3://bucket/exp/bp.yaml, whose relative paths are then
    relative to s3://bucket/exp/) wins over the parameter."""
    return load_blueprint(blueprint_file) if blueprint_file else blueprint


NAME_CHARS = 60  # the readable part of a default run id; the rest is 25 characters


def run_id_for(name: str, flow_run: FlowRun) -> str:
    """`<name>-<scheduled start, UTC>-<8 random hex of the flow run id>`, e.g.
    `nightly-20261202T030000Z-9f3c2b7d`. Both parts are fixed when the flow run is created, so a UI Retry (same
    flow run) resumes the same run id, while runs the scheduler creates together (Prefect's ids are time-ordered:
    their leading digits are shared) or at the same second still get their own."""
    start = (flow_run.expected_start_time or flow_run.created).astimezone(dt.timezone.utc)
    return f"{name[:NAME_CHARS]}-{start:%Y%m%dT%H%M%SZ}-{flow_run.id.hex[-8:]}"


def default_run_id(bp: Blueprint) -> str:
    with get_client(sync_client=True) as client:  # the server's record: the context's copy may lack the start
        return run_id_for(bp.name, client.read_flow_run(get_run_context().flow_run.id))


# A due run that the runner has not started within this long is not waited for: a runner at its --limit (or a
# deployment concurrency limit) may hold it back until a later run that waits for it ends, which would deadlock.
START_GRACE_S = 60.0


def earlier_unfinished_runs(me: FlowRun, client) -> list[FlowRun]:
    """Runs of my deployment scheduled before me that are running or about to start. An AwaitingRetry run (it
    has run before) resumes with the warm start its build recorded, so it holds nobody up."""
    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
        deployment_id=FlowRunFilterDeploymentId(any_=[me.deployment_id]),
        expected_start_time=FlowRunFilterExpectedStartTime(before_=me.expected_start_time or me.created),
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[
            StateType.PENDING, StateType.RUNNING, StateType.CANCELLING, StateType.SCHEDULED]))))
    now = dt.datetime.now(dt.timezone.utc)

    def order(r: FlowRun):
        return r.expected_start_time or r.created, str(r.id)

    def starting(r: FlowRun) -> bool:
        due = r.next_scheduled_start_time
        return r.run_count == 0 and due is not None and 0 <= (now - due).total_seconds() <= START_GRACE_S

    return sorted((r for r in runs if r.id != me.id and order(r) < order(me)
                   and (r.state_type != StateType.SCHEDULED or starting(r))), key=order)


def wait_for_earlier_runs(bp: Blueprint, every_s: float = 2.0) -> None:
    """schedule.init_from=previous: a deployment's runs take their turn in the order they were scheduled, so
    each build warm-starts from the previous run's promoted policy, even when runs overlap (several due at once,
    or a run longer than the cron interval). Decided here, not by a deployment concurrency limit: Prefect
    submits runs that are due together concurrently, so a limit alone lets any of them go first."""
    if bp.schedule.init_from != "previous":
        return
    log, shown = get_run_logger(), None
    with get_client(sync_client=True) as client:
        me = client.read_flow_run(get_run_context().flow_run.id)
        if me.deployment_id is None:  # a plain `verlflow run --prefect`: no schedule to keep in order
            return

        def my_turn() -> bool:
            nonlocal shown
            earlier = earlier_unfinished_runs(me, client)
            names = ", ".join(f"{r.name} ({r.state_name})" for r in earlier)
            if earlier and names != shown:
                log.info("schedule.init_from=previous: waiting for the earlier run(s) of this deployment to finish "
                         "first, so this build warm-starts from the last one's promoted policy: %s", names)
                shown = names
            return not earlier

        wait_until(my_turn, interval_s=every_s)


def name_flow_run(run_id: str) -> None:
    """Show the run id as the flow run's name in the UI."""
    with get_client(sync_client=True) as client:
        client.update_flow_run(get_run_context().flow_run.id, name=run_id)


def recomputed_here(bp: Blueprint, run_id: str, step: Step) -> bool:
    """Whether this flow run already recomputed `step` (committed after the flow run was created), so a Retry
    of a run started with from_step does not force the same stages again."""
    try:
        m = open_store(bp).read_manifest(stage_key(run_id, step.iteration, step.stage))
    except StoreError:  # a damaged manifest was not recomputed here: the forced stage replaces it
        return False
    if m is None or not m.get("committed_at"):
        return False
    created = int(get_run_context().flow_run.created.timestamp())  # older manifests' committed_at has whole seconds
    return dt.datetime.fromisoformat(m["committed_at"]).timestamp() >= created


def flow_hooks(bp: Blueprint, run_id: str) -> PipelineHooks:
    """The pipeline loop as a flow: each step a stage task; with warm workers the flow holds the pool's device
    slots (its torchrun job keeps its devices between stages, and a task holding slots must never wait on an
    idle pool's GPUs); a Retry does not force again what this flow run already recomputed."""
    return PipelineHooks(run_step=run_step_as_task, hold=lambda: pipeline_slots(bp),
                         recomputed=lambda step: recomputed_here(bp, run_id, step))
