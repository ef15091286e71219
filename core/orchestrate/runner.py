"""run_stage: the one core every orchestrator calls. Key -> skip if committed -> torchrun job -> manifest.

A stage's key hashes the blueprint sections it reads, its inputs' keys, its iteration and its code version (the
sources its worker computes with, verlflow.core.store.keys), so a committed stage with the same key is reused (that is how
reruns resume) and a changed field reruns it. A reused stage is checked first (one listing of its folder): a damaged
one is recomputed, and so, one after the other, is every later stage that read it (its input then committed after
it); a reused export whose promotion a crash cut short is promoted.
"""

import hashlib
import json
import logging
import shutil
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from verlflow.core.cachedir import cache_root, compile_cache_env
from verlflow.core.checks.memplan import RETRYING
from verlflow.core.blueprint import Blueprint
from verlflow.core.errors import StoreError
from verlflow.core.job import InputRecord, InputRef, JobSpec, ManifestDraft
from verlflow.core.orchestrate.backends import launcher_for, scratch_root
from verlflow.core.orchestrate.launcher import FailureKind, LaunchSpec, StageFailure
from verlflow.core.orchestrate.pool import Committing, WarmPool, WarmPools
from verlflow.core.stagespec import SPECS, spec
from verlflow.core.store.artifacts import ArtifactStore, open_store, stage_key
from verlflow.core.wait import wait_until

log = logging.getLogger("verlflow.runner")


def key_sections(stage: str, bp: Blueprint) -> tuple[str, ...]:
    """The spec's sections, and its LoRA ones for a LoRA run (an export's merged model or adapter folder): a full
    fine-tune has nothing to choose there, so those fields must not rerun it."""
    s = spec(stage)
    return s.key_sections + (s.lora_sections if bp.model.lora is not None else ())


def code_version(stage: str) -> str:
    """The code this stage's outputs depend on (verlflow.core.store.keys): its worker's maths, not the CLI, backends or store."""
    return _code_version()[stage]


_CODE_VERSION = None  # {stage: version}, computed once per process (a child may be given its parent's)


def _code_version() -> dict[str, str]:
    global _CODE_VERSION
    if _CODE_VERSION is None:
        from verlflow.core.store.keys import stage_code_versions

        _CODE_VERSION = stage_code_versions()
    return _CODE_VERSION


def compute_key(stage: str, bp: Blueprint, iteration, input_keys: dict[str, str], extra: dict | None = None,
                phase: int | None = None) -> str:
    """`phase`: the index in bp.phases of the phase the step runs (its "phase" key section)."""
    if stage == "user":  # the user's code is the stage's maths: its edit reruns it
        from verlflow.core import userstage

        extra = {**(extra or {}), "user_code": userstage.code_version(bp.phases[phase].kind)}
    payload = {"stage": stage, "iteration": iteration,
               "sections": bp.section_hash(*key_sections(stage, bp), phase=phase),
               "inputs": dict(sorted(input_keys.items())), "code": code_version(stage), "extra": extra or {}}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class StageResult:
    manifest: dict  # committed, or (pending) the manifest to come
    skipped: bool
    seconds: float
    later: Committing | None = None  # its commit, still running in a warm pool's background

    @property
    def key(self) -> str:
        return self.manifest["key"]

    @property
    def pending(self) -> bool:
        """Its commit is still running in a warm pool's background (resources.async_checkpoint)."""
        return self.later is not None

    def resolve(self) -> "StageResult":
        """This result with its committed manifest, once the pools have closed."""
        return self if self.later is None else StageResult(self.later.resolve(), self.skipped, self.seconds)


