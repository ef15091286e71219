"""Promotion: the `latest` and `best` pointers of a run and of its blueprint (retention: verlflow.core.store.retention).

The export stage's after_commit calls `after_export`: the gate (`promote`), then a recurring chain's cursor.
Without promote.metric every export moves both `latest` pointers and there is no `best` pointer (retention's
storage.keep_best_metric keeps the best export by the rollout that sampled from it, known only an iteration
later). With promote.metric the exported iteration's metric (verlflow.core.metrics.of_iteration) moves a `latest`
only when it beats, by more than promote.min_delta,
both the run's start policy (its evaluation before training, evaluate[0]: the base model or the warm start; an
eval/ metric has one, validate sees to it) and that pointer's `best`: the run's `best` for `runs/<run>/latest`,
the blueprint's (across its runs) for `blueprints/<name>/latest`. So a run that never beats its start promotes
nothing, and a worse scheduled run leaves the pointer that init_from=previous warm-starts from.

Each pointer document carries its own bounded `history` (who moved it: gate, promote, rollback; when; from which
policy; the metric), written with the pointer in one conditional write. History entries name a policy by run id
and iteration, not by stage key: retention pins only what a pointer names now (a stage key anywhere in it).

A run that stopped between an export's commit and its gate is completed by its rerun: the runner reuses the export
and calls after_export(reused=True), which runs the gate if the run's `latest` shows it never ran (gated). The gate
moves the run's `latest` last, and run late it moves no pointer twice.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from verlflow.core.errors import VerlflowError
from verlflow.core.job import JobSpec
from verlflow.core.stagespec import RENAMED
from verlflow.core.store.artifacts import ArtifactStore, stage_key

if TYPE_CHECKING:
    from verlflow.core.blueprint import Blueprint

log = logging.getLogger("verlflow.promote")


@dataclass(frozen=True)
class PromotePolicy:
    """What the gate needs of a blueprint, and nothing else."""
    name: str  # the blueprint's: its pointers are blueprints/<name>/...
    metric: str | None = None
    mode: str = "max"
    min_delta: float = 0.0
    chained: bool = False  # a recurring chain (schedule.init_from=previous, no phases): an export moves its cursor
    exports: tuple[int, ...] | None = None  # the iterations that export; None: the phases say

    @classmethod
    def of(cls, bp: Blueprint) -> PromotePolicy:
        p = bp.promote
        return cls(bp.name, p.metric, p.mode, p.min_delta, bp.schedule.init_from == "previous" and not bp.phases,
                   None if bp.phases else tuple(i for i in range(1, bp.iterations + 1) if bp.exports_at(i)))

HISTORY_LEN = 50  # moves kept per pointer document: bounded, the pointer stays one small object


def run_pointer(run_id: str, kind: str = "latest") -> str:
    return f"runs/{run_id}/{kind}"


def blueprint_pointer(name: str, kind: str = "latest") -> str:
    return f"blueprints/{name}/{kind}"


def policy_of(store: ArtifactStore, manifest: dict, export: str | None = None) -> dict:
    """What a `latest` pointer says of a committed export stage (its export, the update and build behind it);
    `export`: the stage's key, where it is not the iteration's `export` folder (one committed before the rename)."""
    run_id, it = manifest["run_id"], manifest["iteration"]
    export = export or stage_key(run_id, it, "export")
    inputs = manifest.get("inputs", {})
    return {"run_id": run_id, "iteration": it, "blueprint": manifest.get("blueprint_name"),
            "export": export, "update": inputs["update"]["stage"], "build": inputs["build"]["stage"],
            "hf_uri": store.uri(export + "/hf"), "metrics": manifest.get("metrics", {}),
            "lineage": manifest.get("lineage", [])}


def committed_export(store: ArtifactStore, run_id: str, iteration: int) -> tuple[str, dict | None]:
    """(key, manifest) of an iteration's export stage, under its name of an earlier release if only that is there."""
    for name in ("export", *RENAMED):
        key = stage_key(run_id, iteration, name)
        if (manifest := store.read_manifest(key)) is not None:
            return key, manifest
    return stage_key(run_id, iteration, "export"), None


def export_of(pointer: dict) -> str:
    """The export stage a pointer names (pointers written before the stage's rename call the field `checkpoint`)."""
    return pointer.get("export") or pointer["checkpoint"]


def _entry(by: str, policy: dict, before: dict | None, metric: str | None, value: float | None) -> dict:
    return {"by": by, "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="microseconds"),
            "run_id": policy["run_id"], "iteration": policy["iteration"],
            "from": None if before is None else {"run_id": before["run_id"], "iteration": before["iteration"]},
            "metric": metric, "value": value}


