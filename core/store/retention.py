"""Retention: what a run keeps of its heavy artifacts, decided here and nowhere else.

Two kinds of prunable unit, each a set of folders of one stage:
    checkpoint  the DCP training checkpoint (policy/ [+ critic/], model and optimizer) of an update stage, and of
                the build (its initial policy, iteration 0); and of a phase's sft/dpo epochs, of which each phase
                keeps its last storage.keep_last_checkpoints (its last epoch is the phase's output)
    export      the HF export (hf/) of an export stage
Of each kind a run keeps
    - the last N by iteration up to the one the run has reached, the `head` (N: storage.keep_last_checkpoints /
      storage.keep_last), and every one past the head: a rerun forced from an earlier step replaces those one by
      one, and until then the last N are the new ones, not the stale ones it is about to replace,
    - the best by storage.keep_best_metric: the policy of iteration i (its checkpoint and its export) is ranked by
      that metric in rollout[i+1]'s manifest, the rollout that sampled from it (the last one has no rank yet);
      the best among those still holding files is kept,
    - every update and export a pointer (pointers/**.json) names, whatever the pointer is (`latest`, a later
      `best`),
    - every checkpoint the plan still reads (a step not committed yet reads it: a phase that starts from the
      model after the rl phase, say) and each phase's start policy, so a changed phase reruns from its artifacts.
The build's other files (hf_meta/, ref/) are never pruned: every kept checkpoint resumes with them. So a pointer
naming the build (`latest` does, as the run's origin) holds what it needs of it, and the build's initial policy is
iteration 0 of the last-N and best rules like any update (with keep_last_checkpoints 1 it goes at update[1], before
anything is promoted).

A pruned stage keeps its manifest, marked pruned and listing the files still there (so reruns skip it), which is
committed before any file goes: a crash mid-prune leaves files no manifest lists, which the next pass deletes.
Passes run after a newer stage committed (update and export stages' after_commit, and at the end of the
pipeline), so nothing is pruned for a checkpoint that is not there yet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from verlflow.core.errors import StoreError
from verlflow.core.stagespec import RENAMED, SPECS, StageSpec, spec
from verlflow.core.store.artifacts import MANIFEST, ArtifactStore, stage_key

if TYPE_CHECKING:  # the store takes its own section of the blueprint, as a record
    from verlflow.core.blueprint.sections import StorageSpec

log = logging.getLogger("verlflow.retention")

CHECKPOINT_DIRS = ("policy/", "critic/")
EXPORT_DIRS = ("hf/",)
FOLDERS = {"checkpoint": CHECKPOINT_DIRS, "export": EXPORT_DIRS}  # a unit kind's folders
# A phase's epochs (iteration `<phase>.<epoch>`, StageSpec.per_epoch): each phase keeps its last
# keep_last_checkpoints epochs (the last one is the phase's output, which later phases read), apart from the rl
# iterations' count.


def _spec(stage: str | None) -> StageSpec | None:
    return SPECS.get(RENAMED.get(stage, stage))


# The stage folders a pass reads manifests of: those holding a unit, and the rollouts that rank policies.
HELD_OR_RANKING = (*(n for n, s in SPECS.items() if s.holds), *RENAMED, "rollout")


@dataclass(frozen=True)
class Unit:
    kind: str  # "checkpoint" | "export"
    iteration: int  # the build's is 0
    key: str  # its stage key
    manifest: dict

    @property
    def folders(self) -> tuple[str, ...]:
        return FOLDERS[self.kind]

    def held(self) -> list[str]:
        """Its files the manifest still lists."""
        return sorted(r for r in self.manifest["files"] if r.startswith(self.folders))


def reads_checkpoint(stage: str, input_name: str) -> bool:
    """Whether `stage` reads the training checkpoint of its input `input_name`."""
    s = spec(stage)
    return s.reads_everything or input_name in s.checkpoint_inputs


def needed_pruned(stage: str, input_name: str, manifest: dict) -> list[str]:
    """The files that `stage`, reading `manifest`'s stage as its input `input_name`, needs and retention pruned."""
    pruned = manifest.get("pruned_files", [])
    if spec(stage).reads_everything:
        return list(pruned)
    wants_checkpoint = reads_checkpoint(stage, input_name)
    return [r for r in pruned if r.startswith(CHECKPOINT_DIRS) == wants_checkpoint]


def has_checkpoint(manifest: dict | None) -> bool:
    """Whether a committed build or update still holds its training checkpoint."""
    return manifest is not None and not needed_pruned("rollout", "policy", manifest)


