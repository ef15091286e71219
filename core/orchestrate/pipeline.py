"""The pipeline as data: validate -> build -> (rollout -> update [-> checkpoint]) x iterations, a checkpoint
step (HF export, promotion) every storage.export_every iterations and at the last.

Inputs are store paths known in advance, so the plan is fixed before anything runs; the CLI and the Prefect
flow both run it through the one loop here (`run_pipeline`), the flow with its hooks (tasks, slots, its Retry).
"""

import re
import threading
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Callable

from verlflow.core.blueprint import Blueprint
from verlflow.core.errors import BlueprintError
from verlflow.core.orchestrate.pool import warm_pools
from verlflow.core.orchestrate.runner import RunContext, StageResult, open_store, run_stage
from verlflow.core.store.artifacts import stage_key


@dataclass
class Step:
    stage: str
    iteration: int | str
    inputs: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.stage}[{self.iteration}]"


def warm_start_source(bp: Blueprint, run_id: str) -> str | None:
    """For init_from=previous: the update stage behind this blueprint's last promoted policy, if any. A rerun
    keeps the source its build recorded, even if another run was promoted since."""
    if bp.schedule.init_from != "previous":
        return None
    store = open_store(bp)
    built = store.read_manifest(stage_key(run_id, "init", "build"))
    if built is not None:
        return built["inputs"].get("warm_start", {}).get("stage")
    pointer = store.get_pointer(f"blueprints/{bp.name}/latest")
    return pointer["update"] if pointer and pointer["run_id"] != run_id else None


def exports_at(bp: Blueprint, iteration: int) -> bool:
    """Whether the iteration has a checkpoint step (HF export, promotion): every storage.export_every, and the last."""
    return iteration % bp.storage.export_every == 0 or iteration == bp.iterations


def plan(bp: Blueprint, run_id: str, warm_start: str | None = None) -> list[Step]:
    build = stage_key(run_id, "init", "build")
    steps = [Step("validate", "init"), Step("build", "init", {"warm_start": warm_start} if warm_start else {})]
    policy = build
    for i in range(1, bp.iterations + 1):
        rollout, update = stage_key(run_id, i, "rollout"), stage_key(run_id, i, "update")
        steps += [
            Step("rollout", i, {"build": build, "policy": policy}),
            Step("update", i, {"build": build, "policy": policy, "rollout": rollout}),
        ]
        if exports_at(bp, i):
            steps.append(Step("checkpoint", i, {"build": build, "update": update, "rollout": rollout}))
        policy = update
    return steps


def parse_from(text: str | None, steps: list[Step]) -> int | None:
    """`--from update[2]` (or `update:2`, or `build`) -> index of the first step to force."""
    if not text:
        return None
    m = re.fullmatch(r"(\w+)(?:[\[:](\w+)\]?)?", text.strip())
    names = [s.name for s in steps]
    for i, s in enumerate(steps):
        if m and s.stage == m.group(1) and (m.group(2) is None or str(s.iteration) == m.group(2)):
            return i
    why = (" (a checkpoint step exports every storage.export_every iterations and at the last)"
           if m and m.group(1) == "checkpoint" else "")
    raise BlueprintError(f"--from {text}: no such step{why}; choose one of {', '.join(names)}")


def checked_plan(bp: Blueprint, run_id: str, force_from: str | None,
                 warm_start: str | None = None) -> tuple[list[Step], int | None]:
    """The steps and the index of the first forced one; raises on a bad run id or --from before anything runs."""
    steps = plan(bp, run_id, warm_start)
    return steps, parse_from(force_from, steps)


def run_here(ctx: RunContext, step: Step, force: bool) -> StageResult:
    return run_stage(ctx, step.stage, step.iteration, step.inputs, force=force)


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
    steps, first_forced = checked_plan(bp, run_id, force_from, warm_start_source(bp, run_id))
    results = []
    with warm_pools() as pools, hooks.hold():  # pools: for stages whose blueprint sets resources.warm_workers
        ctx = RunContext(bp, run_id, on_line=on_line, cancel=cancel, pools=pools)
        for i, step in enumerate(steps):
            force = first_forced is not None and i >= first_forced and not hooks.recomputed(step)
            res = hooks.run_step(ctx, step, force)
            results.append(res)
            if on_step:
                on_step(step, res)
    # The pools have closed, so every background commit has landed (or warm_pools raised): report the manifests.
    return [StageResult(ctx.store.read_manifest(stage_key(run_id, s.iteration, s.stage)), r.skipped, r.seconds)
            if r.pending else r for s, r in zip(steps, results)]