def move(store: ArtifactStore, name: str, policy: dict, by: str, metric: str | None = None,
         value: float | None = None, *, only_if: Callable[[dict | None], bool] = lambda current: True,
         ) -> tuple[dict | None, dict | None]:
    """Point `name` at `policy` if `only_if(current)`, appending the move to its history, in one conditional
    write (decided on what is there at the write, whoever else moves it): (before, after; None if not moved)."""
    seen: list[dict | None] = [None]

    def change(current: dict | None) -> dict | None:
        seen[0] = current
        if not only_if(current):
            return None
        history = (current or {}).get("history", []) + [_entry(by, policy, current, metric, value)]
        return {**policy, **({"metric": metric, "value": value} if metric else {}), "history": history[-HISTORY_LEN:]}

    after = store.update_pointer(name, change)
    return seen[0], after


def beats(value: float, than: float, pp: PromotePolicy) -> bool:
    """Whether `value` is better than `than` by more than promote.min_delta (promote.mode says which way)."""
    delta = value - than if pp.mode == "max" else than - value
    return delta > pp.min_delta


def better(value: float, best: dict | None, pp: PromotePolicy) -> bool:
    """Whether `value` beats the `best` pointer by more than promote.min_delta (promote.mode says which way)."""
    if best is None or best.get("metric") != pp.metric:
        return True
    return beats(value, best["value"], pp)


def start_score(store: ArtifactStore, run_id: str, metric: str) -> float | None:
    """The run's start policy's `metric`: its evaluation before training (evaluate[0]), if it has that metric."""
    from verlflow.core.metrics import of_iteration

    return of_iteration(store, run_id, 0).get(metric)


def _replaced(best: dict | None, policy: dict) -> bool:
    """A forced rerun re-exported the very checkpoint `best` names: its old files (and value) are gone."""
    return best is not None and export_of(best) == policy["export"]


def promote(store: ArtifactStore, pp: PromotePolicy, job: JobSpec, manifest: dict) -> dict | None:
    """The gate, after the export stage committed: the pointers it moved to (None: none moved)."""
    return _gate(store, pp, job.run_id, job.iteration, job.inputs, manifest)


def after_export(store: ArtifactStore, pp: PromotePolicy, run_id: str, iteration, inputs: dict[str, str],
                 manifest: dict, *, reused: bool = False) -> tuple[bool, dict | None]:
    """What follows an export's commit: the gate, then (a recurring chain) the chain's data cursor, which only moves
    forward. `reused`: a rerun found the export committed; the gate runs only if it never did (gated). Returns
    (whether the gate ran, the policy it promoted or None)."""
    from verlflow.core.store import chain

    ran = not reused or not gated(store.get_pointer(run_pointer(run_id)), run_id, iteration, manifest)
    moved = _gate(store, pp, run_id, iteration, inputs, manifest, late=reused) if ran else None
    if pp.chained:  # the build joined the chain (stages/build)
        chain.advance(store, pp.name, manifest["metrics"]["data_cursor"])
    return ran, moved


def gated(pointer: dict | None, run_id: str, iteration, manifest: dict) -> bool:
    """Whether the run's `latest` pointer (the gate's last move: _gate) shows that the export's gate ran, or has no
    say any more: the pointer names it or a later export of the run, or its history has a move to it, or a move
    after it committed (a later export's gate, a person's promote or rollback). A gate that promoted nothing leaves
    no mark: a rerun runs it again, on the same scores, to the same decision."""
    if pointer is None:
        return False
    if pointer.get("run_id") == run_id and _at_or_after(pointer.get("iteration"), iteration):
        return True
    return any((e.get("run_id"), e.get("iteration")) == (run_id, iteration) or _after(e.get("at"), manifest)
               for e in pointer.get("history", []))


def _at_or_after(named, iteration) -> bool:
    """Iteration `named` is `iteration` or later in a plan: ints by number; a name (the last phase's export, after
    every rl iteration) is after any number."""
    if named == iteration:
        return True
    if isinstance(named, int) and isinstance(iteration, int):
        return named > iteration
    return isinstance(named, str) and isinstance(iteration, int)


def _after(at: str | None, manifest: dict) -> bool:
    """Whether a pointer move made `at` came after the commit of `manifest`."""
    committed = manifest.get("committed_at")
    return bool(at and committed) and dt.datetime.fromisoformat(at) > dt.datetime.fromisoformat(committed)


def _names(pointer: dict | None, policy: dict) -> bool:
    return pointer is not None and (pointer.get("run_id"), pointer.get("iteration")) == (
        policy["run_id"], policy["iteration"])


