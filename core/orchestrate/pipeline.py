"""The pipeline as data: validate -> build [-> evaluate] -> (rollout -> update [-> evaluate] [-> checkpoint]) x
iterations: an export step (HF export, promotion) every storage.export_every iterations and at the last, an
evaluate step (held-out prompts, eval.files) before training and every eval.every iterations and at the last.

Inputs are store paths known in advance, so the plan is fixed before anything runs; the CLI and the Prefect
flow both run it through the one loop here (`run_pipeline`), the flow with its hooks (tasks, slots, its Retry).

With rollout.async the plan is a graph run on two lanes of the node's ranks: rollout[i] samples from
update[i-1-staleness]'s policy, so rollout[i+1] runs on the rollout's ranks while update[i] trains on the others
(`_run_lanes`). The steps' order is still one the sequential loop could run: a rerun, `--from` and the keys
read it as before.
"""

import contextvars
import hashlib
import json
import re
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Callable

from verlflow.core import userstage
from verlflow.core.blueprint import Blueprint
from verlflow.core.errors import BlueprintError, PrunedError
from verlflow.core.orchestrate.pool import warm_pools
from verlflow.core.orchestrate.runner import RunContext, StageResult, _follows, compute_key, run_stage
from verlflow.core.stagespec import RENAMED, SPECS, StageSpec
from verlflow.core.store import retention
from verlflow.core.store.artifacts import ArtifactStore, open_store, repair_command, stage_key
from verlflow.core.tracking import tracked


@dataclass
class Step:
    stage: str
    iteration: int | str
    inputs: dict[str, str] = field(default_factory=dict)
    bp: Blueprint | None = None  # its phase's blueprint (Blueprint.phase_blueprint); None: the run's
    phase: int | None = None  # the index in bp.phases of the phase it runs; None: the run has no phases

    @property
    def name(self) -> str:
        return f"{self.stage}[{self.iteration}]"

    def context(self, ctx: RunContext) -> RunContext:
        """The run's context with this step's blueprint and phase: its keys, resources and job read those."""
        return ctx if self.bp is None else replace(ctx, bp=self.bp, phase=self.phase)


def warm_start_source(bp: Blueprint, run_id: str) -> str | None:
    """For init_from=previous: the update stage behind this blueprint's last promoted policy, if any (none: the
    base model; the build's manifest says which and why). A rerun keeps the source its build recorded, even if
    another run was promoted since."""
    if bp.schedule.init_from != "previous":
        return None
    store = open_store(bp.storage)
    built = store.read_manifest(stage_key(run_id, "init", "build"))
    if built is not None:
        return built["inputs"].get("warm_start", {}).get("stage")
    pointer = store.get_pointer(f"blueprints/{bp.name}/latest")
    return pointer["update"] if pointer and pointer["run_id"] != run_id else None


def run_blueprint(bp: Blueprint, run_id: str) -> Blueprint:
    """The blueprint a run's stages get. A run of a recurring chain (schedule.init_from: previous) gets its own
    seed, from the blueprint's and its run id (which a rerun and the UI's Retry keep), so no two runs of the chain
    sample or shuffle alike even from the same policy; its prompts continue the chain's (core/store/chain.py). Any
    other run seeds with `seed`."""
    if bp.schedule.init_from != "previous":
        return bp
    return bp.model_copy(update={"seed": int(hashlib.sha256(f"{bp.seed}/{run_id}".encode()).hexdigest()[:8], 16)})


def exports_at(bp: Blueprint, iteration: int) -> bool:
    """Whether the iteration has an export step (HF export, promotion): Blueprint.exports_at."""
    return bp.exports_at(iteration)


def plan(bp: Blueprint, run_id: str, warm_start: str | None = None) -> list[Step]:
    build = stage_key(run_id, "init", "build")
    steps = [Step("validate", "init"), Step("build", "init", {"warm_start": warm_start} if warm_start else {})]
    steps += _phase_steps(bp, run_id, build) if bp.phases else _rl_steps(bp, run_id, build)
    for step in steps:
        step_spec(step).check_wiring(step.inputs, step.name)
    return steps