@dataclass
class RunContext:
    """What the stages of one run share: the blueprint, the run, where their lines go, the cancel, the loop's pools."""
    bp: Blueprint
    run_id: str
    on_line: Callable[[str], None] = print
    cancel: threading.Event | None = None
    pools: WarmPools | None = None  # the pipeline loop's warm pools; None: every stage is a fresh job
    env: dict | None = None  # extra environment for the stage jobs (such a job gets its own processes, not a pool)
    phase: int | None = None  # the index in bp.phases of the phase the stages run (pipeline.Step.phase)
    store: ArtifactStore = field(default=None)  # opened from the blueprint when not given
    # The plan's checkpoint reads (pipeline.checkpoint_reads, once per run), which retention passes keep; a stage
    # run outside a pipeline has none to keep beyond the run's last N, best and pointers.
    reads: list[tuple[str | None, str]] = field(default_factory=list)
    # rollout.async: the node's ranks this step's lane holds ("rollout" or "update", pipeline.lane_of); None: all
    lane: str | None = None
    ranks: int | None = None

    def __post_init__(self):
        if self.store is None:
            self.store = open_store(self.bp.storage)

    @property
    def nproc(self) -> int:
        """Ranks per node of this context's stage jobs: its lane's, or the node's."""
        return self.ranks or self.bp.resources.nproc_per_node


def stage_status(ctx: RunContext, stage: str, iteration, inputs: dict[str, str], *, read_output: bool = True):
    """Read-only: (key, output stage path, committed manifest there or None, input manifests). The stage is
    reusable when the committed manifest's key equals `key`. read_output=False: the output's manifest is not read
    (a forced stage replaces it, even a damaged one)."""
    manifests = {}
    for name, skey in inputs.items():
        m = ctx.store.read_manifest(skey)
        if m is None and ctx.pools is not None and (later := ctx.pools.committing(skey)) is not None:
            m = later.manifest  # committing in a warm pool's background: its key and metrics are known
        if m is None:
            raise StoreError(f"{stage}[{iteration}]: input '{name}' ({ctx.store.uri(skey)}) is not committed; "
                             "run the earlier stages first (verlflow rerun resumes at the first missing one).")
        manifests[name] = m
    key = compute_key(stage, ctx.bp, iteration, {n: m["key"] for n, m in manifests.items()}, phase=ctx.phase)
    out = stage_key(ctx.run_id, iteration, stage)
    return key, out, ctx.store.read_manifest(out) if read_output else None, manifests


@dataclass
class _Attempt:
    """A stage that runs (it is not reusable): its key, its output's store path, its inputs' manifests."""
    stage: str
    iteration: int | str
    inputs: dict[str, str]
    key: str
    out: str
    manifests: dict[str, dict]
    t0: float
    launched_at: float = 0.0  # when its job was launched (a pool's start-up counts from here, timed apart)
    oom_retry: bool = False  # the one retry after an out-of-memory error (JobSpec.oom_retry)

    @property
    def name(self) -> str:
        return f"{self.stage}[{self.iteration}]"


def run_stage(ctx: RunContext, stage: str, iteration, inputs: dict[str, str], *, force: bool = False) -> StageResult:
    """Run `stage` for `iteration` unless a committed manifest with the same key exists, whose files are all there
    and which committed after its inputs of this run (_not_reusable). `inputs` maps an input name to the stage key
    (store path) of a committed stage."""
    t0 = time.time()
    key, out, existing, manifests = stage_status(ctx, stage, iteration, inputs, read_output=not force)
    run = _Attempt(stage, iteration, inputs, key, out, manifests, t0)
    if existing is not None and existing.get("key") == key and not force:
        why = _not_reusable(ctx, run, existing)
        if why is None:
            ctx.on_line(f"[verlflow] {run.name} is committed with the same key: reusing {ctx.store.uri(out)}")
            _complete_reused(ctx, run, existing)
            return StageResult(existing, True, time.time() - t0)
        ctx.on_line(f"[verlflow] {run.name} is committed with the same key, but {why}: recomputing it")
        _refuse_unrecomputable(ctx, run, why)
    follower = _follows(ctx.bp.resources)
    if follower and spec(stage).single_process:
        return _await_commit(ctx, run)
    if not follower:
        if existing is not None or force:
            ctx.store.uncommit(out)  # invisible first, then replaced
        ctx.store.rm(out)
    try:
        return _launch(ctx, run, follower)
    except StageFailure as e:
        if not _retries_oom(ctx, run, e):
            raise
        ctx.on_line(f"[verlflow] {run.name} ran out of memory: {e.summary}")
        ctx.on_line(f"[verlflow] {run.name}: running it again once with its micro-batches at half "
                    "(resources.oom_retry)")
    run.oom_retry = True
    return _launch(ctx, run, follower)