def _gate(store: ArtifactStore, pp: PromotePolicy, run_id: str, iteration, inputs: dict[str, str], manifest: dict,
          late: bool = False) -> dict | None:
    """The gate: the pointers it moved to (None: none moved). The blueprint's pointers move first, the run's
    `latest` last: a rerun reads that one as the gate's mark (gated). `late`: the gate of a reused export, whose
    earlier run stopped between the commit and the gate, maybe between two of its moves: it moves no pointer a
    second time, and under no promote.metric leaves a blueprint `latest` that moved since the export committed (a
    newer export, or a person, had the last word)."""
    from verlflow.core.metrics import of_iteration

    policy = policy_of(store, {**manifest, "run_id": run_id, "iteration": iteration, "blueprint_name": pp.name,
                               "inputs": {n: {"stage": k} for n, k in inputs.items()}})

    def moves(current: dict | None) -> bool:
        return not late or not _names(current, policy)

    metric = pp.metric
    if metric is None:
        move(store, blueprint_pointer(pp.name), policy, "gate", only_if=lambda current: moves(current) and not (
            late and current and _after((current.get("history") or [{}])[-1].get("at"), manifest)))
        move(store, run_pointer(run_id), policy, "gate", only_if=moves)
        log.info("promoted %s iteration %s -> %s", run_id, iteration, policy["hf_uri"])
        return policy
    value = of_iteration(store, run_id, iteration).get(metric)
    if value is None or not math.isfinite(value):
        log.warning("not promoted: %s iteration %s has no finite %s (missing, or NaN); the latest pointers stay",
                    run_id, iteration, metric)
        return None
    start = start_score(store, run_id, metric)
    if start is not None and not beats(value, start, pp):
        log.info("not promoted: %s iteration %s has %s=%s, not better than its start policy's %s=%s (evaluate[0]) "
                 "by more than promote.min_delta=%s (promote.mode %s); the latest pointers stay", run_id,
                 iteration, metric, value, metric, start, pp.min_delta, pp.mode)
        return None
    if start is None and metric.startswith("eval/"):
        log.warning("%s has no evaluation of its start policy (evaluate[0]) with a finite %s: iteration %s is "
                    "compared with the best pointers only", run_id, metric, iteration)
    moved = False
    for scope, latest, best_name in ((pp.name, blueprint_pointer(pp.name), blueprint_pointer(pp.name, "best")),
                                     (run_id, run_pointer(run_id), run_pointer(run_id, "best"))):
        best, won = move(store, best_name, policy, "gate", metric, value, only_if=lambda best: moves(best) and (
            better(value, best, pp) or (not late and _replaced(best, policy))))
        if won or (late and _names(best, policy)):  # late: this gate moved `best` before the run stopped
            move(store, latest, policy, "gate", metric, value, only_if=moves)
            log.info("promoted %s iteration %s (%s=%s, the best of %s so far) -> %s", run_id, iteration,
                     metric, value, scope, policy["hf_uri"])
            moved = True
        else:
            log.info("not promoted for %s: %s iteration %s has %s=%s, not better than the best %s (%s iteration %s) "
                     "by more than promote.min_delta=%s (promote.mode %s)", scope, run_id, iteration, metric,
                     value, best["value"], best["run_id"], best["iteration"], pp.min_delta, pp.mode)
    return policy if moved else None


# ---------- what the pointer says, in words: the summaries read it once the commits have landed, never guess

def promotion_status(store: ArtifactStore, pp: PromotePolicy, run_id: str) -> str:
    """What `runs/<run>/latest` names now, in words: which policy, or why none."""
    pointer = store.get_pointer(run_pointer(run_id))
    if pointer is None:
        return f"No policy promoted: {_why_none(store, pp, run_id)}"
    scored = f" ({pointer['metric']}={pointer['value']:.4g})" if pointer.get("metric") else ""
    by = (pointer.get("history") or [{}])[-1].get("by", "gate")
    by = f", by `verlflow {by}`" if by != "gate" else ""
    return f"Promoted policy: iteration {pointer['iteration']}{scored}{by}"


def _why_none(store: ArtifactStore, pp: PromotePolicy, run_id: str) -> str:
    metric = pp.metric
    if metric is None or not _an_export_committed(store, pp, run_id):
        return "no export of this run has been committed yet"
    start = start_score(store, run_id, metric)
    if start is None:
        return f"no committed export of this run has a finite {metric}"
    return (f"no export of this run beat its start policy's {metric}={start:.4g} (evaluate[0]) by more than "
            f"promote.min_delta={pp.min_delta}, so the start policy stays the one to use")


def _an_export_committed(store: ArtifactStore, pp: PromotePolicy, run_id: str) -> bool:
    """Whether an export stage of the run's plan is committed (the latest first: usually the first read)."""
    if pp.exports is None:  # its exports' iterations are its phases' to say; the gate has decided on something by then
        return True
    return any(store.read_manifest(stage_key(run_id, i, "export")) is not None for i in reversed(pp.exports))


