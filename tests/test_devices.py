"""GPU claims: two local jobs never get the same device; a claim is all-or-nothing and released on exit."""

import threading
import time

import pytest

from verlflow.core.orchestrate.devices import claim

pytestmark = pytest.mark.unit


def test_two_jobs_get_disjoint_devices_and_the_second_waits(tmp_path):
    first_in, release, seen = threading.Event(), threading.Event(), {}

    def job(name, n):
        with claim(n, ["0", "1", "2"], lock_dir=tmp_path, poll_s=0.05) as ids:
            seen[name] = (ids, time.monotonic())
            if name == "a":
                first_in.set()
                release.wait(5)

    a = threading.Thread(target=job, args=("a", 2))
    a.start()
    first_in.wait(5)
    b = threading.Thread(target=job, args=("b", 2))  # needs 2, only 1 is free: must wait for a
    b.start()
    time.sleep(0.4)
    assert "b" not in seen
    t_release = time.monotonic()
    release.set()
    a.join(5), b.join(5)
    assert seen["a"][0] == ["0", "1"] and len(seen["b"][0]) == 2 and seen["b"][1] >= t_release


def test_claim_fits_beside_another_and_refuses_too_many(tmp_path):
    with claim(1, ["0", "1"], lock_dir=tmp_path) as a, claim(1, ["0", "1"], lock_dir=tmp_path) as b:
        assert {a[0], b[0]} == {"0", "1"}
    with pytest.raises(TimeoutError):
        with claim(2, ["0", "1"], lock_dir=tmp_path), claim(1, ["0", "1"], lock_dir=tmp_path, timeout_s=0.3):
            pass
    with pytest.raises(RuntimeError, match="needs 3 GPUs but only 2"):
        with claim(3, ["0", "1"], lock_dir=tmp_path):
            pass


def test_runner_sets_cuda_visible_devices_for_local_cuda_jobs(monkeypatch, tmp_path):
    from verlflow.core.blueprint import Blueprint
    from verlflow.core.orchestrate import devices, runner
    from verlflow.core.orchestrate.launcher import LaunchSpec

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    monkeypatch.setattr(devices, "LOCK_DIR", tmp_path)
    bp = Blueprint(resources={"device": "cuda", "nproc_per_node": 2})
    spec = LaunchSpec("m", [], nproc_per_node=2)
    with runner._gpus(bp.resources, spec, print):
        assert spec.env["CUDA_VISIBLE_DEVICES"] == "4,5"
        spec2 = LaunchSpec("m", [], nproc_per_node=1)
        with runner._gpus(bp.resources, spec2, print):
            assert spec2.env["CUDA_VISIBLE_DEVICES"] == "6"
