"""Retention of every heavy artifact (core/store/retention.py): the DCP checkpoints of the last
storage.keep_last_checkpoints updates, the best one, every stage a pointer names and the build's reference survive;
the rest keep a manifest marked pruned. A crash mid-prune loses nothing, and a rerun that would need a pruned
checkpoint names the nearest step it can resume from."""

import pytest
from tinybp import ONE_RANK, tiny_blueprint

from verlflow.core.blueprint import Blueprint
from verlflow.core.errors import PrunedError
from verlflow.core.orchestrate.pipeline import checkpoint_reads, plan, run_pipeline
from verlflow.core.orchestrate.launcher import StageFailure
from verlflow.core.store.artifacts import open_store
from verlflow.core.store.artifacts import ArtifactStore
from verlflow.core.store.digests import bytes_digest
from verlflow.core.store.retention import retain

pytestmark = pytest.mark.system

pytest_plugins = ["s3server"]


# ---------- the keep set, on stages committed by hand (no jobs)
def _commit(store: ArtifactStore, key: str, stage: str, files: dict[str, bytes], metrics: dict | None = None,
            inputs: dict | None = None):
    for rel, data in files.items():
        store.put_bytes(f"{key}/{rel}", data)
    digests = {rel: bytes_digest(data) for rel, data in files.items()}
    manifest = {"key": f"k-{key}", "stage": stage, "metrics": metrics or {},
                "inputs": {n: {"stage": k, "key": f"k-{k}"} for n, k in (inputs or {}).items()}}
    return store.commit(key, manifest, digests)


def _fake_run(store: ArtifactStore, rewards: dict[int, float]) -> None:
    """A build and updates 1..n; rewards[i] is the reward of rollout[i] (sampled by the policy of iteration i-1)."""
    _commit(store, "runs/r/init/build", "build", {"hf_meta/config.json": b"{}", "ref/w": b"r" * 8,
                                                   "policy/w": b"p" * 8, "policy/state.json": b"{}"})
    for it, reward in rewards.items():
        _commit(store, f"runs/r/{it}/rollout", "rollout", {"batch.pt": b"b"}, {"reward_mean": reward})
        _commit(store, f"runs/r/{it}/update", "update", {"policy/w": b"u" * 8, "critic/w": b"c" * 8})


def _bp(root, **storage) -> Blueprint:
    return Blueprint(storage={"uri": str(root), **storage})


def _holds_checkpoint(store, key) -> bool:
    return any(f.startswith(f"{key}/policy/") for f in store.ls(key))


def test_keep_set_last_n_best_pointers_and_the_builds_reference(tmp_path):
    store = ArtifactStore(tmp_path)
    # rollout[4] has the best reward: it ranks the policy of iteration 3 (update[3]), which sampled it.
    _fake_run(store, {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.9, 5: 0.4, 6: 0.5})
    store.set_pointer("custom/pins", {"deep": [{"stage": "runs/r/1/update"}], "other": "runs/zz/1/update"})
    store.set_pointer("runs/r/latest", {"build": "runs/r/init/build", "update": "runs/r/6/update"})
    pruned = retain(store, _bp(tmp_path, keep_last_checkpoints=2).storage, "r")
    assert pruned == ["runs/r/2/update", "runs/r/4/update", "runs/r/init/build"]
    for it in range(1, 7):
        key = f"runs/r/{it}/update"
        assert store.read_manifest(key) is not None  # still committed: a rerun skips it
        assert _holds_checkpoint(store, key) == (it in (1, 3, 5, 6)), key  # pointer, best, last 2
        assert bool(store.read_manifest(key).get("pruned")) == (it in (2, 4))
    assert not store.ls("runs/r/2/update/critic")  # the critic goes with the policy
    build = store.read_manifest("runs/r/init/build")  # partly pruned: its reference and hf_meta stay
    assert sorted(build["files"]) == ["hf_meta/config.json", "ref/w"] and build["pruned"]
    assert build["pruned_files"] == ["policy/state.json", "policy/w"]
    assert store.read_verified("runs/r/init/build", "ref/w") == b"r" * 8
    with pytest.raises(PrunedError, match="policy/w was pruned by retention"):
        store.read_verified("runs/r/init/build", "policy/w")
    with pytest.raises(PrunedError, match="runs/r/2/update"):
        store.materialize("runs/r/2/update", tmp_path / "dl")
    assert retain(store, _bp(tmp_path, keep_last_checkpoints=2).storage, "r") == []  # idempotent