def step_spec(step: Step) -> StageSpec:
    """The step's stage spec; a user stage's is its class's (what it reads)."""
    if step.stage == "user":
        return userstage.spec_of(userstage.load(step.bp.phases[step.phase].kind))
    return SPECS[step.stage]


def checkpoint_reads(steps: list[Step], run_id: str) -> list[tuple[str | None, str]]:
    """What retention must not prune while the plan needs it: (reader's stage key, the stage key whose training
    checkpoint it reads) for every step, and (None, key) for each phase's start policy (its first step's)."""
    reads, phase = [], None
    for step in steps:
        out = stage_key(run_id, step.iteration, step.stage)
        starts = step.phase is not None and step.phase != phase
        phase = step.phase
        for name, key in step.inputs.items():
            if key.startswith(f"runs/{run_id}/") and retention.reads_checkpoint(step.stage, name):
                reads.append((None if starts else out, key))
    return reads


def _rl_steps(bp: Blueprint, run_id: str, build: str, phase_bp: Blueprint | None = None,
              phase: int | None = None) -> list[Step]:
    """[evaluate 0] + (rollout -> update [-> evaluate] [-> checkpoint]) x iterations, from the build's policy."""
    steps = []
    if bp.evaluates_at(0):
        steps.append(Step("evaluate", 0, {"build": build, "policy": build}, phase_bp, phase))
    policy = build
    for i in range(1, bp.iterations + 1):
        rollout, update = stage_key(run_id, i, "rollout"), stage_key(run_id, i, "update")
        steps += [
            Step("rollout", i, {"build": build, "policy": sampling_policy(bp, run_id, build, i)}, phase_bp, phase),
            Step("update", i, {"build": build, "policy": policy, "rollout": rollout}, phase_bp, phase),
        ]
        evaluated = {}
        if bp.evaluates_at(i):  # before the export step: its promotion may be decided by this evaluation
            steps.append(Step("evaluate", i, {"build": build, "policy": update}, phase_bp, phase))
            evaluated = {"evaluate": stage_key(run_id, i, "evaluate")}
        if exports_at(bp, i):
            steps.append(Step("export", i, {"build": build, "update": update, "rollout": rollout, **evaluated},
                              phase_bp, phase))
        policy = update
    return steps


def sampling_policy(bp: Blueprint, run_id: str, build: str, iteration: int) -> str:
    """The policy rollout[iteration] samples from: the last update's, or with rollout.async the one `staleness`
    updates older (the build's before the first)."""
    lag = bp.rollout.async_.staleness if bp.rollout.async_ is not None else 0
    older = iteration - 1 - lag
    return stage_key(run_id, older, "update") if older >= 1 else build


def lane_of(bp: Blueprint, step: Step) -> str | None:
    """rollout.async: the rollouts run on the rollout's ranks, every other step on the update's; None: one lane."""
    if bp.rollout.async_ is None:
        return None
    return "rollout" if step.stage == "rollout" else "update"