def export_verdict(store: ArtifactStore, run_id: str, iteration: int | str) -> str:
    """Whether a committed export is its run's promoted policy: what the run's `latest` pointer names now."""
    pointer = store.get_pointer(run_pointer(run_id))
    if pointer is not None and pointer["iteration"] == iteration:
        return "promoted: the run's latest pointer names it"
    named = f"iteration {pointer['iteration']}" if pointer else "no policy"
    return f"not promoted: the run's latest pointer names {named}"


# ---------- a person's moves: `verlflow promote RUN ITER`, `verlflow rollback NAME`

def promotable(store: ArtifactStore, run_id: str) -> list[int]:
    """The iterations of a run whose export stage is committed and still holds its export."""
    out = []
    for key in store.ls(f"runs/{run_id}"):
        parts = key.split("/")
        if len(parts) == 5 and parts[3] in ("export", *RENAMED) and parts[4] == "manifest.json" and parts[2].isdigit():
            if _export_held(store.read_manifest("/".join(parts[:4]))):
                out.append(int(parts[2]))
    return sorted(out)


def _export_held(manifest: dict | None) -> bool:
    return manifest is not None and not any(r.startswith("hf/") for r in manifest.get("pruned_files", []))


def _nearest(store: ArtifactStore, run_id: str, iteration: int) -> str:
    its = sorted(promotable(store, run_id), key=lambda i: (abs(i - iteration), i))
    return (f"promotable iterations of {run_id}: {', '.join(map(str, sorted(its)))} (nearest: {its[0]})" if its
            else f"run {run_id} has no promotable iteration")


def promote_by_hand(store: ArtifactStore, run_id: str, iteration: int) -> list[tuple[str, dict | None, dict]]:
    """Move the run's and its blueprint's `latest` to the iteration's export: (pointer, before, after) each."""
    key, manifest = committed_export(store, run_id, iteration)
    if manifest is None:
        raise VerlflowError(f"verlflow promote {run_id} {iteration}: iteration {iteration} of run {run_id} has no "
                            f"committed export stage in {store.root_uri}; {_nearest(store, run_id, iteration)}.")
    if not _export_held(manifest):
        raise VerlflowError(f"verlflow promote {run_id} {iteration}: the export of iteration {iteration} "
                            f"({store.uri(key)}/hf) was pruned by retention "
                            f"(storage.keep_last); {_nearest(store, run_id, iteration)}.")
    policy = policy_of(store, manifest, key)
    if not policy["blueprint"]:
        raise VerlflowError(f"{key}: its manifest names no blueprint")
    return [(name, *move(store, name, policy, "promote"))
            for name in (run_pointer(run_id), blueprint_pointer(policy["blueprint"]))]


def rollback_target(pointer: dict) -> dict | None:
    """The policy a rollback returns to: the history replayed as a stack (a gate or promote pushes its policy, a
    rollback pops the one it undid), one below the top."""
    stack: list[dict] = []
    for e in pointer.get("history", []):
        if e["by"] == "rollback":
            stack = stack[:-1]
        else:
            stack.append(e)
    return stack[-2] if len(stack) > 1 else None


def rollback(store: ArtifactStore, name: str) -> tuple[dict, dict]:
    """Move blueprint `name`'s `latest` back to the previous policy of its history: (before, after)."""
    pointer_name = blueprint_pointer(name)
    current = store.get_pointer(pointer_name)
    if current is None:
        raise VerlflowError(f"verlflow rollback {name}: blueprint {name} has no latest pointer in {store.root_uri} "
                            "(nothing was promoted under that name; `verlflow ls` lists the runs).")
    target = rollback_target(current)
    if target is None:
        raise VerlflowError(f"verlflow rollback {name}: the history of {pointer_name} has no earlier policy than "
                            f"{current['run_id']} iteration {current['iteration']}; nothing to roll back to.")
    key, manifest = committed_export(store, target["run_id"], target["iteration"])
    if not _export_held(manifest):
        nearest = _nearest(store, target["run_id"], target["iteration"])
        raise VerlflowError(f"verlflow rollback {name}: the previous policy, {target['run_id']} iteration "
                            f"{target['iteration']}, has no export any more (retention pruned it); move the pointer "
                            f"with `verlflow promote RUN ITER` instead ({nearest}).")
    before, after = move(store, pointer_name, policy_of(store, manifest, key), "rollback", target.get("metric"),
                         target.get("value"), only_if=lambda now: now == current)
    if after is None:
        raise VerlflowError(f"verlflow rollback {name}: {pointer_name} moved while rolling back (now "
                            f"{before['run_id']} iteration {before['iteration']}); nothing changed, run it again.")
    return before, after
