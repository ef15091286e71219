"""Promotion: the `latest` and `best` pointers of a run and of its blueprint (retention: verlflow.core.store.retention).

The checkpoint stage's after_commit calls `promote` (the gate). Without promote.metric every export moves both
`latest` pointers and there is no `best` pointer (retention's storage.keep_best_metric keeps the best export by
the rollout that sampled from it, known only an iteration later). With promote.metric the exported iteration's
metric (verlflow.core.metrics.of_iteration) moves a `latest` only when it beats that pointer's `best` by more
than promote.min_delta: the run's `best` for `runs/<run>/latest`, the blueprint's (across its runs) for
`blueprints/<name>/latest`, so a worse scheduled run leaves the pointer that init_from=previous warm-starts from.

Each pointer document carries its own bounded `history` (who moved it: gate, promote, rollback; when; from which
policy; the metric), written with the pointer in one conditional write. History entries name a policy by run id
and iteration, not by stage key: retention pins only what a pointer names now (a stage key anywhere in it).
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from typing import Callable

from verlflow.core.blueprint import Blueprint
from verlflow.core.errors import VerlflowError
from verlflow.core.job import JobSpec
from verlflow.core.store.artifacts import ArtifactStore, stage_key

log = logging.getLogger("verlflow.promote")

HISTORY_LEN = 50  # moves kept per pointer document: bounded, the pointer stays one small object


def run_pointer(run_id: str, kind: str = "latest") -> str:
    return f"runs/{run_id}/{kind}"


def blueprint_pointer(name: str, kind: str = "latest") -> str:
    return f"blueprints/{name}/{kind}"


def policy_of(store: ArtifactStore, manifest: dict) -> dict:
    """What a `latest` pointer says of a committed checkpoint stage (its export, the update and build behind it)."""
    run_id, it = manifest["run_id"], manifest["iteration"]
    checkpoint = stage_key(run_id, it, "checkpoint")
    inputs = manifest.get("inputs", {})
    return {"run_id": run_id, "iteration": it, "blueprint": manifest.get("blueprint_name"),
            "checkpoint": checkpoint, "update": inputs["update"]["stage"], "build": inputs["build"]["stage"],
            "hf_uri": store.uri(checkpoint + "/hf"), "metrics": manifest.get("metrics", {}),
            "lineage": manifest.get("lineage", [])}


def _entry(by: str, policy: dict, before: dict | None, metric: str | None, value: float | None) -> dict:
    return {"by": by, "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
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


def better(value: float, best: dict | None, bp: Blueprint) -> bool:
    """Whether `value` beats the `best` pointer by more than promote.min_delta (promote.mode says which way)."""
    if best is None or best.get("metric") != bp.promote.metric:
        return True
    delta = value - best["value"] if bp.promote.mode == "max" else best["value"] - value
    return delta > bp.promote.min_delta


def _replaced(best: dict | None, policy: dict) -> bool:
    """A forced rerun re-exported the very checkpoint `best` names: its old files (and value) are gone."""
    return best is not None and best.get("checkpoint") == policy["checkpoint"]


def promote(store: ArtifactStore, bp: Blueprint, job: JobSpec, manifest: dict) -> dict | None:
    """The gate, after the checkpoint stage committed: the pointers it moved to (None: none moved)."""
    from verlflow.core.metrics import of_iteration

    policy = policy_of(store, {**manifest, "run_id": job.run_id, "iteration": job.iteration,
                               "blueprint_name": bp.name,
                               "inputs": {n: {"stage": k} for n, k in job.inputs.items()}})
    metric = bp.promote.metric
    if metric is None:
        for name in (run_pointer(job.run_id), blueprint_pointer(bp.name)):
            move(store, name, policy, "gate")
        log.info("promoted %s iteration %s -> %s", job.run_id, job.iteration, policy["hf_uri"])
        return policy
    value = of_iteration(store, job.run_id, job.iteration).get(metric)
    if value is None or not math.isfinite(value):
        log.warning("not promoted: %s iteration %s has no finite %s (missing, or NaN); the latest pointers stay",
                    job.run_id, job.iteration, metric)
        return None
    moved = False
    for scope, latest, best_name in ((job.run_id, run_pointer(job.run_id), run_pointer(job.run_id, "best")),
                                     (bp.name, blueprint_pointer(bp.name), blueprint_pointer(bp.name, "best"))):
        best, won = move(store, best_name, policy, "gate", metric, value,
                         only_if=lambda best: better(value, best, bp) or _replaced(best, policy))
        if won:
            move(store, latest, policy, "gate", metric, value)
            log.info("promoted %s iteration %s (%s=%s, the best of %s so far) -> %s", job.run_id, job.iteration,
                     metric, value, scope, policy["hf_uri"])
            moved = True
        else:
            log.info("not promoted for %s: %s iteration %s has %s=%s, not better than the best %s (%s iteration %s) "
                     "by more than promote.min_delta=%s (promote.mode %s)", scope, job.run_id, job.iteration, metric,
                     value, best["value"], best["run_id"], best["iteration"], bp.promote.min_delta, bp.promote.mode)
    return policy if moved else None


# ---------- a person's moves: `verlflow promote RUN ITER`, `verlflow rollback NAME`

def promotable(store: ArtifactStore, run_id: str) -> list[int]:
    """The iterations of a run whose checkpoint stage is committed and still holds its export."""
    out = []
    for key in store.ls(f"runs/{run_id}"):
        parts = key.split("/")
        if len(parts) == 5 and parts[3] == "checkpoint" and parts[4] == "manifest.json" and parts[2].isdigit():
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
    manifest = store.read_manifest(stage_key(run_id, iteration, "checkpoint"))
    if manifest is None:
        raise VerlflowError(f"verlflow promote {run_id} {iteration}: iteration {iteration} of run {run_id} has no "
                            f"committed checkpoint stage in {store.root_uri}; {_nearest(store, run_id, iteration)}.")
    if not _export_held(manifest):
        raise VerlflowError(f"verlflow promote {run_id} {iteration}: the export of iteration {iteration} "
                            f"({store.uri(stage_key(run_id, iteration, 'checkpoint'))}/hf) was pruned by retention "
                            f"(storage.keep_last); {_nearest(store, run_id, iteration)}.")
    policy = policy_of(store, manifest)
    if not policy["blueprint"]:
        raise VerlflowError(f"{stage_key(run_id, iteration, 'checkpoint')}: its manifest names no blueprint")
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
    manifest = store.read_manifest(stage_key(target["run_id"], target["iteration"], "checkpoint"))
    if not _export_held(manifest):
        nearest = _nearest(store, target["run_id"], target["iteration"])
        raise VerlflowError(f"verlflow rollback {name}: the previous policy, {target['run_id']} iteration "
                            f"{target['iteration']}, has no export any more (retention pruned it); move the pointer "
                            f"with `verlflow promote RUN ITER` instead ({nearest}).")
    before, after = move(store, pointer_name, policy_of(store, manifest), "rollback", target.get("metric"),
                         target.get("value"), only_if=lambda now: now == current)
    if after is None:
        raise VerlflowError(f"verlflow rollback {name}: {pointer_name} moved while rolling back (now "
                            f"{before['run_id']} iteration {before['iteration']}); nothing changed, run it again.")
    return before, after