def _launch(ctx: RunContext, run: _Attempt, follower: bool) -> StageResult:
    run.launched_at = time.time()
    pool = None if follower else _warm_pool(ctx)
    return _run_in_pool(ctx, run, pool) if pool is not None else _run_fresh(ctx, run, leader=not follower)


def _retries_oom(ctx: RunContext, run: _Attempt, failure: StageFailure) -> bool:
    """Whether a failed stage runs again once with its micro-batches at half (resources.oom_retry): it ran out of
    device memory and its rank said that half can help (memplan.RETRYING: the rank knows the resolved settings);
    its inputs are committed (a warm pool's background commits land before an OOM ends it); and it is one
    torchrun job of this agent's (a static multi-node run's agents would each relaunch it)."""
    return (failure.kind is FailureKind.OOM and RETRYING in failure.summary and not run.oom_retry
            and not _multi_node(ctx.bp.resources, run.stage)
            and all(ctx.store.read_manifest(skey) is not None for skey in run.inputs.values()))


def _not_reusable(ctx: RunContext, run: _Attempt, existing: dict) -> str | None:
    """Why a stage committed with the key it would commit is not reused (None: it is).
    - An input of this run committed after it: that input was recomputed since (a damaged one repaired, or a
      `--from` rerun that stopped before reaching this stage), and a commit never lands before its inputs' (one job
      after the other; in a warm pool, its committer's queue), so this stage was computed from bytes that are gone.
      Keys hash recipes, not bytes: only the commit times tell.
    - Its files are missing or of another size than its manifest says (what `verlflow ls` shows as DAMAGED): one
      listing of its folder, a request whatever its number of files, also on S3 (`verlflow verify` reads checksums).
    """
    since = [n for n, skey in run.inputs.items()
             if skey.startswith(f"runs/{ctx.run_id}/") and _committed_after(run.manifests[n], existing)]
    if since:
        return (f"its input{'s' * (len(since) > 1)} {', '.join(since)} ({', '.join(run.inputs[n] for n in since)}) "
                "committed after it (recomputed since)")
    problems = ctx.store.damage(run.out, checksums=False, sizes=ctx.store.sizes(run.out))
    return f"its files are damaged ({'; '.join(problems)})" if problems else None


def _committed_after(a: dict, b: dict) -> bool:
    """Whether manifest `a` was committed after manifest `b`. A warm pool's pending manifest has no time yet: it
    commits now, after any committed one (a stage recomputed in this run, its commit still in the background)."""
    import datetime as dt

    if not b.get("committed_at"):
        return False
    if not a.get("committed_at"):
        return True
    return dt.datetime.fromisoformat(a["committed_at"]) > dt.datetime.fromisoformat(b["committed_at"])


def _refuse_unrecomputable(ctx: RunContext, run: _Attempt, why: str) -> None:
    """A stage to recompute whose inputs retention pruned: stop with the rerun that can repair it, or say that none
    can (the pipeline's own check before the loop sees only the steps it knows will run)."""
    from verlflow.core.errors import PrunedError
    from verlflow.core.store import retention

    gone = {n: g for n, m in run.manifests.items() if (g := retention.needed_pruned(run.stage, n, m))}
    if not gone:
        return
    reads = "; ".join(f"its input '{n}' ({ctx.store.uri(run.inputs[n])}) needs {', '.join(g[:2])}"
                      f"{', ...' if len(g) > 2 else ''}" for n, g in gone.items())
    raise PrunedError(f"{run.name} is committed but {why}, and it cannot be recomputed: {reads}, which retention "
                      f"pruned (storage.keep_last_checkpoints, keep_best_metric); {_repair_hint(ctx, run)}.")


def _repair_hint(ctx: RunContext, run: _Attempt) -> str:
    """The nearest step of the plan a `rerun --from` can repair `run` from (core/store/retention.py repair_from)."""
    from verlflow.core.store import retention
    from verlflow.core.store.artifacts import repair_command

    steps = _plan_steps(ctx)
    keys = [k for k, _ in steps]
    if run.out not in keys:  # run_stage outside its run's plan
        return f"`verlflow verify {ctx.run_id} BLUEPRINT` names the nearest step to rerun from"
    j, blocked = retention.repair_from(ctx.store, steps, keys.index(run.out))
    if j is None:
        return (f"no step of this run can be recomputed from what the store still holds ({'; '.join(blocked)}); "
                "start a new run (another run id)")
    return (f"the nearest step this run can be repaired from is {_name_of(keys[j])}: `{repair_command(keys[j])}` "
            "(it recomputes that step and every later one)")


