"""Hangs and load: warm pools with background commits on a machine whose every core is busy, a stage stuck in a
collective (its timeout shows every rank's stack), and Cancel of such a stage (the job dies at once).

The deadlock these guard against needed a loaded machine: one rank's committer thread lagged, so the ranks
decided differently whether a commit was pending and waited in different groups' barriers."""

import multiprocessing as mp
import os
import time

import psutil
import pytest
import torch
from tinybp import tiny_blueprint

from core import checkpoint, model as M
from core.launcher import FailureKind, StageFailure
from core.pipeline import run_pipeline
from core.runner import run_stage

QUIET = dict(on_line=lambda line: None)


def _spin() -> None:
    while True:
        pass


@pytest.fixture
def cpu_hog():
    """A busy loop on every core, at the workers' own priority, for the test's duration."""
    hogs = [mp.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 1)]
    for h in hogs:
        h.start()
    yield len(hogs)
    for h in hogs:
        h.kill()
        h.join()


def _weights(store, run_id: str, stage_dir: str, bp) -> dict:
    model = M.build_module(store / "runs" / run_id / "init/build/hf_meta", bp)
    checkpoint.load_full(store / "runs" / run_id / stage_dir / "policy", model)
    return model.state_dict()


def _stage_processes() -> list:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "core.stages" in " ".join(p.cmdline()) or "torch.distributed.run" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def test_twenty_stages_with_background_commits_under_cpu_load(tiny_kit, tmp_path, cpu_hog):
    """3 ranks, 6 iterations (20 stages) in one warm pool with background commits while every core spins: no
    stage hangs (a hang would hit the 120 s stage timeout), every stage commits, and the weights equal the
    one-process run's, which equal fresh jobs' (tests/test_stages.py)."""
    bp = tiny_blueprint(tiny_kit, tmp_path, iterations=6, resources__warm_workers=True, resources__nproc_per_node=3,
                        resources__stage_timeout_s=120, data__batch_size=6, algorithm__ppo_mini_batch_size=3)
    assert bp.resources.async_checkpoint
    pending = []
    results = run_pipeline(bp, "load", on_step=lambda step, res: pending.append(res.pending), **QUIET)
    assert len(results) == 20 and all(r.manifest.get("committed_at") for r in results)
    assert sum(pending) >= 6  # every update's commit went to the background
    mono = run_stage("monolithic", bp, "load", "mono", {"build": "runs/load/init/build"}, **QUIET)
    got, want = _weights(tmp_path, "load", "6/update", bp), _weights(tmp_path, "load", "mono/monolithic", bp)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    rewards = [r.manifest["metrics"]["reward_mean"] for r in results if r.manifest["stage"] == "rollout"]
    assert [it["reward_mean"] for it in mono.manifest["metrics"]["iterations"]] == rewards
    print(f"\n20 stages, 3 ranks, {cpu_hog} CPU hogs: {sum(r.seconds for r in results):.1f} s")


def test_a_pool_stage_hung_in_a_collective_times_out_with_every_ranks_stack(tiny_kit, tmp_path, monkeypatch):
    """Rank 0 of validate waits in a barrier rank 1 never enters: at resources.stage_timeout_s the stage fails as
    TIMEOUT with both ranks' stacks (rank 0's in the barrier), not a silent wait; the pool is gone."""
    bp = tiny_blueprint(tiny_kit, tmp_path, resources__warm_workers=True, resources__stage_timeout_s=30)
    monkeypatch.setenv("VERLFLOW_FAULT", "barrier_hang_in_validate")
    with pytest.raises(StageFailure) as info:
        run_pipeline(bp, "h", **QUIET)
    e = info.value
    assert e.kind is FailureKind.TIMEOUT and "validate ran past its timeout of 30 s" in str(e)
    rank0, _, rank1 = e.traceback.partition("rank 1 stacks when stopped:")
    assert rank0.startswith("rank 0 stacks when stopped:") and "in barrier" in rank0 and "hang_point" in rank0
    assert "hang_point" in rank1 and "in barrier" not in rank1
    assert not (tmp_path / "runs/h/init/validate/manifest.json").exists()
    deadline = time.monotonic() + 10
    while _stage_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _stage_processes()