def test_a_rerun_forced_from_an_earlier_step_keeps_its_new_checkpoints(tmp_path):
    """At head 3 (a rerun forced from rollout[3] has just committed update[3]) the last two are update[2] and the
    new update[3]; the stale update[4..6], about to be replaced, are no reason to prune them."""
    store = ArtifactStore(tmp_path)
    _fake_run(store, {it: 0.1 for it in range(1, 7)})
    bp = _bp(tmp_path, keep_last_checkpoints=2, keep_best_metric=None)
    assert retain(store, bp.storage, "r", head=3) == ["runs/r/1/update", "runs/r/init/build"]
    assert retain(store, bp.storage, "r") == ["runs/r/2/update", "runs/r/3/update", "runs/r/4/update"]  # head: the last


def test_what_the_plan_still_reads_and_each_phases_start_stay(tmp_path):
    """phases [rl (2 iterations), sft from the model]: after update[2] the last-1 rule alone would prune the build,
    which sft[sft.1], not run yet, trains from. The plan holds it; once sft.1 is committed it still stays, as the
    start of a phase (a changed sft reruns from it), while update[1], read by committed steps only, goes."""
    store = ArtifactStore(tmp_path)
    _fake_run(store, {1: 0.1, 2: 0.2})
    for it in (1, 2):
        _commit(store, f"runs/r/{it}/export", "export", {"hf/w": b"h" * 8})
    bp = Blueprint(storage={"uri": str(tmp_path), "keep_last_checkpoints": 1, "keep_best_metric": None},
                   phases=[{"kind": "rl", "iterations": 2},
                           {"kind": "sft", "init_from": "model", "data": {"train_files": ["sft.parquet"]}}])
    reads = checkpoint_reads(plan(bp, "r"), "r")
    assert retain(store, bp.storage, "r", head=2, reads=reads) == ["runs/r/1/update"]
    assert _holds_checkpoint(store, "runs/r/init/build")
    _commit(store, "runs/r/sft.1/sft", "sft", {"policy/w": b"s" * 8})
    assert retain(store, bp.storage, "r", reads=reads) == []
    assert _holds_checkpoint(store, "runs/r/init/build") and _holds_checkpoint(store, "runs/r/2/update")
    # Without the plan (what a pass knew before), the build goes although sft still starts from it.
    assert retain(store, bp.storage, "r", head=2) == ["runs/r/init/build"]


def test_the_models_build_ranks_before_the_rl_phases_build(tmp_path):
    """Both builds are iteration 0 of a phased run; the rl phase's starts from a later policy, so it is the newer
    one whatever the phase's name sorts like (here before `init`). And rollout[1]'s reward ranks the build it
    sampled from, the rl phase's, not the model's."""
    store = ArtifactStore(tmp_path)
    files = {"ref/w": b"r" * 8, "policy/w": b"p" * 8}
    _commit(store, "runs/r/init/build", "build", files)
    _commit(store, "runs/r/grpo/build", "build", files)
    assert retain(store, _bp(tmp_path, keep_last_checkpoints=1, keep_best_metric=None).storage, "r") == ["runs/r/init/build"]

    store = ArtifactStore(tmp_path / "ranked")
    _commit(store, "runs/r/init/build", "build", files)
    _commit(store, "runs/r/grpo/build", "build", files)
    _commit(store, "runs/r/1/rollout", "rollout", {"batch.pt": b"b"}, {"reward_mean": 0.5},
            inputs={"build": "runs/r/grpo/build", "policy": "runs/r/grpo/build"})
    _commit(store, "runs/r/1/update", "update", {"policy/w": b"u" * 8})
    bp = _bp(tmp_path / "ranked", keep_last_checkpoints=1, keep_best_metric="reward_mean")
    assert retain(store, bp.storage, "r") == ["runs/r/init/build"]  # update[1]: the last; the rl build: the best