def _plan_steps(ctx: RunContext) -> list[tuple[str, dict[str, str]]]:
    """The run's plan as (stage key, inputs), in order (the plan's module imports this one)."""
    from verlflow.core.orchestrate.pipeline import plan, warm_start_source

    return [(stage_key(ctx.run_id, s.iteration, s.stage), s.inputs)
            for s in plan(ctx.bp, ctx.run_id, warm_start_source(ctx.bp, ctx.run_id))]


def _name_of(skey: str) -> str:
    _, _, it, stage = skey.split("/")
    return f"{stage}[{it}]"


def _complete_reused(ctx: RunContext, run: _Attempt, manifest: dict) -> None:
    """What follows a stage's commit, which a crash right after it may have cut short, done for the reused stage:
    an export's promotion (the gate, if it never ran) and its chain's cursor (core/store/promote.py after_export).
    Node 0 leads: a follower leaves the store to it."""
    if run.stage != "export" or _follows(ctx.bp.resources):
        return
    from verlflow.core.store.promote import PromotePolicy, after_export

    _, moved = after_export(ctx.store, PromotePolicy.of(ctx.bp), ctx.run_id, run.iteration, run.inputs, manifest,
                            reused=True)
    if moved:  # a gate that moves nothing leaves no mark: it may have run before, to the same decision
        ctx.on_line(f"[verlflow] {run.name}: its promotion never happened (the run stopped between its commit and "
                    f"the promotion gate): promoted it -> {moved['hf_uri']}")


def _follows(res) -> bool:
    """Static multi-node local: every node's agent runs the same stages; node 0 leads (clears the output, runs the
    single-process stages), the others join its torchrun jobs and leave the store to it."""
    return res.backend == "local" and res.nnodes > 1 and res.node_rank > 0


def _multi_node(res, stage: str) -> bool:
    return res.backend == "local" and res.nnodes > 1 and not spec(stage).single_process


def _run_fresh(ctx: RunContext, run: _Attempt, *, leader: bool = True) -> StageResult:
    """The stage as a torchrun job of its own (on a follower node: its part of node 0's job)."""
    res = ctx.bp.resources
    scratch = _scratch(res, run.stage)
    try:
        spec = _launch_spec(ctx, run, _write_job(ctx, run, scratch, pool=None), scratch)
        where = f", node {res.node_rank} of {res.nnodes}" if _multi_node(res, run.stage) else ""
        _say_launch(ctx, run, spec.nproc_per_node, spec.nnodes, f"{res.backend}{where}")
        with _nothing_left_on_failure(ctx, run, leader), _gpus(res, spec, ctx.on_line):
            launcher_for(res)(spec, on_line=ctx.on_line, cancel=ctx.cancel)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _committed(ctx, run)


def _run_in_pool(ctx: RunContext, run: _Attempt, pool: WarmPool) -> StageResult:
    """The stage as a job of the loop's warm pool; its commit may go on in the pool's background."""
    res = ctx.bp.resources
    scratch = _scratch(res, run.stage)
    try:
        job_file = _write_job(ctx, run, scratch, pool)
        _say_launch(ctx, run, ctx.nproc, 1, f"{res.backend}, warm pool{f', {ctx.lane} lane' * bool(ctx.lane)}")
        with _nothing_left_on_failure(ctx, run):
            later = pool.run(run.stage, job_file, Committing(run.name, run.out, ctx.store, scratch, ctx.on_line),
                             cancel=ctx.cancel, timeout_s=res.stage_timeout_s)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    if later is None:
        shutil.rmtree(scratch, ignore_errors=True)
        return _committed(ctx, run)
    # the pool's committer removes the scratch folder after the commit (a remote store's output is staged there)
    ctx.on_line(f"[verlflow] {run.name} done; its commit runs in the warm pool's background")
    return StageResult(later.manifest, False, time.time() - run.t0, later)