def _phase_steps(bp: Blueprint, run_id: str, build: str) -> list[Step]:
    """Each phase from its start policy (the previous phase's, the model's, or a named phase's): sft/dpo one step
    an epoch (`sft[<phase>.<epoch>]`), rl its own build from that policy (its reference) and its iterations,
    evaluate one step, a user stage one step (`user[<phase>]`) with the inputs its class lists. The last phase's
    policy is exported (and promoted) by an export step."""
    steps: list[Step] = []
    ends: dict[str, str] = {}  # phase name -> the stage holding its final policy (a user stage's: its output)
    policy, rollout = build, None
    for i, ph in enumerate(bp.phases):
        pbp = bp.phase_blueprint(i)
        start = build if ph.init_from == "model" else ends[ph.init_from] if ph.init_from else policy
        if ph.user:
            cls = userstage.load(ph.kind, f"phases[{i}].kind")
            given = {"build": build, "policy": start, **({"rollout": rollout} if rollout else {}), **ends}
            steps.append(Step("user", ph.label, {n: given[n] for n in cls.inputs}, pbp, i))
            out = stage_key(run_id, ph.label, "user")
            ends[ph.label] = out if "policy" in cls.outputs else start
            policy = ends[ph.label]
            continue
        if ph.kind == "evaluate":
            steps.append(Step("evaluate", ph.label, {"build": build, "policy": start}, pbp, i))
            ends[ph.label] = policy = start
            continue
        if ph.kind == "rl":
            rl_build = build
            if start != build:  # the rl reference is the phase's start policy, as its own build
                steps.append(Step("build", ph.label, {"warm_start": start}, pbp, i))
                rl_build = stage_key(run_id, ph.label, "build")
            steps += _rl_steps(pbp, run_id, rl_build, pbp, i)
            ends[ph.label] = policy = stage_key(run_id, pbp.iterations, "update")
            rollout = stage_key(run_id, pbp.iterations, "rollout")
            continue
        prev, first = start, None
        for epoch in range(1, ph.epochs + 1):
            label = f"{ph.label}.{epoch}"
            inputs = {"build": build, "policy": prev}
            if ph.kind == "dpo" and first is not None:
                inputs["reference"] = first  # the reference log-probs its first epoch scored
            steps.append(Step(ph.kind, label, inputs, pbp, i))
            prev = stage_key(run_id, label, ph.kind)
            first = first or prev
        ends[ph.label] = policy = prev
    last = bp.phases[-1]
    if last.kind in ("sft", "dpo"):
        steps.append(Step("export", last.label, {"build": build, "update": policy},
                          bp.phase_blueprint(len(bp.phases) - 1), len(bp.phases) - 1))
    return steps


def parse_from(text: str | None, steps: list[Step]) -> int | None:
    """`--from update[2]` (or `update:2`, or `build`) -> index of the first step to force."""
    if not text:
        return None
    m = re.fullmatch(r"(\w+)(?:[\[:]([\w.-]+)\]?)?", text.strip())
    names = [s.name for s in steps]
    stage = m and RENAMED.get(m.group(1), m.group(1))
    for i, s in enumerate(steps):
        it = str(s.iteration)  # a phase's epoch: dpo[3] is dpo[<phase>.3]
        if m and s.stage == stage and (m.group(2) in (None, it) or it.endswith(f".{m.group(2)}")):
            return i
    why = (" (an export step runs every storage.export_every iterations and at the last)"
           if stage == "export" else "")
    raise BlueprintError(f"--from {text}: no such step{why}; choose one of {', '.join(names)}")


def checked_plan(bp: Blueprint, run_id: str, force_from: str | None,
                 warm_start: str | None = None) -> tuple[list[Step], int | None]:
    """The steps and the index of the first forced one; raises on a bad run id or --from before anything runs."""
    steps = plan(bp, run_id, warm_start)
    return steps, parse_from(force_from, steps)


def plan_key(run_id: str) -> str:
    return f"plans/{run_id}.json"


def record_plan(store: ArtifactStore, bp: Blueprint, run_id: str, steps: list[Step]) -> None:
    """What the run's latest start plans: `verlflow ls` counts its iterations and tells a finished run from a
    stopped one by it. Outside runs/, whose folders are stages."""
    store.put_bytes(plan_key(run_id), json.dumps({"blueprint_name": bp.name,
                                                  "steps": [[s.stage, s.iteration] for s in steps]}).encode())


def recorded_plan(store: ArtifactStore, run_id: str) -> dict | None:
    """record_plan's document, or None (a run of an older release, or one written half)."""
    if not store.exists(plan_key(run_id)):
        return None
    try:
        return json.loads(store.get_bytes(plan_key(run_id)))
    except ValueError:
        return None


def steps_that_run(store: ArtifactStore, bp: Blueprint, run_id: str, steps: list[Step],
                   forced: list[bool]) -> list[bool]:
    """Which steps the loop will run rather than reuse: the runner's rule (a committed manifest with the key that
    compute_key gives is reused) applied to the plan before anything runs. A step that runs commits that key."""
    keys: dict[str, str | None] = {}
    runs = []
    for step, force in zip(steps, forced):
        inputs = {n: keys[k] if k in keys else (store.read_manifest(k) or {}).get("key")
                  for n, k in step.inputs.items()}
        key = None if None in inputs.values() else compute_key(step.stage, step.bp or bp, step.iteration, inputs,
                                                                     phase=step.phase)
        out = stage_key(run_id, step.iteration, step.stage)
        runs.append(force or key is None or (store.read_manifest(out) or {}).get("key") != key)
        keys[out] = key
    return runs


