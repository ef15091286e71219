"""The stage task: one thin Prefect task per (stage, iteration) around verlflow.core.orchestrate.runner.run_stage.

Retries are declared here and decided by the launcher's failure class; the torchrun output streams into the
task run's logs; a local job holds this host's device slots while it runs; every stage leaves a markdown summary.
"""

import contextvars
import logging
import threading
import time
from contextlib import contextmanager

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.context import get_run_context
from prefect.exceptions import MissingContextError
from prefect.states import Cancelled, Completed, State

from verlflow.core.blueprint import Blueprint
from verlflow.core.orchestrate.launcher import FailureKind, StageFailure
from verlflow.core.orchestrate.logsink import LineSink, stage_log_path
from verlflow.core.orchestrate.pipeline import Step
from verlflow.core.orchestrate.pool import WarmPools
from verlflow.core.orchestrate.runner import RunContext, StageResult, run_stage, stage_status
from verlflow.core.store.artifacts import open_store
from verlflow.core.errors import StoreError
from verlflow.core.stagespec import spec
from verlflow.core.store.artifacts import ArtifactStore, stage_key
from verlflow.core.store.promote import export_verdict
from verlflow.tasks.report import location
from verlflow.tasks.slots import device_slots, limit_name


def retryable(task, task_run, state) -> bool:
    """Retry a collective timeout, a killed rank, our timeout; never a user error, an OOM or a NaN."""
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return isinstance(exc, StageFailure) and exc.retryable


def is_committed(ctx: RunContext, stage: str, iteration, inputs: dict[str, str]) -> bool:
    """Whether run_stage will reuse this stage (its own read-only check): then it needs no device slots."""
    try:
        key, _, existing, _ = stage_status(ctx, stage, iteration, inputs)
    except StoreError:  # an input is missing: run_stage will say so
        return False
    return existing is not None and existing.get("key") == key


CANCEL_STATES = (StateType.CANCELLING, StateType.CANCELLED)
# How long the watcher leaves a deployment's run to the SIGTERM of its runner or worker (~1.5 s after the click on a
# loaded machine) before it stops the stage itself: set at once, it raced that SIGTERM, which then landed in the
# cancelled stage's clean-up and crashed its task run.
SIGTERM_GRACE_S = 10.0


@contextmanager
def cancel_requested(every_s: float = 2.0, flow_run_id=None, sigterm_grace_s: float = SIGTERM_GRACE_S):
    """An Event set once this flow run (or `flow_run_id`) is being cancelled: at once for a run with no deployment
    (in-process, `verlflow run --prefect`). A deployment's run (served, or a worker's) is stopped by the SIGTERM its
    runner or worker sends, which Prefect raises in this thread (the stage task's `cancelled`): there the Event is
    the fallback, set if no SIGTERM came within sigterm_grace_s. An API error is logged once and the watch goes
    on: Cancel works again as soon as the API answers."""
    cancel, stop = threading.Event(), threading.Event()
    flow_run_id = flow_run_id or get_run_context().task_run.flow_run_id
    try:
        log = get_run_logger()
    except MissingContextError:
        log = logging.getLogger(__name__)

    def watch():
        failing, seen = False, None
        with get_client(sync_client=True) as client:
            while not stop.wait(every_s):
                try:
                    run = client.read_flow_run(flow_run_id)
                except Exception as e:
                    if not failing:
                        log.warning("cancel watcher: cannot read flow run %s's state (%s: %s); still trying every "
                                    "%g s: a Cancel is noticed once the Prefect API answers", flow_run_id,
                                    type(e).__name__, e, every_s)
                    failing = True
                    continue
                if run.state is not None and run.state.type in CANCEL_STATES:
                    seen = seen or time.monotonic()
                    if run.deployment_id is None or time.monotonic() - seen >= sigterm_grace_s:
                        cancel.set()
                        return

    ctx = contextvars.copy_context()  # the caller's Prefect settings (API URL) and run context
    threading.Thread(target=ctx.run, args=(watch,), name="verlflow-cancel-watch", daemon=True).start()
    try:
        yield cancel
    finally:
        stop.set()


def is_cancel(exc: BaseException, flow_run_id) -> bool:
    """Whether `exc` is how a Cancel of this flow run reached this thread: the watcher's (a StageFailure of kind
    CANCELLED, the job already killed), or the SIGTERM a runner or worker sends (Prefect raises a BaseException;
    the launcher and warm pool have killed the job on their way out) while the server has the run Cancelling."""
    if isinstance(exc, StageFailure):
        return exc.kind is FailureKind.CANCELLED
    if isinstance(exc, Exception):
        return False
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run_id).state
    except Exception:  # the API is down: a SIGTERM we cannot explain stays a crash
        return False
    return state is not None and state.type in CANCEL_STATES


@task(name="stage", cache_policy=NO_CACHE, persist_result=False, retries=1, retry_delay_seconds=5,
      retry_condition_fn=retryable)
