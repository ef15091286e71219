"""`verlflow verify` and damaged stages in `verlflow ls`, on a local store and on S3 (moto server); and the repair
that their messages advise, run for real on the tiny pipeline."""

import re
import shlex

import pytest

from verlflow.flows.cli import main
from verlflow.core.store.artifacts import ArtifactStore
from verlflow.core.store.digests import file_digest

pytestmark = pytest.mark.system

RUN = "r1"
STAGES = (("init", "build"), ("1", "rollout"), ("1", "update"))


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path) -> ArtifactStore:
    if request.param == "file":
        return ArtifactStore(tmp_path / "store")
    return ArtifactStore(f"{request.getfixturevalue('s3_bucket').uri}/prefix")


def commit_stages(store: ArtifactStore, tmp_path, inputs: dict | None = None) -> None:
    """Committed stages as a worker leaves them (files uploaded, then the manifest), without running one; `inputs`:
    {stage: {input name: stage key}} for the manifests."""
    for it, stage in STAGES:
        out = tmp_path / f"out-{stage}"
        out.mkdir()
        (out / "a.bin").write_bytes(bytes(range(256)) * 40)
        (out / "b.json").write_text('{"ok": true}')
        skey = f"runs/{RUN}/{it}/{stage}"
        names = store.upload_dir(out, skey)
        refs = {n: {"stage": k, "key": "k"} for n, k in (inputs or {}).get(stage, {}).items()}
        store.commit(skey, {"key": f"k-{stage}", "inputs": refs}, {rel: file_digest(out / rel) for rel in names})


def cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def states(out: str) -> dict:
    return {line.split()[0]: line.split()[1] for line in out.splitlines() if line.startswith("  ")}


def test_verify_and_ls_name_damaged_stages_and_the_rerun_that_repairs_them(store, tmp_path, capsys):
    uri = f"storage.uri={store.root_uri if not store.is_local else store.root}"
    commit_stages(store, tmp_path)
    rc, out, err = cli(capsys, "verify", RUN, uri)
    assert rc == 0, err
    assert states(out) == {"build[init]": "ok", "rollout[1]": "ok", "update[1]": "ok"}
    assert "every committed stage matches its manifest (6 files checked)" in out

    store.rm(f"runs/{RUN}/1/update/b.json")  # deleted: ls sees it (existence and size)
    flipped = bytearray(store.get_bytes(f"runs/{RUN}/1/rollout/a.bin"))
    flipped[100] ^= 1
    store.put_bytes(f"runs/{RUN}/1/rollout/a.bin", bytes(flipped))  # same size: only checksums see it
    rc, out, err = cli(capsys, "ls", uri, "--run", RUN)
    assert rc == 0, err
    assert states(out) == {"build[init]": "committed", "rollout[1]": "committed", "update[1]": "DAMAGED"}
    assert "(b.json is missing)" in out

    rc, out, err = cli(capsys, "verify", RUN, uri)
    assert rc == 2
    assert states(out) == {"build[init]": "ok", "rollout[1]": "DAMAGED", "update[1]": "DAMAGED"}
    assert "a.bin does not match its sha256 in the manifest" in out and "b.json is missing" in out
    assert f"2 damaged stage(s) in {store.root_uri}: rollout[1], update[1]" in err
    assert f"Repair with `verlflow rerun {RUN} {uri} --from 'rollout[1]'`" in err


def test_verify_says_when_no_rerun_can_repair_a_damaged_stage(store, tmp_path, capsys):
    """The damaged build warm-started from another run's update, whose checkpoint retention pruned since: no step of
    this run can be recomputed, and verify says so instead of advising a rerun that would fail."""
    uri = f"storage.uri={store.root_uri if not store.is_local else store.root}"
    out = tmp_path / "policy"
    (out / "policy").mkdir(parents=True)
    (out / "policy" / "w.bin").write_bytes(b"w" * 64)
    store.upload_dir(out, "runs/prev/1/update")
    store.commit("runs/prev/1/update", {"key": "k-prev", "stage": "update"},
                 {"policy/w.bin": file_digest(out / "policy" / "w.bin")})
    store.mark_pruned("runs/prev/1/update", ("policy/",))
    commit_stages(store, tmp_path, inputs={"build": {"warm_start": "runs/prev/1/update"}})
    store.rm(f"runs/{RUN}/init/build/a.bin")
    rc, out, err = cli(capsys, "verify", RUN, uri)
    assert rc == 2 and states(out)["build[init]"] == "DAMAGED"
    assert ("No rerun of this run can repair build[init]: build[init] reads runs/prev/1/update (policy/w.bin), which "
            "retention pruned. Start a new run (another run id).") in err, err