def repair_from(store: ArtifactStore, steps: list[tuple[str, dict[str, str]]], first: int,
                damaged: Iterable[str] = ()) -> tuple[int | None, list[str]]:
    """Where the rerun that repairs steps[first] can start under this retention: the latest j <= first such that
    `rerun --from` steps[j] (it and every later step recomputed) reads, of what comes before it, nothing pruned,
    damaged or lost. `steps`: the run's (stage key, {input name: stage key}) in plan order. Returns (j, or None if
    no step of the run can start it: a read outside the run is gone; and why each later start could not)."""
    at = {key: i for i, (key, _) in enumerate(steps)}
    damaged, manifests, blocked = set(damaged), {}, []

    def lost(reader: str, name: str, key: str) -> str | None:
        if key not in manifests:
            try:
                manifests[key] = store.read_manifest(key)
            except StoreError:
                manifests[key] = False  # an unreadable manifest
        m = manifests[key]
        if key in damaged or m is False:
            return f"{_step_name(reader)} reads {key}, which is damaged"
        if m is None:  # a step of the plan not committed yet runs anyway; another run's is gone
            return None if key in at else f"{_step_name(reader)} reads {key}, which is not committed"
        gone = needed_pruned(reader.rsplit("/", 1)[1], name, m)
        return (f"{_step_name(reader)} reads {key} ({', '.join(gone[:2])}{', ...' if len(gone) > 2 else ''}), "
                "which retention pruned") if gone else None

    j = first
    while j >= 0:
        reads = [(at.get(key, -1), why) for reader, inputs in steps[j:] for name, key in inputs.items()
                 if at.get(key, -1) < j and (why := lost(reader, name, key))]
        if not reads:
            return j, blocked
        j = min(reads)[0]
        blocked += [why for _, why in sorted(reads) if why not in blocked]
    return None, blocked


def _step_name(stage_key: str) -> str:
    _, _, it, stage = stage_key.split("/")[:4]
    return f"{stage}[{it}]"


def pinned_keys(store: ArtifactStore) -> set[str]:
    """Every stage key a pointer names, at any depth of its JSON."""
    found: set[str] = set()
    for key in store.ls("pointers"):
        if key.endswith(".json"):
            _stage_keys_in(store.get_pointer(key.removeprefix("pointers/").removesuffix(".json")), found)
    return found


def _stage_keys_in(value, into: set[str]) -> None:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        for v in value:
            _stage_keys_in(v, into)
    elif isinstance(value, str) and value.startswith("runs/") and value.count("/") == 3:
        into.add(value)


@dataclass
class RunState:
    """One listing of a run: its committed manifests by stage key and every file key it holds."""
    run_id: str
    manifests: dict[str, dict]
    files: set[str]

    @classmethod
    def read(cls, store: ArtifactStore, run_id: str) -> "RunState":
        files = set(store.ls(f"runs/{run_id}"))
        manifests = {}
        for f in sorted(files):
            parts = f.split("/")  # runs/<run>/<iteration>/<stage>/manifest.json
            if len(parts) == 5 and parts[4] == MANIFEST and parts[3] in HELD_OR_RANKING:
                key = "/".join(parts[:4])
                try:
                    m = store.read_manifest(key)
                except StoreError:  # damaged: left alone for `verlflow verify` and its repair to name
                    log.warning("retention: %s has a damaged manifest; it is neither pruned nor counted", key)
                    continue
                if m is not None:
                    manifests[key] = m
        return cls(run_id, manifests, files)

    def units(self, kind: str) -> list[Unit]:
        """The run's units of `kind` by iteration, phase epochs apart (phase_units). Two builds share iteration 0
        in a phased run: the model's (`init`) comes before the rl phase's, which starts from a later policy."""
        out = []
        for key, m in self.manifests.items():
            it = key.split("/")[2]
            s = _spec(m.get("stage"))
            if s is not None and s.holds == kind and not s.per_epoch:
                out.append(Unit(kind, int(it) if it.isdigit() else 0, key, m))
        return sorted(out, key=lambda u: (u.iteration, u.key.split("/")[2] != "init"))

    def held_by_plan(self, reads: Iterable[tuple[str | None, str]]) -> set[str]:
        """The stage keys whose checkpoint the plan still reads: a step not committed yet reads it, or it is a
        phase's start policy (reader None), which a changed phase reruns from."""
        return {key for reader, key in reads if reader is None or f"{reader}/{MANIFEST}" not in self.files}

    def phase_units(self) -> list[list[Unit]]:
        """The sft/dpo checkpoints, per phase, by epoch."""
        phases: dict[tuple, list[Unit]] = {}
        for key, m in self.manifests.items():
            if (s := _spec(m.get("stage"))) is not None and s.per_epoch:
                label, _, epoch = key.split("/")[2].rpartition(".")
                phases.setdefault((m["stage"], label), []).append(
                    Unit("checkpoint", int(epoch) if epoch.isdigit() else 0, key, m))
        return [sorted(units, key=lambda u: u.iteration) for _, units in sorted(phases.items())]

    def score(self, unit: Unit, metric: str | None):
        """The rank of `unit`'s policy: `metric` in the manifest of the rollout that sampled from it (rollout[i+1]
        for iteration i, if its policy input is this stage: in a phased run the model's build and the rl phase's
        are both iteration 0, and rollout[1] sampled from the rl phase's)."""
        rollout = self.manifests.get(stage_key(self.run_id, unit.iteration + 1, "rollout"))
        if not metric or rollout is None:
            return None
        if rollout.get("inputs", {}).get("policy", {}).get("stage", unit.key) != unit.key:
            return None
        return rollout.get("metrics", {}).get(metric)

    def leftovers(self, unit: Unit) -> list[str]:
        """Files an interrupted prune left: pruned in the manifest, still in the store."""
        return [r for r in unit.manifest.get("pruned_files", []) if f"{unit.key}/{r}" in self.files]


