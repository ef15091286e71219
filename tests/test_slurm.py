"""backend: slurm against a REAL Slurm cluster started here: munged, slurmctld and two slurmd "nodes" on this host.

The cluster (DESIGN.md §6): Debian's Slurm 22.05, MULTIPLE_SLURMD (n1, n2 both at 127.0.0.1 on their own ports),
no accounting (the backend follows jobs with `scontrol show job`), state/spool/pid/log files in a fresh folder.
Packages are installed when missing and we are root with apt-get; otherwise the module is skipped with the reason.
Every daemon the fixture starts is stopped at the end by its pid file (munged only if it was not already running).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
from sysdeps import unavailable
from tinybp import tiny_blueprint

from verlflow.core.blueprint import SlurmSpec
from verlflow.core.orchestrate.backends.slurm import SlurmBackend, job_info, render_sbatch, squeue_ids
from verlflow.core.orchestrate.launcher import FailureKind, LaunchSpec, StageFailure

pytestmark = pytest.mark.system

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
TIMINGS = {}  # name -> seconds; printed at the end (pytest -s) and written to test-outputs/slurm-timings.json


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _ensure_packages():
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "Slurm is not installed and this is not root with apt-get: " \
               f"apt-get install -y --no-install-recommends {' '.join(PACKAGES)}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True)
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            return f"could not install Slurm: {p.stderr[-500:]}"
    return None


def _pid(path: Path):
    try:
        pid = int(path.read_text().split()[0])
        return pid if psutil.pid_exists(pid) else None
    except (OSError, ValueError, IndexError):
        return None


def _stop(pids, timeout=15.0):
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            p.send_signal(signal.SIGTERM)
            procs.append(p)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        p.kill()


# infra/slurm/two-nodes-one-host.conf.in: {d} state/spool/pid/log folder, {ctld_port}, {p1}, {p2}, {cpus}
CONF = "\n".join(line for line in (Path(__file__).resolve().parent.parent / "infra/slurm/two-nodes-one-host.conf.in")
                 .read_text().splitlines() if not line.startswith("#")) + "\n"


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    reason = _ensure_packages()
    if reason:
        unavailable(reason)
    t0 = time.monotonic()
    d = tmp_path_factory.mktemp("slurm")
    (d / "state").mkdir()
    (d / "spool").mkdir()
    ctld_port, p1, p2 = _free_ports(3)
    cpus = max(1, (os.cpu_count() or 2) // 2)
    conf = d / "slurm.conf"
    conf.write_text(CONF.format(d=d, ctld_port=ctld_port, p1=p1, p2=p2, cpus=cpus))
    mp = pytest.MonkeyPatch()
    mp.setenv("SLURM_CONF", str(conf))
    started = []  # pid files of the daemons we start, stopped in reverse order
    munge_pid = Path("/run/munge/munged.pid")
    try:
        if _pid(munge_pid) is None:
            if not Path("/etc/munge/munge.key").exists():
                subprocess.run(["mungekey", "--create"], check=True)
                subprocess.run(["chown", "munge:munge", "/etc/munge/munge.key"], check=True)
            subprocess.run(["install", "-d", "-o", "munge", "-g", "munge", "/run/munge"], check=True)
            subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
            started.append(munge_pid)
        subprocess.run(["slurmctld", "-f", str(conf)], check=True)
        started.append(d / "slurmctld.pid")
        for node in ("n1", "n2"):
            subprocess.run(["slurmd", "-f", str(conf), "-N", node], check=True)
            started.append(d / f"slurmd-{node}.pid")
        deadline = time.monotonic() + 60
        while True:
            p = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True)
            states = dict(line.split() for line in p.stdout.splitlines() if line.strip())
            if states == {"n1": "idle", "n2": "idle"}:
                break
            if time.monotonic() > deadline:
                logs = "\n".join(f.read_text()[-1500:] for f in d.glob("*.log"))
                pytest.fail(f"Slurm nodes not idle after 60 s: {states}\n{logs}")
            time.sleep(0.2)
        TIMINGS["cluster_start_s"] = round(time.monotonic() - t0, 2)
        yield {"dir": d, "conf": conf}
    finally:
        ids = squeue_ids() if shutil.which("squeue") else []
        if ids:
            subprocess.run(["scancel", *ids], capture_output=True)
            deadline = time.monotonic() + 30
            while squeue_ids() and time.monotonic() < deadline:
                time.sleep(0.2)
        for pid_file in reversed(started):
            pid = _pid(pid_file)
            if pid:
                _stop([pid])
        mp.undo()
        out = Path(__file__).resolve().parent.parent / "test-outputs"
        out.mkdir(exist_ok=True)
        (out / "slurm-timings.json").write_text(json.dumps(TIMINGS, indent=2))
        print("\nSlurm timings:", json.dumps(TIMINGS, indent=2))


@pytest.fixture
def shared(tmp_path):
    return tmp_path / "shared"


def _slurm_bp(kit, store, shared, **kw):
    return tiny_blueprint(kit, store, resources__backend="slurm", resources__nnodes=2, resources__nproc_per_node=1,
                          resources__slurm__shared_dir=str(shared), **kw)


class Lines(list):
    def __call__(self, line):
        self.append((time.monotonic(), line))

    def text(self):
        return "\n".join(line for _, line in self)


def test_render_sbatch_has_the_blueprints_options(tmp_path):
    cfg = SlurmSpec(partition="gpu", account="proj42", gpus_per_node=8, cpus_per_task=16,
                    extra_sbatch=["--qos=high", "#SBATCH --exclusive"], setup=["module load cuda/12.4"],
                    python="/opt/venv/bin/python", rdzv_port_base=21000, rdzv_port_span=5000)
    spec = LaunchSpec("verlflow.core.stages.update", ["/s/job.json"], job_arg=0, nproc_per_node=8, nnodes=4, timeout_s=3600,
                      env={"AWS_SECRET_ACCESS_KEY": "s3cr3t"})
    text = render_sbatch(spec, cfg, tmp_path, tmp_path / "launch.json", job_name="verlflow-update", cwd="/proj")
    sb = [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith("#SBATCH ")]
    assert sb == ["--job-name=verlflow-update", "--nodes=4", "--ntasks-per-node=1",
                  f"--output={tmp_path}/slurm-%j.out", "--chdir=/proj", "--time=61", "--partition=gpu",
                  "--account=proj42", "--gpus-per-node=8", "--cpus-per-task=16", "--qos=high", "--exclusive"]
    assert "module load cuda/12.4" in text
    assert "RDZV_PORT=$(( 21000 + SLURM_JOB_ID % 5000 ))" in text  # unique per job
    assert "sed -n 's/^NodeAddr=//p'" in text  # the head node's address, not its name
    assert "srun --label --kill-on-bad-exit=1 --nodes=4 --ntasks=4 --ntasks-per-node=1 --cpus-per-task=16 " \
        "--gpus-per-node=8" in text  # srun (22.05+) does not inherit --cpus-per-task from sbatch
    assert "/opt/venv/bin/python -m verlflow.core.orchestrate.backends.node" in text
    assert "s3cr3t" not in text  # the environment travels with sbatch --export, never in the script
    cfg2 = SlurmSpec(time_limit="1-00:00:00")
    assert "#SBATCH --time=1-00:00:00" in render_sbatch(spec, cfg2, tmp_path, tmp_path / "l.json", job_name="j")
    with pytest.raises(ValueError, match="not one sbatch option"):
        render_sbatch(spec, SlurmSpec(extra_sbatch=["qos high"]), tmp_path, tmp_path / "l.json", job_name="j")


def test_blueprint_slurm_section_validates():
    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.errors import BlueprintError

    bp = load_blueprint(None, ["resources.backend=slurm", "resources.nnodes=2", "resources.slurm.partition=gpu",
                               "resources.slurm.extra_sbatch=['--qos=high']"])
    assert bp.resources.slurm.partition == "gpu" and bp.resources.slurm.extra_sbatch == ["--qos=high"]
    with pytest.raises(BlueprintError, match="resources.slurm.partiton: unknown key.*Did you mean 'partition'"):
        load_blueprint(None, ["resources.backend=slurm", "resources.slurm.partiton=gpu"])
    with pytest.raises(BlueprintError, match="node_rank and rdzv_endpoint are for backend local"):
        load_blueprint(None, ["resources.backend=slurm", "resources.nnodes=2", "resources.node_rank=1"])


@pytest.mark.slow(reason="covered by test_slurm::test_failing_rank_names_its_node_and_rank (2 nodes x 1 rank)")
def test_stage_runs_across_two_nodes(slurm_cluster, tiny_kit, tmp_path, shared):
    """validate (all-reduce + FSDP shard check at world size 2) and build as 2 nodes x 1 process."""
    from verlflow.core.orchestrate.runner import RunContext, run_stage

    bp = _slurm_bp(tiny_kit, tmp_path / "store", shared)
    lines = Lines()
    t0 = time.monotonic()
    res = run_stage(RunContext(bp, "sl", on_line=lines), "validate", "init", {})
    TIMINGS["validate_2x1_wall_s"] = round(time.monotonic() - t0, 2)
    assert res.manifest["world_size"] == 2
    text = lines.text()
    nodes = {line.split(" on node ")[1].split()[0] for _, line in lines if line.startswith("[verlflow-node]")}
    assert nodes == {"n1", "n2"}, text  # one torchrun agent on each Slurm node
    assert "[rank0]" in text and "sum over 2 ranks = 3.0" in text
    assert "RUNNING on n[1-2]" in text
    submit = next(t for t, line in lines if line.startswith("[slurm] submitted"))
    running = next(t for t, line in lines if "RUNNING on" in line)
    TIMINGS["submit_to_running_s"] = round(running - submit, 2)
    t0 = time.monotonic()
    build = run_stage(RunContext(bp, "sl", on_line=lines), "build", "init", {})
    TIMINGS["build_2x1_wall_s"] = round(time.monotonic() - t0, 2)
    assert build.manifest["world_size"] == 2
    assert build.manifest["metrics"]["policy_shard_balance"] == pytest.approx([1.0, 1.0], abs=0.05)
    assert not list((shared / "jobs").iterdir())  # job folders are removed
    assert not list((shared / "scratch").iterdir())


@pytest.mark.slow(reason="covered by test_slurm's failing-rank, cancel and timeout jobs and test_stages' pipelines")
def test_whole_pipeline_with_backend_slurm(slurm_cluster, tiny_kit, tmp_path, shared):
    """The tiny pipeline end to end on Slurm (2 nodes x 1), then the same on local (1 node x 2): the same
    world size, so the difference per stage is Slurm's overhead. Checkpoint is a 1-node job."""
    from verlflow.core.orchestrate.pipeline import run_pipeline

    bp = _slurm_bp(tiny_kit, tmp_path / "store", shared)
    lines = Lines()
    t0 = time.monotonic()
    results = run_pipeline(bp, "slp", on_line=lines)
    slurm_total = time.monotonic() - t0
    assert [r.manifest["stage"] for r in results] == ["validate", "build", "rollout", "update", "export"]
    assert all(not r.skipped for r in results)
    assert [r.manifest["world_size"] for r in results] == [2, 2, 2, 2, 1]
    assert (tmp_path / "store/runs/slp/1/export/hf/config.json").is_file()
    assert lines.text().count("[slurm] submitted") == 5

    local = tiny_blueprint(tiny_kit, tmp_path / "store-local", resources__nproc_per_node=2)
    t0 = time.monotonic()
    local_results = run_pipeline(local, "lp", on_line=lambda _: None)
    local_total = time.monotonic() - t0
    per_stage = {}
    for s, loc in zip(results, local_results, strict=True):
        per_stage[s.manifest["stage"]] = {"slurm_s": round(s.seconds, 2), "local_s": round(loc.seconds, 2),
                                          "overhead_s": round(s.seconds - loc.seconds, 2)}
    TIMINGS["pipeline"] = {"slurm_total_s": round(slurm_total, 2), "local_total_s": round(local_total, 2),
                           "per_stage": per_stage}
    queued = [float(line.split("queued ")[1].split(" s")[0]) for _, line in lines if "queued " in line]
    TIMINGS["pipeline_queued_s"] = queued
    # The same maths at the same world size: the rollout rewards agree exactly.
    assert results[2].manifest["metrics"]["reward_mean"] == local_results[2].manifest["metrics"]["reward_mean"]

    # A rerun reuses every committed stage without submitting anything.
    again = Lines()
    assert all(r.skipped for r in run_pipeline(bp, "slp", on_line=again))
    assert "[slurm] submitted" not in again.text()


