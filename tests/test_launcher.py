"""verlflow.core.orchestrate.launcher against a real torchrun: 2 ranks, gloo on CPU, verlflow.core.testing.probe as the worker."""

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from verlflow.core.orchestrate.diagnose import classify
from verlflow.core.orchestrate.launcher import FailureKind, LaunchSpec, StageFailure, build_command, launch

pytestmark = pytest.mark.stages

PROBE = "verlflow.core.testing.probe"


def _spec(mode, pid_dir=None, **kw):
    args = ["--mode", mode] + (["--pid-dir", str(pid_dir)] if pid_dir else [])
    return LaunchSpec(PROBE, args, nproc_per_node=2, **kw)


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for_pids(pid_dir, timeout=30.0):
    names = ("torchrun", "rank0", "rank1")
    deadline = time.monotonic() + timeout
    while not all((pid_dir / f"{n}.pid").exists() for n in names):
        if time.monotonic() > deadline:
            raise AssertionError(f"workers did not start within {timeout} s")
        time.sleep(0.05)
    return {n: int((pid_dir / f"{n}.pid").read_text()) for n in names}


def _assert_tree_gone(pids, within=0.0):
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [n for n, p in pids.items() if _alive(p)], pids
    group = []  # torchrun led its own process group: nothing may be left in it
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pids["torchrun"] and p.info["status"] != psutil.STATUS_ZOMBIE:
                group.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    assert not group


def test_build_command():
    cmd = build_command(LaunchSpec("verlflow.core.stages.x", ["--a", "1"], nproc_per_node=2, rdzv_id="r1", log_dir="/l"))
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[-4:] == ["-m", "verlflow.core.stages.x", "--a", "1"]
    flags = dict(zip(cmd[3:-4:2], cmd[4:-4:2]))
    assert flags["--nproc-per-node"] == "2" and flags["--rdzv-backend"] == "c10d"
    assert flags["--rdzv-id"] == "r1" and flags["--max-restarts"] == "0" and flags["--log-dir"] == "/l"
    with pytest.raises(ValueError):
        build_command(LaunchSpec("m", [], nnodes=2))


@pytest.mark.parametrize("message, kind", [
    ("RuntimeError: [third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms "
     "for recv operation to complete", FailureKind.COLLECTIVE_TIMEOUT),  # as torch 2.13 + gloo says it
    ("DistBackendError: [Rank 0] Watchdog caught collective operation timeout", FailureKind.COLLECTIVE_TIMEOUT),
    ("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", FailureKind.OOM),
    ("NonFiniteError: grad norm is nan", FailureKind.NONFINITE),
    ("RuntimeError: ProcessGroupGloo does not support reduce_scatter", FailureKind.USER_ERROR),
    ("InputError: prompts.parquet has no column 'prompt'", FailureKind.USER_ERROR),
])
def test_classify(message, kind):
    assert classify(message) is kind


def test_streams_rank_prefixed_lines_while_running():
    seen = []
    result = launch(_spec("sleep-then-print"), on_line=lambda line: seen.append((time.monotonic(), line)))
    end = time.monotonic()
    assert result.returncode == 0
    lines = [line for _, line in seen]
    for rank in (0, 1):
        assert f"[rank{rank}] all_reduce=2" in lines
        first = next(t for t, line in seen if line == f"[rank{rank}] first")
        second = next(t for t, line in seen if line == f"[rank{rank}] second")
        assert second - first > 1.2 and end - first > 1.2  # delivered as printed, not at the end
    assert all(line.startswith(("[rank0] ", "[rank1] ", "[torchrun] ")) for line in lines)


def test_user_error_names_rank_and_traceback():
    with pytest.raises(StageFailure) as info:
        launch(_spec("raise"), on_line=lambda line: None)
    e = info.value
    assert (e.kind, e.rank, e.exitcode, e.retryable) == (FailureKind.USER_ERROR, 1, 1, False)
    assert "rank 1" in str(e) and "ValueError: boom-123" in str(e) and "probe.py" in str(e)
    assert "probe.py" in e.traceback
    copy = pickle.loads(pickle.dumps(e))
    assert (copy.kind, copy.rank, copy.traceback, str(copy)) == (e.kind, e.rank, e.traceback, str(e))


def test_nonfinite_is_not_retryable():
    with pytest.raises(StageFailure) as info:
        launch(_spec("nonfinite"), on_line=lambda line: None)
    assert (info.value.kind, info.value.rank, info.value.retryable) == (FailureKind.NONFINITE, 0, False)


def test_timeout_kills_the_whole_tree(tmp_path):
    with pytest.raises(StageFailure) as info:
        # 20 s: both ranks must have started (imported torch, written their pids) before the timeout; under CI's
        # load that took more than 6 s
        launch(_spec("hang", tmp_path, timeout_s=20), on_line=lambda line: None, grace_s=2)
    assert info.value.kind is FailureKind.TIMEOUT and info.value.retryable
    _assert_tree_gone(_wait_for_pids(tmp_path, timeout=0))