def check_not_pruned(store: ArtifactStore, run_id: str, steps: list[Step], runs: list[bool]) -> None:
    """Refuse, before anything runs, a plan whose running step needs a checkpoint retention pruned."""
    produced = {stage_key(run_id, s.iteration, s.stage) for s, r in zip(steps, runs) if r}
    for step, run in zip(steps, runs):
        for name, skey in step.inputs.items() if run else ():
            manifest = None if skey in produced else store.read_manifest(skey)
            gone = retention.needed_pruned(step.stage, name, manifest) if manifest else []
            if gone:
                raise PrunedError(f"{step.name} needs {store.uri(skey)} ({', '.join(gone[:2])}"
                                  f"{', ...' if len(gone) > 2 else ''}), which retention pruned "
                                  f"(storage.keep_last_checkpoints, keep_best_metric); "
                                  f"{_resume_hint(store, run_id, skey)}")


def _resume_hint(store: ArtifactStore, run_id: str, pruned: str) -> str:
    """The nearest resumable step: the one after the latest kept checkpoint at or before the pruned one."""
    _, run, it, _ = pruned.split("/")
    if run != run_id:
        return "it belongs to another run, so this one cannot be built again from it; start a new run id."
    for j in range(int(it) if it.isdigit() else 0, -1, -1):
        holder = stage_key(run_id, j, "update") if j else stage_key(run_id, "init", "build")
        if retention.has_checkpoint(store.read_manifest(holder)):
            step = stage_key(run_id, j + 1, "rollout")
            break
    else:
        step = stage_key(run_id, "init", "build")
    name = f"{step.split('/')[3]}[{step.split('/')[2]}]"
    return f"the nearest step this run can resume from is {name}: `{repair_command(step)}`."


def run_here(ctx: RunContext, step: Step, force: bool) -> StageResult:
    return run_stage(step.context(ctx), step.stage, step.iteration, step.inputs, force=force)


def _run_steps(ctx: RunContext, steps: list[Step], forced: list[bool], hooks: "PipelineHooks",
               finished: Callable[[Step, StageResult], None]) -> list[StageResult]:
    """The steps one after the other; with rollout.async, on two lanes side by side (_run_lanes)."""
    if ctx.bp.rollout.async_ is not None:
        return _run_lanes(ctx, steps, forced, hooks, finished)
    results = []
    for step, force in zip(steps, forced):
        results.append(hooks.run_step(ctx, step, force))
        finished(step, results[-1])
    return results


def _lane_context(ctx: RunContext, lane: str) -> RunContext:
    """The run's context for one lane: its share of the node's ranks (rollout.async.devices), its own warm pool."""
    rollout, update = ctx.bp.rollout.async_.split(ctx.bp.resources.nproc_per_node)
    return replace(ctx, lane=lane, ranks=rollout if lane == "rollout" else update)