def test_failing_rank_names_its_node_and_rank(slurm_cluster, shared, monkeypatch):
    """verlflow.core.testing.probe --mode raise: rank 1 raises after an all-reduce; the other node's rank exits cleanly."""
    monkeypatch.setenv("VERLFLOW_KEEP_SLURM_JOB_DIR", "1")
    lines = Lines()
    spec = LaunchSpec("verlflow.core.testing.probe", ["--mode", "raise"], nproc_per_node=1, nnodes=2, timeout_s=120)
    with pytest.raises(StageFailure) as info:
        SlurmBackend(SlurmSpec(), shared).launch(spec, on_line=lines)
    exc = info.value
    print(f"\n{str(exc)[:300]}")  # what the task's log shows (pytest -s)
    assert exc.kind is FailureKind.USER_ERROR and not exc.retryable
    assert exc.rank == 1 and exc.exitcode in (1, -6)  # -6: gloo may abort in the shutdown after the error
    assert "ValueError: boom-123" in str(exc) and "Traceback" in exc.traceback and "probe.py" in exc.traceback
    # The blamed node is the one whose torchrun wrote rank 1's error file.
    node, task = str(exc).split(" on node ")[1].split(" (")[0], int(str(exc).split(", task ")[1].split(")")[0])
    assert node in ("n1", "n2")
    job_dir = next((shared / "jobs").iterdir())
    assert list((job_dir / "logs" / f"task{task}").rglob("error.json"))
    assert not list((job_dir / "logs" / f"task{1 - task}").rglob("error.json"))
    assert f"[verlflow-node] task {task} on node {node}" in lines.text()