def test_timeout_of_a_rank_hung_in_a_collective_shows_every_ranks_stack(tmp_path):
    """Rank 0 waits in a barrier rank 1 never enters: the timeout's error carries each rank's Python stack, the
    waiting barrier on rank 0 and rank 1's own loop, instead of a silent wait. The job's time limit is a caller's
    (`expire`, the same stop as spec.timeout_s) set once both ranks hang: on a loaded machine a fixed few seconds
    may end the job while it still imports torch."""
    expire = threading.Event()

    def expire_when_hung():
        deadline = time.monotonic() + 240
        while not all((tmp_path / f"hung{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # rank 0 is inside the barrier, not just before it
        expire.set()

    threading.Thread(target=expire_when_hung, daemon=True).start()
    with pytest.raises(StageFailure) as info:
        launch(_spec("barrier-hang", tmp_path, timeout_s=300), on_line=lambda line: None, grace_s=2, expire=expire)
    e = info.value
    assert e.kind is FailureKind.TIMEOUT
    stacks = e.traceback.split("rank 1 stacks when stopped:")
    assert len(stacks) == 2 and stacks[0].startswith("rank 0 stacks when stopped:"), e.traceback
    assert "in barrier" in stacks[0] and "probe.py" in stacks[0], stacks[0]
    assert "in barrier" not in stacks[1] and "probe.py" in stacks[1], stacks[1]
    assert "rank 0 stacks" in str(e)  # shown with the error, not only kept on it
    _assert_tree_gone(_wait_for_pids(tmp_path, timeout=0))


def test_cancel_kills_the_whole_tree(tmp_path):
    cancel, seen = threading.Event(), {}

    def cancel_when_running():
        seen.update(_wait_for_pids(tmp_path))
        # torchrun starts every worker in a session of its own: killpg(torchrun) alone would miss them
        seen["sessions"] = {os.getsid(seen[n]) for n in ("torchrun", "rank0", "rank1")}
        cancel.set()

    threading.Thread(target=cancel_when_running, daemon=True).start()
    lines = []
    with pytest.raises(StageFailure) as info:
        launch(_spec("hang", tmp_path, timeout_s=60), on_line=lines.append, cancel=cancel, grace_s=2)
    assert info.value.kind is FailureKind.CANCELLED and not info.value.retryable
    assert len(seen.pop("sessions")) == 3
    _assert_tree_gone(seen)
    # The log says it was stopped, not the tracebacks of processes dying of our signals (torchrun's SignalException)
    assert "[verlflow] cancelled: stopping the job's processes" in lines
    assert not [line for line in lines if "Traceback" in line or "SignalException" in line], lines[-10:]


def test_rank_killed_by_signal(tmp_path):
    def kill_rank1():
        os.kill(_wait_for_pids(tmp_path)["rank1"], signal.SIGKILL)

    threading.Thread(target=kill_rank1, daemon=True).start()
    with pytest.raises(StageFailure) as info:
        launch(_spec("hang", tmp_path, timeout_s=60), on_line=lambda line: None)
    e = info.value
    assert (e.kind, e.rank, e.exitcode, e.signal, e.retryable) == (FailureKind.KILLED, 1, -9, "SIGKILL", True)


def test_sigkill_of_the_launching_process_takes_the_tree_down(tmp_path):
    code = textwrap.dedent(f"""
        from verlflow.core.orchestrate.launcher import launch, LaunchSpec
        launch(LaunchSpec({PROBE!r}, ["--mode", "hang", "--pid-dir", {str(tmp_path)!r}], nproc_per_node=2,
                          log_dir={str(tmp_path / "logs")!r}), on_line=lambda line: None)
    """)
    caller = subprocess.Popen([sys.executable, "-c", code])
    try:
        pids = _wait_for_pids(tmp_path)
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
    _assert_tree_gone(pids, within=5.0)


def test_a_stage_worker_loads_models_without_sklearn_and_can_still_import_it(tiny_kit, tmp_path):
    """MLflow installs scikit-learn, which transformers' generation package imports when present, and every model's
    modeling_utils imports scipy for object-detection losses (4-8 s a rank on 2 cores): a stage worker hides them
    for those imports only; the model loads, saves, and a reward function may still import both."""
    code = ("import sys\n"
            "import verlflow.core.stages.common\n"
            "from verlflow.core.stages.runtime.entry import worker_guard\n"
            "worker_guard()\n"
            "from transformers import AutoModelForCausalLM\n"
            "import transformers.generation.utils\n"
            f"m = AutoModelForCausalLM.from_pretrained({tiny_kit['model_dir']!r})\n"
            f"m.save_pretrained({str(tmp_path / 'saved')!r})\n"
            "print('loaded', *(p in sys.modules for p in ('sklearn', 'scipy', 'pandas')))\n"
            "import sklearn, scipy.optimize\n"
            "print('importable', sklearn.__name__, scipy.optimize.linear_sum_assignment.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loaded False False False" in out.stdout, out.stdout
    assert "importable sklearn linear_sum_assignment" in out.stdout, out.stdout
