"""What both flows need: the blueprint (parameter or file/URI), the run id, the flow run's own facts."""

import datetime as dt

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterDeploymentId, FlowRunFilterExpectedStartTime,
                                            FlowRunFilterState, FlowRunFilterStateName, FlowRunFilterStateType)
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy, FlowRun, StateType
from prefect.context import get_run_context
from prefect.exceptions import Pause
from prefect.states import Scheduled
from prefect.utilities.engine import propose_state_sync

from verlflow.core.blueprint import Blueprint, load_blueprint
from verlflow.core.errors import StoreError, VerlflowError
from verlflow.core.orchestrate.pipeline import PipelineHooks, Step
from verlflow.core.store.artifacts import open_store
from verlflow.core.store.artifacts import stage_key
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


# schedule.init_from=previous: a deployment's runs take turns in the order they were scheduled, so each build
# warm-starts from the previous run's promotion, even when runs overlap (several due at once, or a run longer than
# the cron interval). Prefect keeps the queue: such a deployment has a concurrency limit of one run with the
# ENQUEUE strategy, so a run that comes due while another holds the slot waits as Scheduled
# (AwaitingConcurrencySlot) with no process, and its runner or worker asks for the slot again every 30 s (the
# server's PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS): one request, no flow process. Prefect gives a
# free slot to whichever run asks first, not the earliest, so a run that gets it while an earlier one waits gives
# it back (`take_turn`), and a run that ends makes the next one due at once (`pass_turn`).
TURNS = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)
QUEUED = "AwaitingConcurrencySlot"  # Prefect's Scheduled state of a run waiting for its deployment's slot
RECHECK_S = 30.0  # a run that gave its turn back asks again after this long (Prefect's own wait for a slot)
PREFETCH_S = 10.0  # runners and workers ask for runs due this soon (their default prefetch): no need to wake them


def turn_limit(bp: Blueprint) -> ConcurrencyLimitConfig | None:
    """The finetune deployment's concurrency limit: one run at a time where each warm-starts from the last."""
    return TURNS if bp.schedule.init_from == "previous" else None


def _scheduled(r: FlowRun) -> dt.datetime:
    return r.expected_start_time or r.created


def _order(r: FlowRun):
    return _scheduled(r), str(r.id)  # runs due together: a fixed order


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def had_its_turn(r: FlowRun, client) -> bool:
    """Whether the run has ended before: a Retry of it resumes with the warm start its build recorded, so it
    holds nobody up. (A run that gave its turn back has run too, but never ended.)"""
    return r.run_count > 0 and any(s.is_final() for s in client.read_flow_run_states(r.id))


def runs_ahead(me: FlowRun, client) -> list[FlowRun]:
    """Runs of my deployment scheduled before me that go first: those running (or starting, or being cancelled),
    and those waiting for their first turn: queued for the deployment's slot, or due."""
    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
        deployment_id=FlowRunFilterDeploymentId(any_=[me.deployment_id]),
        expected_start_time=FlowRunFilterExpectedStartTime(before_=me.expected_start_time or me.created),
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[
            StateType.PENDING, StateType.RUNNING, StateType.CANCELLING, StateType.SCHEDULED]))))
    now = _now()

    def waiting(r: FlowRun) -> bool:
        due = r.next_scheduled_start_time
        return (r.state_name == QUEUED or (due is not None and due <= now)) and not had_its_turn(r, client)

    return sorted((r for r in runs if r.id != me.id and _order(r) < _order(me)
                   and (r.state_type != StateType.SCHEDULED or waiting(r))), key=_order)


def wake(r: FlowRun, client) -> None:
    """Make a queued run due now, at its scheduled start if that has passed, so the runner's next poll asks for
    the slot for it before the others (it sorts them by due time). Not a run due within the prefetch: it is asked
    for anyway, and moving it could race that request."""
    now, due = _now(), r.next_scheduled_start_time
    if r.state_type == StateType.SCHEDULED and due is not None and due > now + dt.timedelta(seconds=PREFETCH_S):
        client.set_flow_run_state(r.id, Scheduled(name=QUEUED, scheduled_time=min(_scheduled(r), now)))


