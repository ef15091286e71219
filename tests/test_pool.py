"""Warm worker pools (resources.warm_workers): a failed or cancelled stage ends the pool like a fresh job would,
commits nothing, leaves no process, and the next run starts a fresh pool. (Bit-identical weights with and without
the pool: tests/test_stages.py.)"""

import shutil
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from sysdeps import small_tmpfs
from tinybp import tiny_blueprint

from verlflow.core.orchestrate.launcher import FailureKind, StageFailure
from verlflow.core.orchestrate.pipeline import run_pipeline

pytestmark = pytest.mark.system


def _stage_processes() -> list:
    """torchrun and stage workers under this process (a session's Prefect server may be a child too)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "verlflow.core.stages" in cmd or "torch.distributed.run" in cmd:
            out.append(p)
    return out


def _no_children():
    deadline = time.monotonic() + 10
    while _stage_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    return not _stage_processes()


@pytest.mark.slow(
    reason="covered by test_hangs::test_a_pool_stage_hung_in_a_collective_times_out_with_every_ranks_stack")
def test_failure_ends_the_pool_and_a_rerun_starts_fresh(tiny_kit, tmp_path, monkeypatch):
    # Synchronous commits here (each stage committed before the next starts); the background ones are below.
    bp = tiny_blueprint(tiny_kit, tmp_path, resources__warm_workers=True, resources__async_checkpoint=False)
    monkeypatch.setenv("VERLFLOW_FAULT", "nan_loss")
    lines = []
    with pytest.raises(StageFailure) as err:
        run_pipeline(bp, "p", on_line=lines.append)
    assert err.value.kind is FailureKind.NONFINITE and not err.value.retryable
    assert "update[1]" in "\n".join(lines) and "warm pool" in "\n".join(lines)
    assert (tmp_path / "runs/p/1/rollout/manifest.json").is_file()
    assert not (tmp_path / "runs/p/1/update").exists()  # nothing of the failed stage is left
    assert _no_children()

    monkeypatch.delenv("VERLFLOW_FAULT")
    pending = []
    results = run_pipeline(bp, "p", on_line=lambda line: None, on_step=lambda step, res: pending.append(res.pending))
    assert not any(pending)
    assert [(r.manifest["stage"], r.skipped) for r in results] == [
        ("validate", True), ("build", True), ("rollout", True), ("update", False), ("export", False)]
    # The fresh pool's start-up (spawn, imports) is its own timing, not charged to its first stage.
    assert results[3].manifest["timings"]["pool_start_s"] > 1
    assert max(r.manifest["timings"]["launch_to_worker_s"] for r in results[3:]) < 0.5
    assert "pool_start_s" not in results[4].manifest["timings"]
    assert _no_children()


def test_a_crash_during_a_background_commit_commits_nothing_after_it(tiny_kit, tmp_path, monkeypatch):
    """resources.async_checkpoint: the update returns while its checkpoint is written; the next stages run. A rank
    killed as that commit begins fails the run, and neither the update nor any later stage is visible: commits
    keep the stages' order. The rerun resumes at the update and lands every commit, in order."""
    bp = tiny_blueprint(tiny_kit, tmp_path, resources__warm_workers=True, iterations=2)
    assert bp.resources.async_checkpoint  # the default
    scratch = _own_temp_folder(tmp_path, monkeypatch)
    monkeypatch.setenv("VERLFLOW_FAULT", "kill_rank1_in_commit")
    monkeypatch.setenv("VERLFLOW_FAULT_ONCE", str(tmp_path / "fired"))
    lines = []
    with pytest.raises(StageFailure):
        run_pipeline(bp, "a", on_line=lines.append)
    assert "SIGKILL in commit" in "\n".join(lines)
    assert (tmp_path / "runs/a/1/rollout/manifest.json").is_file()  # before any background commit
    committed = sorted(p.parent.relative_to(tmp_path / "runs/a").as_posix()
                       for p in (tmp_path / "runs/a").rglob("manifest.json"))
    assert committed == ["1/rollout", "init/build", "init/validate"], committed
    assert not list(tmp_path.rglob("latest*"))  # nothing promoted
    assert not list(scratch.glob("verlflow-update-*"))
    assert _no_children()

    pending = {}
    results = run_pipeline(bp, "a", on_line=lambda line: None,
                           on_step=lambda step, res: pending.__setitem__(step.name, res.pending))
    assert [(r.manifest["stage"], r.manifest["iteration"]) for r in results if not r.skipped] == [
        ("update", 1), ("export", 1), ("rollout", 2), ("update", 2), ("export", 2)]
    assert pending["update[1]"] and pending["update[2]"]  # returned before their checkpoints were written
    assert all("committed_at" in r.manifest and "files" in r.manifest for r in results)  # landed by the end
    order = [r.manifest["committed_at"] for r in results]
    assert order == sorted(order)
    for it in (1, 2):  # the background write is what the commit digested
        m = results[2 + 3 * (it - 1) + 1].manifest
        assert any(f.startswith("policy/dcp/") for f in m["files"]) and m["timings"]["background_s"] > 0
    assert list(tmp_path.rglob("latest*"))  # promoted after export[2]'s background commit
    assert _no_children()