def _scratch(res, stage: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"verlflow-{stage}-", dir=scratch_root(res)))


def _say_launch(ctx: RunContext, run: _Attempt, nproc: int, nnodes: int, how: str) -> None:
    ctx.on_line(f"[verlflow] {run.name} -> {ctx.store.uri(run.out)} ({nproc} x {nnodes} ranks, {how})")


def _write_job(ctx: RunContext, run: _Attempt, scratch: Path, pool: WarmPool | None) -> Path:
    """The job file, once the inputs that another pool commits in its background have landed (the pool that
    commits an input waits for it inside the job)."""
    pending = {n: run.inputs[n] for n, m in run.manifests.items() if m.get("pending")}  # from a pool (stage_status)
    in_pool = ctx.pools.await_inputs(pending, pool, ctx.on_line, ctx.cancel) if pending else []
    job = _job_spec(ctx, run, scratch)
    job.pending_inputs = sorted(in_pool)
    return job.write(scratch / "job.json")


def _job_spec(ctx: RunContext, run: _Attempt, scratch: Path) -> JobSpec:
    bp, manifests, inputs = ctx.bp, run.manifests, run.inputs
    return JobSpec(
        stage=run.stage, run_id=ctx.run_id, iteration=run.iteration, output=run.out, scratch=str(scratch),
        blueprint=bp, phase=ctx.phase, inputs=inputs, launched_at=run.launched_at, checkpoint_reads=ctx.reads,
        oom_retry=run.oom_retry,
        input_manifests={n: InputRecord(key=m["key"], metrics=m.get("metrics", {}), lineage=m.get("lineage", []))
                         for n, m in manifests.items()},
        manifest=ManifestDraft(
            stage=run.stage, run_id=ctx.run_id, iteration=run.iteration, key=run.key,
            inputs={n: InputRef(stage=inputs[n], key=m["key"]) for n, m in manifests.items()},
            blueprint_hash=bp.hash(), blueprint_name=bp.name, code_version=code_version(run.stage),
            lineage=_lineage(manifests, inputs, None if ctx.phase is None else bp.phases[ctx.phase].label)))


def _launch_spec(ctx: RunContext, run: _Attempt, job_file: Path, scratch: Path) -> LaunchSpec:
    res = ctx.bp.resources
    single, multi = spec(run.stage).single_process, _multi_node(res, run.stage)
    nproc = 1 if single else ctx.nproc
    return LaunchSpec(module=spec(run.stage).module, args=[str(job_file)], job_arg=0, nproc_per_node=nproc,
                      nnodes=1 if single else res.nnodes, timeout_s=res.stage_timeout_s,
                      node_rank=res.node_rank if multi else 0, rdzv_endpoint=res.rdzv_endpoint if multi else None,
                      rdzv_id=f"vf-{run.key[:20]}" if multi else None,  # the same on every node's agent
                      env={**_worker_env(nproc), **(ctx.env or {})}, log_dir=str(scratch / "logs"))


@contextmanager
def _nothing_left_on_failure(ctx: RunContext, run: _Attempt, leader: bool = True):
    """A failed stage leaves nothing behind, not even invisible partial data (a follower leaves that to node 0)."""
    try:
        yield
    except BaseException:
        if leader:
            _remove_partial(ctx, run)
        raise


def _remove_partial(ctx: RunContext, run: _Attempt) -> None:
    try:
        if ctx.store.read_manifest(run.out) is None:
            ctx.store.rm(run.out)
    except Exception as exc:  # e.g. the S3 endpoint is down: keep the job's own error, not this one
        ctx.on_line(f"[verlflow] {run.name}: could not remove the partial output at {ctx.store.uri(run.out)} "
                    f"({type(exc).__name__}); it has no manifest, so nothing reads it, and the rerun replaces it")


def _committed(ctx: RunContext, run: _Attempt) -> StageResult:
    manifest = ctx.store.read_manifest(run.out)
    if manifest is None or manifest.get("key") != run.key:
        raise StoreError(f"{run.name}: the job exited cleanly but committed no manifest at {ctx.store.uri(run.out)}")
    return StageResult(manifest, False, time.time() - run.t0)