def take_turn(bp: Blueprint) -> None:
    """schedule.init_from=previous, in a deployment's run: go on if no earlier run goes first; else give the slot
    back and wait (Scheduled, AwaitingConcurrencySlot), ending this flow process as Prefect's suspend does."""
    if bp.schedule.init_from != "previous":
        return
    with get_client(sync_client=True) as client:
        me = client.read_flow_run(get_run_context().flow_run.id)
        if me.deployment_id is None:  # a plain `verlflow run --prefect`: no schedule to keep in order
            return
        ahead = runs_ahead(me, client)
        if not ahead:
            return
        log, names = get_run_logger(), ", ".join(f"{r.name} ({r.state_name})" for r in ahead)
        log.info("schedule.init_from=previous: waiting for its turn; the earlier run(s) of this deployment go "
                 "first: %s", names)
        if client.read_deployment(me.deployment_id).global_concurrency_limit is None:
            log.warning("this deployment has no concurrency limit, so each waiting run starts a flow process every "
                        "%.0f s to ask for its turn; give it concurrency_limit 1 with collision_strategy ENQUEUE "
                        "(`verlflow deploy` and `verlflow serve` do)", RECHECK_S)
        state = propose_state_sync(client, Scheduled(
            name=QUEUED, scheduled_time=_now() + dt.timedelta(seconds=RECHECK_S),
            message=f"waiting for its turn after {ahead[0].name}"), flow_run_id=me.id)
        if not state.is_scheduled():
            raise VerlflowError(f"flow run {me.name}: could not wait for its turn: the server answered {state!r}")
        wake(ahead[0], client)
    raise Pause(state=state)  # the engine exits without proposing a final state


def pass_turn(flow, flow_run: FlowRun, state) -> None:
    """Flow hook on a final state (the deployment's slot is free again): wake the next queued run of the
    deployment, the earliest that has not had its turn (or else the earliest), instead of the first to ask."""
    if flow_run.deployment_id is None:
        return
    with get_client(sync_client=True) as client:
        queued = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(any_=[flow_run.deployment_id]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]),
                                     name=FlowRunFilterStateName(any_=[QUEUED]))))
        if queued:
            wake(min(queued, key=lambda r: (had_its_turn(r, client), _order(r))), client)


# Not on_cancellation: it runs at Cancelling, while the run still holds the slot.
TURN_HOOKS = {f"on_{s}": [pass_turn] for s in ("completion", "failure", "crashed")}


def name_flow_run(run_id: str) -> None:
    """Show the run id as the flow run's name in the UI where Prefect chose the name: a scheduled run, or one with no
    deployment (an in-process or `verlflow run --prefect` run). A run started by hand from a deployment (the UI's
    Run form, `prefect deployment run`) keeps the name it was given (finetune's log names its run id)."""
    with get_client(sync_client=True) as client:
        me = client.read_flow_run(get_run_context().flow_run.id)
        if me.deployment_id is None or me.auto_scheduled:
            client.update_flow_run(me.id, name=run_id)


def recomputed_here(bp: Blueprint, run_id: str, step: Step) -> bool:
    """Whether this flow run already recomputed `step` (committed after the flow run was created), so a Retry
    of a run started with from_step does not force the same stages again."""
    try:
        m = open_store(bp.storage).read_manifest(stage_key(run_id, step.iteration, step.stage))
    except StoreError:  # a damaged manifest was not recomputed here: the forced stage replaces it
        return False
    if m is None or not m.get("committed_at"):
        return False
    return committed_since(m["committed_at"], get_run_context().flow_run.created)


def committed_since(committed_at: str, created: dt.datetime) -> bool:
    """Whether a manifest's commit time is at or after `created`. An older manifest's committed_at has whole
    seconds: then only the second is compared (a commit in the second the flow run began counts as after it), never
    otherwise, or a stage committed just before the flow run began in the same second would count as recomputed."""
    committed = dt.datetime.fromisoformat(committed_at)
    since = created.timestamp()
    if committed.microsecond == 0:
        since = int(since)
    return committed.timestamp() >= since


def flow_hooks(bp: Blueprint, run_id: str) -> PipelineHooks:
    """The pipeline loop as a flow: each step a stage task; with warm workers the flow holds the pool's device
    slots (its torchrun job keeps its devices between stages, and a task holding slots must never wait on an
    idle pool's GPUs); a Retry does not force again what this flow run already recomputed."""
    return PipelineHooks(run_step=run_step_as_task, hold=lambda: pipeline_slots(bp),
                         recomputed=lambda step: recomputed_here(bp, run_id, step))