def _own_temp_folder(tmp_path, monkeypatch) -> Path:
    """The driver's temp folder, where run_stage makes each stage's scratch folder: this test's own, so another
    test's pipeline running beside it (the other xdist worker) cannot leave one there."""
    folder = tmp_path / "temp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.mark.slow(reason="covered by test_faults::test_s3_endpoint_stops_during_an_upload")
def test_background_commits_upload_to_s3(tiny_kit, s3_bucket, tmp_path, monkeypatch):
    """A remote store: the background commit uploads the update from the job's scratch folder, which the pool
    removes after the commit; the next stages wait for it where they read it; every artifact verifies on
    download and a rerun reuses all of them."""
    from verlflow.core.store.artifacts import open_store

    bp = tiny_blueprint(tiny_kit, f"{s3_bucket.uri}/vf", resources__warm_workers=True, iterations=2)
    folder = _own_temp_folder(tmp_path, monkeypatch)
    scratch = lambda: set(folder.glob("verlflow-update-*"))  # noqa: E731
    before, pending = scratch(), {}
    results = run_pipeline(bp, "s", on_line=lambda line: None,
                           on_step=lambda step, res: pending.__setitem__(step.name, res.pending))
    assert pending["update[1]"] and pending["update[2]"]
    assert all(r.manifest.get("committed_at") for r in results)
    store = open_store(bp.storage)
    got = store.materialize("runs/s/2/update", tmp_path / "dl")  # checksums verified
    assert (got / "policy/state.json").is_file() and list((got / "policy/dcp").iterdir())
    assert scratch() == before, "a background commit left its scratch folder"
    again = run_pipeline(bp, "s", on_line=lambda line: None)
    assert all(r.skipped for r in again)
    assert _no_children()


@pytest.mark.slow(reason="covered by test_hangs::test_fourteen_stages_with_background_commits_under_cpu_load")
def test_a_pipeline_lands_its_background_commits_before_it_returns_whatever_its_caller_holds(tiny_kit, tmp_path):
    """The loop owns its warm pools: a caller's own pools block (another loop's, a flow's) neither keeps them open
    past the loop nor hands the loop's stages back before their background commits landed and promoted."""
    from verlflow.core.orchestrate.pool import warm_pools

    bp = tiny_blueprint(tiny_kit, tmp_path, resources__warm_workers=True, iterations=1)
    with warm_pools():
        pending = []
        results = run_pipeline(bp, "own", on_line=lambda line: None,
                               on_step=lambda step, res: pending.append(res.pending))
        assert any(pending)  # the run had background commits to land
        assert all(r.manifest and r.manifest.get("committed_at") for r in results)
        assert (tmp_path / "pointers/runs/own/latest.json").is_file()  # export[1]'s commit promoted it
        assert _no_children()  # the pools were closed when the loop ended