def _job_processes(rdzv_id):
    """torchrun agents (the id is on their command line) and workers (TORCHELASTIC_RUN_ID) of one job."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if rdzv_id in (p.info["cmdline"] or ()) or p.environ().get("TORCHELASTIC_RUN_ID") == rdzv_id:
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.mark.parametrize("how", ["cancel", "timeout"])
def test_cancel_and_timeout_leave_no_job(slurm_cluster, shared, how):
    """A 2-node job that hangs: the cancel Event (what a cancelled flow run sets) or our timeout scancels it;
    afterwards squeue lists nothing and no process of the job is left."""
    lines = Lines()
    cancel = threading.Event()
    rdzv_id = f"vftest-{how}-{os.getpid()}"
    spec = LaunchSpec("verlflow.core.testing.probe", ["--mode", "hang"], nproc_per_node=1, nnodes=2, rdzv_id=rdzv_id,
                      timeout_s=15 if how == "timeout" else 300)  # 15 s: the ranks import torch on a loaded machine
    box = {}

    def run():
        try:
            SlurmBackend(SlurmSpec(), shared).launch(spec, on_line=lines, cancel=cancel)
        except StageFailure as e:
            box["exc"] = e
        box["done"] = time.monotonic()

    th = threading.Thread(target=run)
    th.start()
    deadline = time.monotonic() + 120
    while lines.text().count("all_reduce=2") < 2 and time.monotonic() < deadline and th.is_alive():
        time.sleep(0.1)
    if how == "cancel" or th.is_alive():  # a timeout may come first on a loaded machine: then nothing hangs yet
        assert lines.text().count("all_reduce=2") == 2, lines.text()  # both ranks are up and hanging
    if how == "cancel":  # with a timeout, its kill may already be under way (seen in CI: 2 of 4 left)
        assert len(_job_processes(rdzv_id)) >= 4  # 2 agents + 2 workers
    job_id = next(line.split("Slurm job ")[1].split()[0] for _, line in lines if "[slurm] submitted" in line)
    t_cancel = time.monotonic()
    if how == "cancel":
        cancel.set()
    th.join(120)
    assert not th.is_alive()
    exc = box["exc"]
    assert exc.kind is (FailureKind.CANCELLED if how == "cancel" else FailureKind.TIMEOUT)
    TIMINGS[f"{how}_to_gone_s"] = round(box["done"] - t_cancel, 2)
    assert squeue_ids() == []  # nothing left in the queue
    info = job_info(job_id)
    assert info is None or info["JobState"] in ("CANCELLED", "COMPLETED", "FAILED")
    deadline = time.monotonic() + 15
    while _job_processes(rdzv_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _job_processes(rdzv_id)


def test_example_blueprint_renders_the_shipped_sbatch_script():
    """infra/slurm/qwen2.5-1.5b-2nodes.yaml loads, and infra/slurm/example-update.sbatch is what verlflow renders
    for its update stage (VERLFLOW_REGEN_EXAMPLES=1 rewrites the file)."""
    from verlflow.core.blueprint import load_blueprint

    infra = Path(__file__).resolve().parent.parent / "infra/slurm"
    bp = load_blueprint(infra / "qwen2.5-1.5b-2nodes.yaml")
    res = bp.resources
    assert (res.backend, res.nnodes, res.nproc_per_node, res.world_size) == ("slurm", 2, 8, 16)
    shared = Path(res.slurm.shared_dir)
    job_dir = shared / "jobs/verlflow-update-0123456789"
    spec = LaunchSpec("verlflow.core.stages.update", [str(shared / "scratch/verlflow-update-abcd1234/job.json")],
                      nproc_per_node=res.nproc_per_node, nnodes=res.nnodes, timeout_s=res.stage_timeout_s)
    text = render_sbatch(spec, res.slurm, job_dir, job_dir / "launch.json", job_name="verlflow-update",
                         cwd="/shared/verlflow")
    example = infra / "example-update.sbatch"
    if os.environ.get("VERLFLOW_REGEN_EXAMPLES"):
        example.write_text(text)
    assert example.read_text() == text