def test_a_truncated_manifest_shows_as_damaged(store, tmp_path, capsys):
    uri = f"storage.uri={store.root_uri if not store.is_local else store.root}"
    commit_stages(store, tmp_path)
    text = store.get_bytes(f"runs/{RUN}/1/update/manifest.json")
    store.put_bytes(f"runs/{RUN}/1/update/manifest.json", text[: len(text) // 2])
    rc, out, err = cli(capsys, "ls", uri, "--run", RUN)
    assert rc == 0, err
    assert states(out)["update[1]"] == "DAMAGED" and "manifest.json is not valid JSON" in out
    rc, out, err = cli(capsys, "verify", RUN, uri)
    assert rc == 2 and "--from 'update[1]'`" in err


@pytest.mark.slow(
    reason="covered by test_verify::test_a_rerun_recomputes_a_damaged_stage_and_every_later_one_that_read_it")
def test_the_advised_reruns_repair_a_truncated_manifest_and_a_deleted_file(tiny_kit, tmp_path, capsys, monkeypatch):
    """The tiny pipeline (1 iteration, 1 rank, warm workers); then its checkpoint's manifest is truncated, later a file
    of its export deleted. Each message's advised command is run as printed (with the blueprint) and works. (The
    last stage, so that each repair is one cheap export.)"""
    from tinybp import ONE_RANK, tiny_overrides

    monkeypatch.setenv("VERLFLOW_CACHE_DIR", str(tmp_path / "cache"))  # the stages' log files
    store = tmp_path / "store"
    bp = tiny_overrides(tiny_kit, store, *ONE_RANK, "resources.warm_workers=true")
    rc, out, err = cli(capsys, "run", *bp, "--run-id", RUN)
    assert rc == 0, out + err

    manifest = store / "runs" / RUN / "1" / "export" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:100])
    rc, out, err = cli(capsys, "rerun", RUN, *bp)  # reuses everything up to the damaged manifest
    assert rc == 2
    advised = re.search(r"rerun it with `verlflow rerun r1 BLUEPRINT (--from 'checkpoint\[1\]')`", err)
    assert advised, err
    rc, out, err = cli(capsys, "rerun", RUN, *bp, *shlex.split(advised[1]))
    assert rc == 0, out + err

    victim = store / "runs" / RUN / "1" / "export" / "hf" / "config.json"
    victim.unlink()
    rc, out, err = cli(capsys, "verify", RUN, *bp)
    assert rc == 2 and "export[1]" in out and "hf/config.json is missing" in out
    fix = shlex.split(re.search(r"Repair with `verlflow (rerun .*?)`", err)[1])
    rc, out, err = cli(capsys, *fix)
    assert rc == 0, out + err
    rc, out, err = cli(capsys, "verify", RUN, *bp)
    assert rc == 0, out + err