def _await_commit(ctx: RunContext, run: _Attempt) -> StageResult:
    """A follower node (node_rank > 0) of a static multi-node run: node 0 runs a single-process stage alone."""
    timeout_s = ctx.bp.resources.stage_timeout_s
    ctx.on_line(f"[verlflow] {run.name} runs on node 0 only: waiting for its commit at {ctx.store.uri(run.out)}")

    def committed() -> dict | None:
        m = ctx.store.read_manifest(run.out)
        return m if m is not None and m.get("key") == run.key else None

    m = wait_until(committed, interval_s=0.5, timeout_s=timeout_s, cancel=ctx.cancel,
                   on_cancel=_raises(FailureKind.CANCELLED, f"{run.name}: cancelled while waiting for node 0"),
                   on_timeout=_raises(FailureKind.TIMEOUT, f"{run.name}: node 0 did not commit it within "
                                      f"{timeout_s} s (resources.stage_timeout_s)"))
    return StageResult(m, False, time.time() - run.t0)


def _raises(kind, message: str):
    """An on_cancel/on_timeout of wait_until: the StageFailure this wait ends with."""
    def fail():
        raise StageFailure(kind, message)

    return fail


def _warm_pool(ctx: RunContext) -> WarmPool | None:
    """This node's warm pool for these resources, or None: the loop has no pools, the blueprint no warm workers,
    the job its own environment (a pool's was fixed at its start), or the pool is busy."""
    res = ctx.bp.resources
    if ctx.pools is None or not res.warm_pool or ctx.env:
        return None
    nproc = ctx.nproc

    def make() -> WarmPool:
        env, held = _worker_env(nproc), ExitStack()
        if res.device == "cuda":
            from verlflow.core.orchestrate import devices

            ids = held.enter_context(devices.claim(nproc, devices.visible_devices(), on_wait=ctx.on_line))
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        return WarmPool(nproc, env, scratch_root(res), ctx.on_line, commit_timeout_s=res.stage_timeout_s, held=held)

    return ctx.pools.acquire((nproc, res.device, str(scratch_root(res)), ctx.lane), make)  # a lane: its own ranks


@contextmanager
def _gpus(res, spec: LaunchSpec, on_line):
    """Local CUDA jobs get distinct GPUs of this host (held while the job runs) via CUDA_VISIBLE_DEVICES."""
    if res.backend != "local" or res.device != "cuda":
        yield
        return
    from verlflow.core.orchestrate import devices

    with devices.claim(spec.nproc_per_node, devices.visible_devices(), on_wait=on_line) as ids:
        spec.env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        yield


def _worker_env(nproc: int) -> dict:
    """Quiet, offline workers; threads split between the ranks of this node (torchrun would pick 1)."""
    import os

    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)), "HF_HUB_OFFLINE": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
           # compiled kernels survive the job (and /tmp cleaning): the next stage job loads them
           **compile_cache_env(cache_root())}
    return {k: v for k, v in env.items() if k not in os.environ}


def _makes_phase_policy(stage: str | None) -> bool:
    """Whether a stage's output is a policy a phase made epoch by epoch (lineage records those)."""
    return stage in SPECS and SPECS[stage].per_epoch


def _lineage(manifests: dict, inputs: dict, phase: str | None = None) -> list:
    """Warm-start ancestry: carried forward from inputs so every manifest knows where its weights came from. In a
    run of phases, a step that starts from another phase's policy (dpo from sft's, rl's build from dpo's) adds that
    policy, with the phase that made it."""
    def entry(name: str) -> dict:
        m, it = manifests[name], manifests[name].get("iteration")
        made_by = {"phase": it.rsplit(".", 1)[0]} if isinstance(it, str) and "." in it else {}
        return {"run_id": m.get("run_id"), "iteration": it, "stage": inputs[name], "key": m["key"], **made_by}

    if "warm_start" in manifests:
        return manifests["warm_start"].get("lineage", []) + [entry("warm_start")]
    policy = manifests.get("policy") or {}
    if phase and _makes_phase_policy(policy.get("stage")) and entry("policy").get("phase") != phase:
        return policy.get("lineage", []) + [entry("policy")]
    for name in ("policy", "build", "update"):
        if name in manifests and manifests[name].get("lineage"):
            return manifests[name]["lineage"]
    return []