def test_an_unreadable_pointer_prunes_nothing(tmp_path):
    store = ArtifactStore(tmp_path)
    _fake_run(store, {1: 0.1, 2: 0.2, 3: 0.3})
    store.put_bytes("pointers/runs/r/latest.json", b'{"update": "runs/r/1/upd')  # cut short
    assert retain(store, _bp(tmp_path, keep_last_checkpoints=1).storage, "r") == []
    assert all(_holds_checkpoint(store, f"runs/r/{it}/update") for it in (1, 2, 3))


def test_an_interrupted_prune_is_finished_by_the_next_pass(tmp_path):
    """The pruned manifest is committed before the files go: a crash right after it leaves the files, which no
    manifest lists any more, and the next pass deletes them."""
    store = ArtifactStore(tmp_path)
    _fake_run(store, {1: 0.1, 2: 0.2, 3: 0.3})

    def crash():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        retain(store, _bp(tmp_path, keep_last_checkpoints=1, keep_best_metric=None).storage, "r", between=crash)
    first = store.read_manifest("runs/r/init/build")  # the first unit pruned: marked, files still there
    assert first["pruned"] and _holds_checkpoint(store, "runs/r/init/build")
    assert retain(store, _bp(tmp_path, keep_last_checkpoints=1, keep_best_metric=None).storage, "r") == [
        "runs/r/1/update", "runs/r/2/update"]
    assert [k for k in ("runs/r/init/build", "runs/r/1/update", "runs/r/2/update", "runs/r/3/update")
            if _holds_checkpoint(store, k)] == ["runs/r/3/update"]


# ---------- real runs of the tiny pipeline
def _checkpoints_with_files(root, run: str) -> set[str]:
    """Stage keys of the run whose folder holds DCP files on disk (committed or not)."""
    return {p.parent.parent.relative_to(root).as_posix() for p in (root / "runs" / run).glob("*/*/policy/*")}


def _assert_retained(root, run: str, keep_last: int, pins: tuple[str, ...] = (), head=None) -> None:
    """At most the last `keep_last` checkpoints (the build's is iteration 0) up to `head` hold files, besides those
    the pointers name; what a pointer names is whole (of the build: hf_meta/ and ref/); every other one up to
    `head` is committed pruned. `head`: the iteration a forced rerun has reached (the later ones are stale)."""
    store = ArtifactStore(root)
    pointer = store.get_pointer(f"runs/{run}/latest") or {}
    committed = sorted((int(p.parent.parent.name), p.parent.relative_to(root).as_posix())
                       for p in (root / "runs" / run).glob("*/update/manifest.json")
                       if not isinstance(head, int) or int(p.parent.parent.name) <= head)
    built = (root / "runs" / run / "init/build/manifest.json").is_file()
    order = [f"runs/{run}/init/build"] * built + [key for _, key in committed]
    pinned = {pointer["update"]} if pointer else set()
    pinned |= {p for p in pins if p in order}
    on_disk = _checkpoints_with_files(root, run) & (set(order) | pinned)
    extra = on_disk - set(order[-keep_last:]) - pinned
    assert not extra, f"checkpoints kept beyond the last {keep_last} and the pinned ones: {sorted(extra)}"
    assert len(on_disk) <= keep_last + len(pinned)
    for key in pinned | ({pointer["export"]} if pointer else set()):
        m = store.read_manifest(key)
        assert m is not None and not m.get("pruned") and not store.damage(key, checksums=False), key
    if pointer:
        build = store.read_manifest(pointer["build"])
        assert not store.damage(pointer["build"], checksums=False)
        assert {f.split("/")[0] for f in build["files"]} >= {"ref", "hf_meta"}
    for key in set(order) - on_disk:
        assert store.read_manifest(key)["pruned"], key  # still committed: reruns skip it
    exports = {p.parent.parent.name for p in (root / "runs" / run).glob("*/export/hf")
               if not isinstance(head, int) or int(p.parent.parent.name) <= head}
    assert len(exports - {str(pointer.get("iteration"))}) <= 2, exports