def test_a_flow_rerun_from_a_damaged_stage_forces_it(tmp_path):
    """`rerun --prefect --from update[1]` asks whether this flow run already recomputed update[1] (a Retry must
    not force it twice); a truncated manifest there means no, not an error that stops the repair."""
    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.orchestrate.pipeline import Step
    from verlflow.flows.common import recomputed_here

    store = ArtifactStore(tmp_path / "store")
    commit_stages(store, tmp_path)
    text = store.get_bytes(f"runs/{RUN}/1/update/manifest.json")
    store.put_bytes(f"runs/{RUN}/1/update/manifest.json", text[: len(text) // 2])
    bp = load_blueprint(None, [f"storage.uri={store.root}"])
    assert recomputed_here(bp, RUN, Step("update", 1)) is False


def test_a_stage_committed_just_before_the_flow_run_began_was_not_recomputed_by_it():
    """A Retry forces from_step's stages only once: what this flow run committed counts as recomputed, what was
    committed before it began does not, even within the same second. An older manifest's whole-second time counts
    from the second the run began."""
    import datetime as dt

    from verlflow.flows.common import committed_since

    created = dt.datetime(2026, 12, 6, 12, 0, 0, 900_000, tzinfo=dt.timezone.utc)
    assert not committed_since("2026-12-06T12:00:00.700000+00:00", created)
    assert committed_since("2026-12-06T12:00:00.950000+00:00", created)
    assert committed_since("2026-12-06T12:00:00+00:00", created)  # whole seconds: the same second counts
    assert not committed_since("2026-12-06T11:59:59+00:00", created)


# ---------------------------------------------------------------- a rerun checks what it reuses (issue 38, item 7)

def _reference_args(reference, root, *more: str) -> list[str]:
    from tinybp import tiny_overrides

    return tiny_overrides(reference.kit, root, *more, iterations=2, storage__keep_last_checkpoints=3)


def test_a_rerun_recomputes_a_damaged_stage_and_every_later_one_that_read_it(reference, tmp_path, capsys, monkeypatch):
    """The reference run with rollout[2]'s batch deleted: `verlflow rerun` reuses what is intact, recomputes
    rollout[2] (its listing shows the file missing), then update[2] and export[2], whose input committed after
    them; the seeded batch comes back byte for byte and the run verifies."""
    monkeypatch.setenv("VERLFLOW_CACHE_DIR", str(tmp_path / "cache"))  # the stages' log files
    _, root = reference.copy(tmp_path)
    args = _reference_args(reference, root)
    batch = root / "runs" / "eq" / "2" / "rollout" / "batch.safetensors"
    batch.unlink()
    rc, out, err = cli(capsys, "rerun", "eq", *args)
    assert rc == 0, out[-3000:] + err
    assert "rollout[2] is committed with the same key, but its files are damaged (batch.safetensors is missing): " \
           "recomputing it" in out
    for stage in ("update", "export"):
        assert re.search(rf"{stage}\[2\] is committed with the same key, but its inputs? .*committed after it", out)
    reused = set(re.findall(r"\] (\w+\[\w+\]) is committed with the same key: reusing", out))
    assert reused == {"validate[init]", "build[init]", "rollout[1]", "update[1]", "export[1]"}, out
    assert re.search(r"^\[verlflow\] rollout\[2\] -> ", out, re.M)
    assert file_digest(batch)["sha256"] == reference.results[5].manifest["files"]["batch.safetensors"]["sha256"]
    rc, out, err = cli(capsys, "verify", "eq", *args)
    assert rc == 0, out + err


def test_the_repair_of_a_damaged_stage_works_under_the_runs_retention(reference, tmp_path, capsys):
    """Retention kept only update[2]'s checkpoint, then rollout[1]'s batch went: rollout[1] reads the build's
    pruned policy, so neither a plain rerun nor `--from rollout[1]` can repair it. `verify` and the rerun name the
    nearest step whose inputs the store still holds, build[init], and the rerun's own check before anything runs
    accepts it; the rerun stops before starting a job."""
    from reference import rekey

    from verlflow.core.errors import PrunedError
    from verlflow.core.orchestrate.pipeline import checked_plan, check_not_pruned, checkpoint_reads, plan, steps_that_run
    from verlflow.core.store.artifacts import open_store
    from verlflow.core.store.retention import retain

    _, root = reference.copy(tmp_path)
    args = _reference_args(reference, root, "storage.keep_last_checkpoints=1", "storage.keep_best_metric=null")
    bp = _blueprint_of(args)
    rekey(bp, "eq")  # validate's key holds the storage section: reused, as under the reference's retention
    store = open_store(bp.storage)
    assert retain(store, bp.storage, "eq", head=2, reads=checkpoint_reads(plan(bp, "eq"), "eq")) == ["runs/eq/1/update",
                                                                                 "runs/eq/init/build"]
    (root / "runs" / "eq" / "1" / "rollout" / "batch.safetensors").unlink()

    rc, out, err = cli(capsys, "verify", "eq", *args)
    assert rc == 2 and states(out)["rollout[1]"] == "DAMAGED"
    fix = re.search(r"Repair with `verlflow rerun (.*?)`", err)[1]
    assert fix == shlex.join(["eq", *args, "--from", "build[init]"]), err
    assert "rollout[1] cannot be recomputed from what the store holds (rollout[1] reads runs/eq/init/build " \
           "(policy/" in err and "which retention pruned); build[init] is the nearest step" in err, err

    rc, out, err = cli(capsys, "rerun", "eq", *args)
    assert rc == 2 and ("rollout[1] is committed but its files are damaged (batch.safetensors is missing), and it "
                        "cannot be recomputed: its input 'policy'") in err, err
    assert f"`verlflow rerun eq BLUEPRINT --from 'build[init]'`" in err, err
    assert not re.search(r"^\[verlflow\] \w+\[\w+\] -> ", out, re.M), out  # no job was launched

    for start, ok in (("rollout[1]", False), ("build[init]", True)):  # the rerun's check before anything runs
        steps, first = checked_plan(bp, "eq", start)
        runs = steps_that_run(store, bp, "eq", steps, [i >= first for i in range(len(steps))])
        if ok:
            check_not_pruned(store, "eq", steps, runs)
        else:
            with pytest.raises(PrunedError):
                check_not_pruned(store, "eq", steps, runs)


def _blueprint_of(args: list[str]):
    from verlflow.core.blueprint import load_blueprint

    return load_blueprint(None, args)