@pytest.mark.slow(reason="covered by test_cancel_ui::test_cancel_in_the_ui_of_a_served_run_under_load")
def test_cancel_kills_the_pool(tiny_kit, tmp_path, monkeypatch):
    bp = tiny_blueprint(tiny_kit, tmp_path, resources__warm_workers=True)
    monkeypatch.setenv("VERLFLOW_FAULT", "hang_in_rollout")
    cancel, hanging, outcome = threading.Event(), threading.Event(), {}

    def on_line(line):
        if "hanging in rollout" in line:
            hanging.set()

    def go():
        try:
            run_pipeline(bp, "c", on_line=on_line, cancel=cancel)
        except StageFailure as e:
            outcome["error"] = e

    t = threading.Thread(target=go)
    t.start()
    assert hanging.wait(120), "the rollout never started"
    t0 = time.monotonic()
    cancel.set()
    t.join(60)
    assert not t.is_alive()
    assert outcome["error"].kind is FailureKind.CANCELLED
    assert time.monotonic() - t0 < 15
    assert _no_children()
    assert not (tmp_path / "runs/c/1/rollout").exists()


def test_stage_jobs_share_a_persistent_compile_cache(monkeypatch, tmp_path):
    """Compiled kernels (inductor's, Triton's) are cached under VERLFLOW_CACHE_DIR (not /tmp), so the next stage job
    reuses them; a TORCHINDUCTOR_CACHE_DIR of the user's own wins."""
    from verlflow.core.orchestrate.runner import _worker_env

    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("VERLFLOW_CACHE_DIR", str(tmp_path))
    assert _worker_env(2)["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert _worker_env(2)["TRITON_CACHE_DIR"] == str(tmp_path / "triton")  # Triton's kernels in the same folder
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/mine")
    assert "TORCHINDUCTOR_CACHE_DIR" not in _worker_env(2)  # inherited from the environment as it is


def test_compile_meter_counts_frames_and_lazy_backward_compiles():
    """What a stage's manifest reports as compile_s / compiles: dynamo's frame compile and the backward compiled at
    the first backward both count; a call that finds its compiled graph counts nothing (this would catch torch
    renaming the timers the meter reads)."""
    from verlflow.core.ml.compiletime import Meter

    lin = torch.nn.Linear(4, 4)
    f = torch.compile(lambda x: lin(x).relu().sum(), backend="aot_eager")
    meter = Meter()
    f(torch.randn(2, 4)).backward()
    n, seconds, parts = meter.read(min_s=0.0)
    assert n == 2 and seconds > 0, (n, seconds)
    assert {"bytecode_tracing", "build_guards"} <= set(parts), parts  # the phases it names are dynamo's own
    again = Meter()
    f(torch.randn(2, 4)).backward()
    assert again.read()[:2] == (0, 0.0)


def test_a_pool_waiting_for_gpus_does_not_block_the_other_pools(tmp_path):
    """Making a pool may wait for GPU claims (held, perhaps, by another pool): it must not hold the registry's
    lock meanwhile, or the pool it waits for could never be used or closed. A pool made for a key that got one
    meanwhile is discarded unstarted."""
    from verlflow.core.orchestrate import pool as P

    release, waiting = threading.Event(), threading.Event()

    def slow_make():
        waiting.set()
        release.wait(30)  # a GPU claim that the other pool's owner must be able to get past
        return P.WarmPool(1, {}, str(tmp_path), print)

    started = []

    class Recorder(P.WarmPool):
        def start(self):
            started.append(self)
            self.started = True  # no torchrun job: the registry logic is what is under test
            return self

    with P.warm_pools() as pools:
        result = {}
        t = threading.Thread(target=lambda: result.update(slow=pools.acquire(("a",), slow_make)))
        t.start()
        assert waiting.wait(10)
        t0 = time.monotonic()
        other = pools.acquire(("b",), lambda: Recorder(1, {}, str(tmp_path), print))
        assert other is not None and started == [other] and time.monotonic() - t0 < 5
        pools.acquire(("a",), lambda: Recorder(1, {}, str(tmp_path), print))  # someone else got key "a" first
        release.set()
        t.join(30)
        assert result["slow"] is None  # the late pool was discarded, not registered or started
        for p in started:
            p._gone.set()  # let close() finish without a job to stop


@pytest.fixture
def small_fs(tmp_path):
    """A 16 MiB tmpfs: room for the whole tiny run by validate's estimate (~6 MB), until `fill_up` takes it."""
    with small_tmpfs(tmp_path / "small", "16m") as mnt:
        yield mnt


def test_a_full_store_during_a_background_commit_says_so_and_leaves_no_partial_stage(tiny_kit, small_fs):
    """The update's checkpoint is written in the background while export[1] exports: whichever write finds
    the filesystem full first fails the run with one clear message naming the stage and the place, and neither
    leaves files behind (the update's partial DCP folder is removed when its commit never lands)."""
    bp = tiny_blueprint(tiny_kit, small_fs / "store", resources__warm_workers=True)

    def fill_up(step, res):  # another writer takes the space validate saw: the update's checkpoint no longer fits
        if step.name == "rollout[1]":
            (small_fs / "ballast").write_bytes(b"\0" * (shutil.disk_usage(small_fs).free - (1 << 20)))

    with pytest.raises(StageFailure) as err:
        run_pipeline(bp, "full", on_line=lambda line: None, on_step=fill_up)
    msg = str(err.value)
    assert "no space left on device" in msg and str(small_fs / "store") in msg, msg
    assert "update[1]" in msg or "export[1]" in msg, msg
    assert "Traceback" not in msg and err.value.kind is FailureKind.USER_ERROR, msg
    runs = small_fs / "store/runs/full"
    stages = {p.relative_to(runs).as_posix(): (p / "manifest.json").is_file() for p in runs.glob("*/*")}
    assert stages == {"init/validate": True, "init/build": True, "1/rollout": True}, stages
    assert _no_children()


def test_commits_that_did_not_land_fail_with_the_pools_own_kind_and_cause_said_once():
    """When every stage returned but background commits did not land (the pool failed while committing the last
    ones: which of the two paths a full disk takes depends on timing), the failure has the pool's kind (a full disk
    is USER_ERROR: no retry helps), names every stage, and says the cause once, without a traceback."""
    from verlflow.core.orchestrate.pool import _not_landed

    full = StageFailure(FailureKind.USER_ERROR, "rank 0 failed (exit code 1): StoreError: no space left on device: "
                        "the background commit of update[1] could not write its files to /store", rank=0,
                        traceback="Traceback (most recent call last): ...")
    err = _not_landed([("runs/r/1/update", full), ("runs/r/1/export", full)])
    msg = str(err)
    assert err.kind is FailureKind.USER_ERROR and not err.retryable, msg
    assert "runs/r/1/update, runs/r/1/export" in msg and msg.count("no space left on device") == 1, msg
    assert "Traceback" not in msg, msg
    crashed = _not_landed([("runs/r/2/update", RuntimeError("the pool's torchrun vanished"))])
    assert crashed.kind is FailureKind.UNKNOWN and "the pool's torchrun vanished" in str(crashed)
    assert _not_landed([("runs/r/2/update", None)]).kind is FailureKind.UNKNOWN


@pytest.mark.slow(reason="covered by test_hangs::test_fourteen_stages_with_background_commits_under_cpu_load")
def test_a_background_commit_logs_under_its_own_stage(tiny_kit, tmp_path):
    """The update's commit runs while export[1] exports: its lines go to update[1]'s log, tagged, not into the
    log of the stage running meanwhile."""
    from verlflow.core.orchestrate.pipeline import plan, warm_start_source
    from verlflow.core.orchestrate.pool import warm_pools
    from verlflow.core.orchestrate.runner import RunContext, run_stage

    bp = tiny_blueprint(tiny_kit, tmp_path, resources__warm_workers=True)
    logs, done = {}, {}
    with warm_pools() as pools:
        for step in plan(bp, "t", warm_start_source(bp, "t")):
            lines = logs.setdefault(step.name, [])
            ctx = RunContext(bp, "t", on_line=lines.append, pools=pools)
            done[step.name] = run_stage(ctx, step.stage, step.iteration, step.inputs)
    assert done["update[1]"].pending
    commit = [line for line in logs["update[1]"] if "[background update[1]] committed" in line]
    assert len(commit) == 1 and "runs/t/1/update" in commit[0], logs["update[1]"][-5:]
    assert not [line for name, lines in logs.items() if name != "update[1]" for line in lines
                if "background update[1]" in line or "runs/t/1/update (" in line]