def _reached(step):
    """The last iteration whose update a forced rerun has committed again, once `step` is done."""
    return step.iteration - (step.stage == "rollout") if isinstance(step.iteration, int) else None


def test_six_iterations_keep_two_checkpoints_after_every_stage(tiny_kit, tmp_path, capsys):
    """keep_last_checkpoints 2 in a warm pool: after every stage the store holds at most the last two update
    checkpoints, the build's and the ones pointers name; a rerun extends the run from the last one, and a --from
    that needs a pruned checkpoint is refused before anything runs, naming the nearest resumable step."""
    from verlflow.flows import cli

    root = tmp_path / "store"
    # Commits inline (async_checkpoint off): each pass has finished when its stage returns, so the check after
    # every stage sees no half-done prune; tests below cover the committer thread.
    fields = dict(resources__warm_workers=True, resources__async_checkpoint=False, iterations=6,
                  storage__keep_last_checkpoints=2, storage__keep_last=2, storage__keep_best_metric=None)
    bp = tiny_blueprint(tiny_kit, root, *ONE_RANK, **fields)
    seen = []

    def after(step, result):
        seen.append(step.name)
        if step.name == "update[2]":  # a pointer of someone else's: it pins update[2] from now on
            open_store(bp.storage).set_pointer("pins/kept", {"policy": "runs/t/2/update"})
        _assert_retained(root, "t", 2, pins=("runs/t/2/update",) if "update[2]" in seen else ())

    run_pipeline(bp, "t", on_line=lambda line: None, on_step=after)
    assert len(seen) == 2 + 3 * 6
    assert _checkpoints_with_files(root, "t") == {"runs/t/2/update", "runs/t/5/update", "runs/t/6/update"}
    build = ArtifactStore(root).read_manifest("runs/t/init/build")  # partly pruned: hf_meta/ and ref/ stay
    assert build["pruned"] and {f.split("/")[0] for f in build["files"]} == {"hf_meta", "ref"}

    with pytest.raises(PrunedError) as e:  # update[4] and [3] are gone; update[2] is the latest kept before them
        run_pipeline(bp, "t", on_line=lambda line: None, force_from="rollout[5]")
    assert "rollout[5] needs" in str(e.value) and "runs/t/4/update" in str(e.value)
    assert "nearest step this run can resume from is rollout[3]" in str(e.value)
    assert "--from 'rollout[3]'" in str(e.value) or "--from rollout[3]" in str(e.value)
    # nothing ran:
    assert _checkpoints_with_files(root, "t") == {"runs/t/2/update", "runs/t/5/update", "runs/t/6/update"}
    with pytest.raises(PrunedError, match=r"rollout\[2\] needs .*runs/t/1/update.* resume from is build"):
        run_pipeline(bp, "t", on_line=lambda line: None, force_from="rollout[2]")  # none kept before it

    # The step the error named: forced from rollout[3], the new update[3] and update[4] are the last two, not the
    # stale update[5] and update[6] that are about to be replaced (which stay until then).
    rerun = run_pipeline(bp, "t", on_line=lambda line: None, force_from="rollout[3]",
                         on_step=lambda s, r: _assert_retained(root, "t", 2, ("runs/t/2/update",), _reached(s)))
    assert [r.manifest["iteration"] for r in rerun if not r.skipped] == [it for it in range(3, 7) for _ in "ruc"]
    assert _checkpoints_with_files(root, "t") == {"runs/t/2/update", "runs/t/5/update", "runs/t/6/update"}

    more = tiny_blueprint(tiny_kit, root, *ONE_RANK, **{**fields, "iterations": 7})
    results = run_pipeline(more, "t", on_line=lambda line: None,
                           on_step=lambda s, r: _assert_retained(root, "t", 2, pins=("runs/t/2/update",)))
    assert [r.manifest["iteration"] for r in results if not r.skipped] == [7, 7, 7]
    assert _checkpoints_with_files(root, "t") == {"runs/t/2/update", "runs/t/6/update", "runs/t/7/update"}
    capsys.readouterr()
    assert cli.main(["ls", "--run", "t", *_cli_bp(more)]) == 0
    shown = capsys.readouterr().out
    assert "update[3]" in shown and "pruned" in shown.split("update[3]")[1].splitlines()[0]
    assert "partly pruned" in shown.split("build[init]")[1].splitlines()[0]
    assert "committed" in shown.split("update[6]")[1].splitlines()[0]