def keep_set(state: RunState, kind: str, keep_last: int, metric: str | None, pinned: set[str],
             head: int | None) -> set[str]:
    """The stage keys whose unit of `kind` stays."""
    units = state.units(kind)
    reached = [u for u in units if head is None or u.iteration <= head]
    keep = {u.key for u in reached[-keep_last:]} | {u.key for u in units if u not in reached}
    keep |= {u.key for u in units if u.key in pinned and not _is_build(u)}
    scores = [(state.score(u, metric), u.iteration, u.key) for u in units if u.held()]
    scored = [s for s in scores if s[0] is not None]
    if scored:
        keep.add(max(scored)[2])
    return keep


def _is_build(unit: Unit) -> bool:
    return unit.manifest["stage"] == "build"  # named by pointers as the run's origin: see the module's docstring


def retain(store: ArtifactStore, storage: StorageSpec, run_id: str, *, head: int | None = None,
           reads: Iterable[tuple[str | None, str]] = (), between: Callable[[], None] | None = None) -> list[str]:
    """One retention pass over a run: prune what keep_set does not keep, finish what an interrupted pass left.
    Returns the stage keys pruned now. `storage`: the blueprint's section (keep_last*, keep_best_metric). `head`: the iteration the run has reached (None: its last committed one).
    `reads`: the plan's (reader's stage key, stage key whose checkpoint it reads), from
    verlflow.core.orchestrate.pipeline.checkpoint_reads; what held_by_plan names stays.
    `between` runs after each pruned manifest is committed, before its files go (the fault hook of tests)."""
    try:
        pinned = pinned_keys(store)
    except StoreError as exc:  # what an unreadable pointer names is unknown: prune nothing rather than guess
        log.warning("retention: nothing pruned, a pointer cannot be read: %s", exc)
        return []
    state = RunState.read(store, run_id)
    held = state.held_by_plan(reads)
    pruned = []
    for kind, keep_last in (("checkpoint", storage.keep_last_checkpoints), ("export", storage.keep_last)):
        keep = keep_set(state, kind, keep_last, storage.keep_best_metric, pinned, head) | held
        units = state.units(kind)
        if kind == "checkpoint":
            for epochs in state.phase_units():
                keep |= {u.key for u in epochs[-keep_last:]} | {u.key for u in epochs if u.key in pinned}
                units += epochs
        for unit in units:
            if unit.key not in keep and unit.held():
                unit = _mark(store, unit)
                pruned.append(unit.key)
                if between is not None:
                    between()
            _delete(store, unit, state.leftovers(unit))
    return sorted(pruned)


def _mark(store: ArtifactStore, unit: Unit) -> Unit:
    manifest = store.mark_pruned(unit.key, unit.folders)
    log.info("retention: pruned the %s of %s", unit.kind, unit.key)
    return Unit(unit.kind, unit.iteration, unit.key, manifest)


def _delete(store: ArtifactStore, unit: Unit, rels: Iterable[str]) -> None:
    """Remove pruned files: whole folders where the manifest lists nothing under them any more."""
    rels = sorted(rels)
    if not rels:
        return
    listed = unit.manifest["files"]
    folders = {r.split("/", 1)[0] for r in rels if "/" in r}
    whole = {f for f in folders if not any(k.startswith(f + "/") for k in listed)}
    for f in sorted(whole):
        store.rm(f"{unit.key}/{f}")
    store.rm_files([f"{unit.key}/{r}" for r in rels if r.split("/", 1)[0] not in whole])
