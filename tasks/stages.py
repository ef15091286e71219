"""The stage task: one thin Prefect task per (stage, iteration) around verlflow.core.orchestrate.runner.run_stage.

Retries are declared here and decided by the launcher's failure class; the torchrun output streams into the
task run's logs; a local job holds this host's device slots while it runs; every stage leaves a markdown summary.
"""

import contextvars
import logging
import threading
from contextlib import contextmanager

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.context import get_run_context
from prefect.exceptions import MissingContextError
from prefect.states import Completed, State

from verlflow.core.blueprint import Blueprint
from verlflow.core.orchestrate.launcher import StageFailure
from verlflow.core.orchestrate.logsink import LineSink, stage_log_path
from verlflow.core.orchestrate.pipeline import Step
from verlflow.core.orchestrate.pool import WarmPools
from verlflow.core.orchestrate.runner import (SINGLE_PROCESS, RunContext, StageResult, open_store, run_stage,
                                              stage_status)
from verlflow.core.errors import StoreError
from verlflow.core.store.artifacts import ArtifactStore, stage_key
from verlflow.tasks.report import link, location
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


@contextmanager
def cancel_requested(every_s: float = 2.0, flow_run_id=None):
    """An Event set once this flow run (or `flow_run_id`) is being cancelled. Served and worker runs also get
    SIGTERM, which Prefect raises in this thread (launch's `finally` kills the job); an in-process run only has
    this. An API error is logged once and the watch goes on: Cancel works again as soon as the API answers."""
    cancel, stop = threading.Event(), threading.Event()
    flow_run_id = flow_run_id or get_run_context().task_run.flow_run_id
    try:
        log = get_run_logger()
    except MissingContextError:
        log = logging.getLogger(__name__)

    def watch():
        failing = False
        with get_client(sync_client=True) as client:
            while not stop.wait(every_s):
                try:
                    state = client.read_flow_run(flow_run_id).state
                except Exception as e:
                    if not failing:
                        log.warning("cancel watcher: cannot read flow run %s's state (%s: %s); still trying every "
                                    "%g s: a Cancel is noticed once the Prefect API answers", flow_run_id,
                                    type(e).__name__, e, every_s)
                    failing = True
                    continue
                if state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED):
                    cancel.set()
                    return

    ctx = contextvars.copy_context()  # the caller's Prefect settings (API URL) and run context
    threading.Thread(target=ctx.run, args=(watch,), name="verlflow-cancel-watch", daemon=True).start()
    try:
        yield cancel
    finally:
        stop.set()


@task(name="stage", cache_policy=NO_CACHE, persist_result=False, retries=1, retry_delay_seconds=5,
      retry_condition_fn=retryable)
def run_stage_task(stage: str, iteration, inputs: dict[str, str], bp: Blueprint, run_id: str,
                   force: bool = False, pools: WarmPools | None = None) -> "StageResult | State":
    """`pools`: the flow's warm pools (verlflow.core.orchestrate.pool), for a blueprint with warm workers."""
    log = get_run_logger()
    ranks = 1 if stage in SINGLE_PROCESS else bp.resources.nproc_per_node
    store, out = open_store(bp), stage_key(run_id, iteration, stage)
    # Every line to the stage's log file; a rank's traceback as one ERROR record in the task's logs.
    sink = LineSink(stage_log_path(store, run_id, stage, iteration), log.log)
    with cancel_requested() as cancel, sink:
        ctx = RunContext(bp, run_id, on_line=sink, cancel=cancel, pools=pools, store=store)
        # Slurm and Kubernetes allocate devices themselves; a reused stage needs none; a warm pool's slots are
        # held by its flow (pipeline_slots).
        if bp.resources.backend != "local" or bp.resources.warm_pool or (
                not force and is_committed(ctx, stage, iteration, inputs)):
            res = run_stage(ctx, stage, iteration, inputs, force=force)
        else:
            log.info(f"[verlflow] {stage}[{iteration}] needs {ranks} slot(s) of {limit_name(bp.resources.device)}")
            with device_slots(bp.resources.device, ranks):
                res = run_stage(ctx, stage, iteration, inputs, force=force)
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
                                                          ctx.run_id, force, pools=ctx.pools)


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
        return self.task(*args, return_state=True, **kwargs).result()


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
    out_md += ["", f"- Artifacts: {location(store, out)}, manifest {link(store.uri(out + '/manifest.json'))}",
               f"- key `{m.get('key')}`, committed {committed}, world size {m.get('world_size')}"]
    if m.get("stage") == "checkpoint":
        pointer = store.uri(f"pointers/runs/{m['run_id']}/latest.json")
        when = "when its background commit lands" if res.pending else "at its commit"
        out_md.append(f"- Policy (HF folder): {location(store, out + '/hf')}, promoted as the run's latest {when} "
                      f"(pointer {link(pointer)})")
    if m.get("lineage"):
        src = m["lineage"][-1]
        out_md.append(f"- warm-started from `{src['stage']}` (run {src['run_id']}, iteration {src['iteration']})")
    return "\n".join(out_md)
