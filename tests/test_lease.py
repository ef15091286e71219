"""A run's lease (core/store/lease.py): one runner per run id, with real processes, a local store and S3 (moto server)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from verlflow.core.store.artifacts import ArtifactStore
from verlflow.core.store.lease import Lease, RunBusyError, run_lease

pytestmark = pytest.mark.system

VERLFLOW = str(Path(sys.executable).with_name("verlflow"))


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path) -> ArtifactStore:
    if request.param == "file":
        return ArtifactStore(tmp_path / "store")
    return ArtifactStore(f"{request.getfixturevalue('s3_bucket').uri}/prefix")


def _plant(store: ArtifactStore, run_id: str, **holder) -> None:
    """A lease written by some other runner (what its process would have written)."""
    now = time.time()
    record = {"host": "elsewhere", "pid": 4242, "started": now - 60, "since": now - 60, "renewed": now,
              "token": "t" * 32, "flow_run_id": None, **holder}
    assert store.create_exclusive(f"leases/{run_id}.json", json.dumps(record).encode())


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.1)


def test_conditional_writes_let_one_writer_win(store):
    key = "leases/x.json"
    v1 = store.create_exclusive(key, b"one")
    assert v1 and store.create_exclusive(key, b"two") is None
    assert store.read_versioned(key) == (b"one", v1)
    v2 = store.replace_if(key, b"three", v1)
    assert v2 and store.replace_if(key, b"four", v1) is None  # v1 is stale now
    assert store.get_bytes(key) == b"three"
    assert not store.delete_if(key, v1) and store.exists(key)
    assert store.delete_if(key, v2) and not store.exists(key)
    assert store.read_versioned(key) is None and store.replace_if(key, b"five", v2) is None


def test_a_live_holder_is_refused_and_the_lease_is_released(store):
    with run_lease(store, "r1") as held:
        with pytest.raises(RunBusyError) as e:
            with run_lease(store, "r1"):
                pass
        msg = str(e.value)
        assert f"pid {os.getpid()} on host {socket.gethostname()} since 20" in msg
        assert "Wait until it ends" in msg and f"kill {os.getpid()}" in msg and "another run id" in msg
        assert store.read_versioned("leases/r1.json")[1] == held.version  # the refused runner changed nothing
        with run_lease(store, "r2"):  # other run ids are free
            pass
    assert not store.exists("leases/r1.json")
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C releases it too
        with run_lease(store, "r1"):
            raise KeyboardInterrupt
    assert not store.exists("leases/r1.json")


def test_of_many_concurrent_takers_exactly_one_wins(tmp_path):
    store, won, refused = ArtifactStore(tmp_path / "store"), [], []
    start = threading.Barrier(8)

    def take():
        lease = Lease(store, "r1", say=lambda line: None)
        start.wait()
        try:
            lease.acquire()
            won.append(lease)
        except RunBusyError:
            refused.append(lease)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == 7
    assert json.loads(store.get_bytes("leases/r1.json"))["token"] == won[0].me.token


def test_the_lease_of_a_dead_process_is_taken_over(store, tmp_path):
    code = ("import sys, time; from verlflow.core.store.artifacts import ArtifactStore; from verlflow.core.store.lease import Lease; "
            f"Lease(ArtifactStore({store.root_uri!r}), 'r1').acquire(); open(sys.argv[1], 'w').close(); time.sleep(600)")
    held = tmp_path / "held"
    proc = subprocess.Popen([sys.executable, "-c", code, str(held)], cwd=Path(__file__).parents[1])
    try:
        _wait_for(held, proc)
        with pytest.raises(RunBusyError, match=f"pid {proc.pid} on host"):
            Lease(store, "r1").acquire()  # alive: refused
    finally:
        proc.kill()
    proc.wait()
    said = []
    with run_lease(store, "r1", say=said.append) as lease:
        assert json.loads(store.get_bytes("leases/r1.json"))["pid"] == os.getpid()
        assert lease.version
    assert len(said) == 1 and said[0].startswith(
        f"[verlflow] run r1: took over the lease of pid {proc.pid} on host {socket.gethostname()} since 20")
    assert said[0].endswith("its process is no longer running")


def test_a_reused_pid_does_not_keep_a_lease(store):
    """Our parent is alive, but it is not the process that took this lease (another start time)."""
    _plant(store, "r1", host=socket.gethostname(), pid=os.getppid(), started=1.0)
    said = []
    with run_lease(store, "r1", say=said.append):
        pass
    assert "its process is no longer running" in said[0]


def test_a_retry_of_the_same_flow_run_is_not_blocked_by_itself(store):
    _plant(store, "r1", flow_run_id="flow-run-a")  # live (renewed just now) on another host
    with pytest.raises(RunBusyError, match="Prefect flow run flow-run-a"):
        Lease(store, "r1", flow_run_id="flow-run-b").acquire()
    with pytest.raises(RunBusyError):
        Lease(store, "r1").acquire()
    said = []
    with run_lease(store, "r1", flow_run_id="flow-run-a", say=said.append):
        assert json.loads(store.get_bytes("leases/r1.json"))["pid"] == os.getpid()
    assert "an earlier attempt of the same Prefect flow run (a Retry)" in said[0]


def test_a_lease_from_another_host_is_taken_over_once_it_is_not_renewed(store, monkeypatch):
    monkeypatch.setenv("VERLFLOW_LEASE_STALE_S", "30")
    _plant(store, "r1", renewed=time.time() - 10)
    with pytest.raises(RunBusyError, match="once it has not been renewed for 30 s"):
        Lease(store, "r1").acquire()
    store.rm("leases/r1.json")
    _plant(store, "r1", renewed=time.time() - 40)
    said = []
    with run_lease(store, "r1", say=said.append):
        pass
    assert "it was not renewed for 40 s" in said[0]


def test_the_holder_renews_its_lease(store, monkeypatch):
    monkeypatch.setenv("VERLFLOW_LEASE_RENEW_S", "0.2")
    with run_lease(store, "r1"):
        first = json.loads(store.get_bytes("leases/r1.json"))["renewed"]
        deadline = time.monotonic() + 30
        while json.loads(store.get_bytes("leases/r1.json"))["renewed"] == first:
            assert time.monotonic() < deadline, "the lease was never renewed"
            time.sleep(0.1)
    assert not store.exists("leases/r1.json")


def test_a_second_verlflow_rerun_of_a_running_run_is_refused(tiny_kit, tmp_path):
    """Two real `verlflow` processes on one run id: the second is refused naming the first (host, pid, since) and
    touches nothing; Ctrl-C of the first releases the lease."""
    store = tmp_path / "store"
    args = [f"model.path={tiny_kit['model_dir']}", f"data.train_files=[{tiny_kit['train_file']}]",
            f"storage.uri={store}", "resources.nproc_per_node=1", "iterations=1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VERLFLOW_FAULT": "hang_in_validate",
           "VERLFLOW_CACHE_DIR": str(tmp_path / "cache")}
    first = subprocess.Popen([VERLFLOW, "run", *args, "--run-id", "busy"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(store / "leases" / "busy.json", first)
        before = sorted(p.relative_to(store).as_posix() for p in store.rglob("*"))
        second = subprocess.run([VERLFLOW, "rerun", "busy", *args], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        assert "Traceback" not in second.stderr and second.stdout == ""
        assert f"Run busy is already being run by pid {first.pid} on host {socket.gethostname()} since " \
               in second.stderr and "Wait until it ends" in second.stderr
        assert sorted(p.relative_to(store).as_posix() for p in store.rglob("*")) == before
        ls = subprocess.run([VERLFLOW, "ls", *args, "--run", "busy"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
        assert f"run busy is being run by pid {first.pid} on host {socket.gethostname()}" in ls.stdout, ls.stderr
    finally:
        first.send_signal(signal.SIGINT)
        try:
            out, err = first.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # leave no runner behind for the other tests, then fail
            for p in [*psutil.Process(first.pid).children(recursive=True), psutil.Process(first.pid)]:
                p.kill()
            raise
    assert first.returncode == 130, out + err
    assert not (store / "leases" / "busy.json").exists()


def test_the_flow_refuses_a_run_held_by_another_runner_and_a_run_id_too_long(prefect_server, tiny_kit, tmp_path):
    from verlflow.flows.finetune import finetune
    from tinybp import ONE_RANK, tiny_blueprint

    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK)
    store = ArtifactStore(tmp_path / "store")
    _plant(store, "held1", flow_run_id="someone-else")
    state = finetune(blueprint=bp, run_id="held1", return_state=True)
    assert state.is_failed() and "Run held1 is already being run by pid 4242 on host elsewhere" in state.message
    assert not (tmp_path / "store" / "runs").exists()
    state = finetune(blueprint=bp, run_id="r" * 300, return_state=True)
    assert state.is_failed() and "300 characters, at most 128 are allowed" in state.message