def run_stage_task(stage: str, iteration, inputs: dict[str, str], bp: Blueprint, run_id: str,
                   force: bool = False, pools: WarmPools | None = None,
                   reads: list | None = None, lane: str | None = None, lane_ranks: int | None = None
                   ) -> "StageResult | State":
    """`pools`: the flow's warm pools (verlflow.core.orchestrate.pool), for a blueprint with warm workers;
    `reads`: the plan's checkpoint reads (RunContext.reads); `lane`, `lane_ranks`: rollout.async's lane and its
    share of the node's ranks (RunContext.lane, .ranks)."""
    log = get_run_logger()
    store, out = open_store(bp.storage), stage_key(run_id, iteration, stage)
    # Every line to the stage's log file; a rank's traceback as one ERROR record in the task's logs.
    sink = LineSink(stage_log_path(store, run_id, stage, iteration), log.log)
    try:
        with cancel_requested() as cancel, sink:
            ctx = RunContext(bp, run_id, on_line=sink, cancel=cancel, pools=pools, store=store, reads=reads or [],
                             lane=lane, ranks=lane_ranks)
            ranks = 1 if spec(stage).single_process else ctx.nproc
            # Slurm and Kubernetes allocate devices themselves; a reused stage needs none; a warm pool's slots are
            # held by its flow (pipeline_slots).
            if bp.resources.backend != "local" or bp.resources.warm_pool or (
                    not force and is_committed(ctx, stage, iteration, inputs)):
                res = run_stage(ctx, stage, iteration, inputs, force=force)
            else:
                log.info(f"[verlflow] {stage}[{iteration}] needs {ranks} slot(s) of "
                         f"{limit_name(bp.resources.device)}")
                with device_slots(bp.resources.device, ranks):
                    res = run_stage(ctx, stage, iteration, inputs, force=force)
    except BaseException as e:
        if is_cancel(e, get_run_context().task_run.flow_run_id):  # Cancelled, not Crashed (SIGTERM) or Failed
            return Cancelled(message=f"{stage}[{iteration}] was cancelled: its job was killed")
        raise
    create_markdown_artifact(summary_markdown(f"{stage}[{iteration}]", res, store, out),
                             description=f"{stage}[{iteration}]")
    if res.skipped:  # named in the task list; StageTask hands the result to the flow
        return Completed(name="Cached", message=f"reused: committed with the same key at {store.uri(out)}", data=res)
    return res


@contextmanager
def pipeline_slots(bp: Blueprint):
    """With warm workers, this host's device slots for the pool, held for the whole flow; otherwise nothing (each
    stage task takes its own)."""
    if not bp.resources.warm_pool:
        yield
        return
    n = bp.resources.nproc_per_node
    get_run_logger().info(f"[verlflow] warm workers: the flow holds {n} slot(s) of "
                          f"{limit_name(bp.resources.device)} for its stages")
    with device_slots(bp.resources.device, n):
        yield


def run_step_as_task(ctx: RunContext, step: Step, force: bool) -> StageResult:
    """The flow's way to run a pipeline step (verlflow.core.orchestrate.pipeline.PipelineHooks): as its stage task,
    with its phase's blueprint."""
    ctx = step.context(ctx)
    return stage_task(step.stage, step.iteration, ctx.bp)(step.stage, step.iteration, step.inputs, ctx.bp,
                                                          ctx.run_id, force, pools=ctx.pools, reads=ctx.reads,
                                                          lane=ctx.lane, lane_ranks=ctx.ranks)


def stage_task(stage: str, iteration, bp: Blueprint) -> "StageTask":
    """The task named for this step (`rollout[3]`), with the blueprint's retry count."""
    return StageTask(run_stage_task.with_options(name=stage, task_run_name=f"{stage}[{iteration}]",
                                                 retries=bp.resources.retries))


class StageTask:
    """A step's task: calling it returns the StageResult. A reused stage's task run ends in the state named Cached,
    and Prefect hands a task's returned State back to its caller as is: its result is taken here."""

    def __init__(self, task):
        self.task = task

    def with_options(self, **options) -> "StageTask":
        return StageTask(self.task.with_options(**options))

    def __call__(self, *args, **kwargs) -> StageResult:
        state = self.task(*args, return_state=True, **kwargs)
        if state.is_cancelled():  # the flow ends Cancelled on this (flows/finetune.py)
            raise StageFailure(FailureKind.CANCELLED, state.message or "cancelled")
        return state.result()


def summary_markdown(name: str, res: StageResult, store: ArtifactStore, out: str) -> str:
    """Metrics, timings and where the stage lives (its final location, known before a background commit lands)."""
    m = res.manifest
    how = "**reused**: committed with the same key" if res.skipped else f"ran in {res.seconds:.1f} s"
    if not res.skipped and (start := m.get("timings", {}).get("pool_start_s")):
        how += f" ({start:.1f} s of it starting the warm worker pool)"
    if res.pending:
        how += "; its checkpoint is written and committed in the warm pool's background"
    metrics = {k: v for k, v in m.get("metrics", {}).items() if isinstance(v, (int, float, str, bool))}
    out_md = [f"### {name}: {how}", "", "| metric | value |", "|---|---|"]
    out_md += [f"| {k} | {v} |" for k, v in sorted(metrics.items())]
    out_md += ["", "| timing | seconds |", "|---|---|"]
    out_md += [f"| {k} | {v} |" for k, v in sorted(m.get("timings", {}).items())]
    committed = m.get("committed_at") or "in the background (the manifest appears there when the commit lands)"
    out_md += ["", f"- Artifacts: {location(store, out)}, manifest {location(store, out + '/manifest.json')}",
               f"- key `{m.get('key')}`, committed {committed}, world size {m.get('world_size')}"]
    if m.get("stage") == "export":
        pointer = location(store, f"pointers/runs/{m['run_id']}/latest.json")
        verdict = ("its commit has not landed yet: the promotion gate decides on it when it lands" if res.pending
                   else export_verdict(store, m["run_id"], m["iteration"]))
        out_md.append(f"- Policy (HF folder): {location(store, out + '/hf')}; {verdict} (pointer {pointer})")
    if m.get("lineage"):
        src = m["lineage"][-1]
        out_md.append(f"- warm-started from `{src['stage']}` (run {src['run_id']}, iteration {src['iteration']})")
    return "\n".join(out_md)