def _run_lanes(ctx: RunContext, steps: list[Step], forced: list[bool], hooks: "PipelineHooks",
               finished: Callable[[Step, StageResult], None]) -> list[StageResult]:
    """rollout.async: each step starts once the steps it reads and the earlier steps of its lane are done, so the
    two lanes run side by side (rollout[i+1] beside update[i]). A failed step starts nothing more, lets the other
    lane's step end, and raises; a Cancel or Ctrl-C raises at once (warm_pools kills the pools on the way out).
    Returns the results in the plan's order."""
    made = {stage_key(ctx.run_id, s.iteration, s.stage): i for i, s in enumerate(steps)}
    lanes = [lane_of(ctx.bp, s) for s in steps]
    contexts = {lane: _lane_context(ctx, lane) for lane in set(lanes)}
    results: list[StageResult | None] = [None] * len(steps)

    def ready(i: int) -> bool:
        reads = [made[k] for k in steps[i].inputs.values() if k in made]
        before = [j for j in range(i) if lanes[j] == lanes[i]] + reads
        return all(results[j] is not None for j in before)

    waiting, running, error = list(range(len(steps))), {}, None
    lanes_pool = ThreadPoolExecutor(max_workers=len(contexts), thread_name_prefix="verlflow-lane")
    try:
        while running or (waiting and error is None):
            for i in [i for i in waiting if ready(i)] if error is None else []:
                waiting.remove(i)
                job = contextvars.copy_context().run  # a Prefect task run sees its flow run's context
                running[lanes_pool.submit(job, hooks.run_step, contexts[lanes[i]], steps[i], forced[i])] = i
            if not running:
                raise AssertionError(f"rollout.async: no step of {[steps[i].name for i in waiting]} can start")
            for future in wait(running, return_when=FIRST_COMPLETED).done:
                i = running.pop(future)
                try:
                    results[i] = future.result()
                    finished(steps[i], results[i])
                except Exception as e:  # raised once the other lane's step has ended
                    error = error or e
    finally:  # a Cancel or Ctrl-C (BaseException) returns at once: warm_pools then kills the lanes' pools
        lanes_pool.shutdown(wait=False, cancel_futures=True)
    if error is not None:
        raise error
    return results


@dataclass(frozen=True)
class PipelineHooks:
    """What an orchestrator adds to the one loop (the Prefect flow: verlflow.flows.common.flow_hooks)."""
    run_step: Callable[[RunContext, Step, bool], StageResult] = run_here  # how a step runs (a Prefect task...)
    hold: Callable[[], AbstractContextManager] = nullcontext  # held around the loop, inside its warm pools
    recomputed: Callable[[Step], bool] = lambda step: False  # a forced step this orchestrator run already redid


def run_pipeline(bp: Blueprint, run_id: str, *, on_line: Callable[[str], None] = print,
                 on_step: Callable[[Step, StageResult], None] | None = None, force_from: str | None = None,
                 cancel: threading.Event | None = None, hooks: PipelineHooks = PipelineHooks()) -> list[StageResult]:
    """The pipeline, step by step; a stage committed with the same key is reused. Returns each step's result,
    with the manifests that warm pools committed in their background once the pools have closed."""
    if (own := run_blueprint(bp, run_id)) is not bp:
        on_line(f"[verlflow] {run_id}: seed {own.seed}, the run's own (schedule.init_from: previous derives it "
                f"from seed {bp.seed} and the run id)")
        bp = own
    steps, first_forced = checked_plan(bp, run_id, force_from, warm_start_source(bp, run_id))
    forced = [first_forced is not None and i >= first_forced and not hooks.recomputed(s) for i, s in enumerate(steps)]
    store = open_store(bp.storage)
    check_not_pruned(store, run_id, steps, steps_that_run(store, bp, run_id, steps, forced))
    with tracked(bp, run_id, store, enabled=not _follows(bp.resources)) as tracker:  # node 0 tracks
        with warm_pools() as pools, hooks.hold():  # pools: for stages whose blueprint sets resources.warm_workers
            ctx = RunContext(bp, run_id, on_line=on_line, cancel=cancel, pools=pools, store=store,
                             reads=checkpoint_reads(steps, run_id))

            ended: list[Step] = []

            def finished(step: Step, res: StageResult) -> None:
                if not ended and not _follows(bp.resources):  # the run has a stage: a refused one leaves nothing
                    record_plan(store, bp, run_id, steps)
                ended.append(step)
                tracker.step(step.stage, step.iteration, res.manifest)
                if on_step:
                    on_step(step, res)

            results = _run_steps(ctx, steps, forced, hooks, finished)
        # The pools have closed, so every background commit has landed (or warm_pools raised): report the manifests.
        if not _follows(bp.resources):  # a follower node leaves the store to node 0
            # also finishes what a crash mid-prune left, if every step was reused
            retention.retain(store, bp.storage, run_id, head=bp.iterations, reads=ctx.reads)
        done = [r.resolve() for r in results]
        for step, res in zip(steps, done):  # the background commits; the ledger skips steps logged above
            tracker.step(step.stage, step.iteration, res.manifest)
        tracker.promoted()
    return done