def _cli_bp(bp) -> list[str]:
    return [f"storage.uri={bp.storage.uri}"]


def test_a_kill_during_pruning_loses_nothing_a_pointer_names(tiny_kit, tmp_path, monkeypatch):
    """Rank 0 is SIGKILLed in the last stage's retention pass (export[2], once promoted, prunes update[1]),
    after the pruned manifest is committed and before its files go: the pointers' stages are whole, and the rerun,
    which reuses every stage, finishes the deletion. (Commits inline, so the kill fails the stage; on a committer
    thread the commit has landed, the pool's loss is no stage's failure and the pipeline's closing pass finishes
    the deletion at once.)"""
    root = tmp_path / "store"
    fields = dict(resources__warm_workers=True, resources__async_checkpoint=False, storage__keep_last_checkpoints=1,
                  storage__keep_best_metric=None)
    run_pipeline(tiny_blueprint(tiny_kit, root, *ONE_RANK, iterations=1, **fields), "k", on_line=lambda line: None)
    bp = tiny_blueprint(tiny_kit, root, *ONE_RANK, iterations=2, **fields)
    monkeypatch.setenv("VERLFLOW_FAULT", "kill_rank0_in_prune")
    monkeypatch.setenv("VERLFLOW_FAULT_ONCE", str(tmp_path / "fired"))
    lines = []
    with pytest.raises(StageFailure):
        run_pipeline(bp, "k", on_line=lines.append)
    assert "SIGKILL in prune" in "\n".join(lines)
    store = ArtifactStore(root)
    pointer = store.get_pointer("runs/k/latest")
    assert pointer["iteration"] == 2
    for key in (pointer["update"], pointer["export"], pointer["build"]):
        m = store.read_manifest(key)
        assert m is not None and not store.damage(key, checksums=True), key
    assert store.read_manifest("runs/k/1/update")["pruned"]  # marked, then the kill: its files are still there
    assert _holds_checkpoint(store, "runs/k/1/update")

    monkeypatch.delenv("VERLFLOW_FAULT")
    results = run_pipeline(bp, "k", on_line=lambda line: None)
    assert all(r.skipped for r in results)
    assert not store.ls("runs/k/1/update/policy")
    assert _checkpoints_with_files(root, "k") == {"runs/k/2/update"}
    assert not store.damage("runs/k/2/update", checksums=True)


def test_retention_on_s3(tiny_kit, s3_bucket, tmp_path):
    """An s3:// store, background commits: the pruned objects are deleted, the manifests stay, a rerun reuses
    every stage and a pruned checkpoint reads as pruned."""
    bp = tiny_blueprint(tiny_kit, f"{s3_bucket.uri}/vf", *ONE_RANK, resources__warm_workers=True, iterations=3,
                        storage__keep_last_checkpoints=1, storage__keep_last=1, storage__keep_best_metric=None)
    run_pipeline(bp, "s", on_line=lambda line: None)
    objects = {o["Key"] for page in s3_bucket.client().get_paginator("list_objects_v2").paginate(
        Bucket=s3_bucket.name, Prefix="vf/runs/s/") for o in page.get("Contents", [])}
    heavy = {k.split("/")[3] + "/" + k.split("/")[4] for k in objects
             if k.split("/")[5] in ("policy", "critic", "hf")}
    assert heavy == {"3/update", "3/export"}, heavy
    assert any(k.startswith("vf/runs/s/init/build/ref/") for k in objects)  # the build keeps its reference
    store = open_store(bp.storage)
    for key in ("runs/s/init/build", "runs/s/1/update", "runs/s/2/update", "runs/s/1/export",
                "runs/s/2/export"):
        assert store.read_manifest(key)["pruned"] and f"vf/{key}/manifest.json" in objects
    with pytest.raises(PrunedError):
        store.materialize("runs/s/2/update", tmp_path / "dl")
    assert all(r.skipped for r in run_pipeline(bp, "s", on_line=lambda line: None))
