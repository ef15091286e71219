"""DCP at disk speed (verlflow.core.ml.dcpio): several writer/reader threads per rank, errors that reach the caller,
the background save's one-slab CPU copy. Real torchrun jobs (gloo, FSDP2) running verlflow.core.testing.dcp_probe."""

import json

import pytest
from sysdeps import small_tmpfs
import torch

from verlflow.core.orchestrate.launcher import LaunchSpec, launch

pytestmark = pytest.mark.stages

QUIET = dict(on_line=lambda line: None)


def probe(tmp_path, world: int, **job) -> None:
    path = tmp_path / f"job-{job['op']}-{world}.json"
    path.write_text(json.dumps(job))
    launch(LaunchSpec("verlflow.core.testing.dcp_probe", [str(path)], nproc_per_node=world, timeout_s=180), **QUIET)


def full(path) -> dict:
    return torch.load(path, weights_only=True)


def assert_identical(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    assert any(k.endswith("exp_avg_sq") for k in want), "the optimizer's state is part of the checkpoint"
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"{what}: {differ[:5]}"


def test_threaded_checkpoint_round_trips_exactly_and_reshards(tmp_path):
    """Saved by 2 ranks with 3 writer threads each (a file per thread), loaded at 1 rank (checkpoint.load), saved
    there with 2 threads and loaded at 2 ranks with 3 reader threads: model and AdamW state bit-identical to the
    first saver's each time."""
    a, b = tmp_path / "a", tmp_path / "b"
    probe(tmp_path, 2, op="save", ckpt=str(a), out=str(tmp_path / "saved.pt"), threads=3, steps=2)
    assert sorted(p.name for p in (a / "dcp").iterdir()) == [".metadata"] + [
        f"__{rank}_{thread}_0.distcp" for rank in range(2) for thread in range(3)]
    want = full(tmp_path / "saved.pt")
    probe(tmp_path, 1, op="load", ckpt=str(a), out=str(tmp_path / "w1.pt"), save_to=str(b), save_threads=2)
    assert_identical(full(tmp_path / "w1.pt"), want, "2 ranks -> 1")
    assert sorted(p.name for p in (b / "dcp").iterdir()) == [".metadata", "__0_0_0.distcp", "__0_1_0.distcp"]
    probe(tmp_path, 2, op="load", ckpt=str(b), out=str(tmp_path / "w2.pt"), threads=3)
    assert_identical(full(tmp_path / "w2.pt"), want, "1 rank -> 2")


def test_slab_copy_checkpoints_equal_per_tensor_staging(tmp_path):
    """The committer's CPU copy is one slab (every tensor a view of it with a storage of its own size, so DCP
    neither clones nor writes the whole slab per tensor); its checkpoint equals today's per-tensor staging's, and
    its second save, refilled after another step, the new state."""
    out = tmp_path / "full"
    probe(tmp_path, 2, op="stage", ckpt=str(tmp_path / "ckpt"), out=str(out))
    report = json.loads((tmp_path / "full.json").read_text())
    # the first save makes its copy, the second refills it; a slab reserved ahead (as a warm pool's build does for
    # the first update, sized before the optimizer stepped, with a tied head) takes the first save of another role
    assert report == {"leaves": report["leaves"], "reused": True, "in_slab": True, "exact_storages": True,
                      "how": ["made", "refilled", "reserved"], "reserved_fits": True}
    assert report["leaves"] >= 3 * 7  # 7 parameters, each with exp_avg and exp_avg_sq
    live1, live2 = full(f"{out}.live1"), full(f"{out}.live2")
    assert_identical(full(f"{out}.old"), live1, "today's per-tensor staging")
    assert_identical(full(f"{out}.one"), live1, "the slab copy")
    assert_identical(full(f"{out}.two"), live2, "the slab copy, refilled")
    assert_identical(full(f"{out}.three"), full(f"{out}.live3"), "a first save into a reserved slab")
    assert any(not torch.equal(live1[k], live2[k]) for k in live1)  # the second save had something new to write


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs: the probe's checkpoint (~2.7 MB in 6 files) does not fit, its first files do."""
    with small_tmpfs(tmp_path / "small", "1m") as mnt:
        yield mnt


@pytest.mark.slow(
    reason="covered by test_pool::test_a_full_store_during_a_background_commit_says_so_and_leaves_no_partial_stage")
def test_a_writer_thread_that_fails_fails_the_save(tmp_path, small_fs):
    """With 3 writer threads per rank on a filesystem that fills up midway, the save raises (as no space left),
    writes no metadata, and through the committer the background commit says so."""
    probe(tmp_path, 2, op="fail", ckpt=str(small_fs), roomy=str(tmp_path / "roomy"), out=str(tmp_path / "fail.json"),
          threads=3)
    report = json.loads((tmp_path / "fail.json").read_text())
    assert report["inline"] == {"type": "CheckpointException", "no_space": True}, report
    assert report["inline_metadata"] is False
    assert report["background"]["type"] == "StoreError", report
    assert "no space left on device" in report["background"]["message"], report
