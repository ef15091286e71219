"""backend: slurm — a stage is one sbatch job; one srun task per node runs torchrun with c10d rendezvous.

The job script (render_sbatch) asks for nnodes nodes and one task per node, takes the rendezvous host from the
head node's NodeAddr (node names need not resolve) and a port unique per job (base + job id mod span), and
runs `srun --label --kill-on-bad-exit=1 python -m verlflow.core.orchestrate.backends.node` on every node. The backend submits it,
streams the job's output file line by line while it runs (labels -> per-node torchrun output and rank lines),
follows its state with `scontrol show job` (no accounting needed), cancels with `scancel` on cancel or on
resources.stage_timeout_s (counted from the job's start: queueing is not the stage's fault), and explains a
failure with the diagnosis run per node over torchrun's error files, written to a shared folder.

Everything a job needs lives under <shared_dir>/jobs/<name>/ (script, launch file, output, error files); every
node must see shared_dir (and the artifact store, for file:// stores). The folder is removed after the job.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from verlflow.core.errors import VerlflowError
from verlflow.core.orchestrate.backends.common import JobOutput, diagnose_job
from verlflow.core.orchestrate.diagnose import read_error_files
from verlflow.core.orchestrate.launcher import FailureKind, LaunchResult, LaunchSpec, StageFailure
from verlflow.core.wait import wait_until

_LABEL = re.compile(r"^\s*(\d+): ?(.*)$")
_FIELD = re.compile(r"(\w+(?:/\w+)?)=(\S*)")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
            "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED"}
_STATE_KIND = {"TIMEOUT": FailureKind.TIMEOUT, "DEADLINE": FailureKind.TIMEOUT, "NODE_FAIL": FailureKind.KILLED,
               "PREEMPTED": FailureKind.KILLED, "BOOT_FAIL": FailureKind.KILLED, "REVOKED": FailureKind.KILLED,
               "OUT_OF_MEMORY": FailureKind.OOM, "CANCELLED": FailureKind.CANCELLED}  # scancel by someone else


class SlurmError(VerlflowError):
    """sbatch/scontrol could not be run or refused the job (not a failure of the stage itself)."""


@dataclass
class SlurmLaunchResult(LaunchResult):
    job_id: str = ""
    queued_s: float = 0.0  # sbatch returned -> the job was seen RUNNING
    run_s: float = 0.0  # seen RUNNING -> seen finished
    nodes: str = ""


def time_limit(cfg, timeout_s: float | None) -> str | None:
    if cfg.time_limit:
        return cfg.time_limit
    if timeout_s is None:
        return None
    return str(math.ceil(timeout_s / 60) + 1)  # minutes; our own timeout fires first and explains itself


def render_sbatch(spec: LaunchSpec, cfg, job_dir: Path, launch_file: Path, *, job_name: str,
                  python: str | None = None, cwd: str | None = None) -> str:
    """The batch script of one stage job: #SBATCH lines from the blueprint, head-node rendezvous, one srun."""
    py = cfg.python or python or sys.executable
    n = spec.nnodes
    opts = [f"--job-name={job_name}", f"--nodes={n}", "--ntasks-per-node=1", f"--output={job_dir}/slurm-%j.out",
            f"--chdir={cwd or spec.cwd or os.getcwd()}"]
    if (limit := time_limit(cfg, spec.timeout_s)) is not None:
        opts.append(f"--time={limit}")
    if cfg.partition:
        opts.append(f"--partition={cfg.partition}")
    if cfg.account:
        opts.append(f"--account={cfg.account}")
    if cfg.gpus_per_node:
        opts.append(f"--gpus-per-node={cfg.gpus_per_node}")
    if cfg.cpus_per_task:
        opts.append(f"--cpus-per-task={cfg.cpus_per_task}")
    for extra in cfg.extra_sbatch:
        extra = extra.strip().removeprefix("#SBATCH").strip()
        if "\n" in extra or not extra.startswith("-"):
            raise ValueError(f"resources.slurm.extra_sbatch: '{extra}' is not one sbatch option (like --qos=high)")
        opts.append(extra)
    node_cmd = [py, "-m", "verlflow.core.orchestrate.backends.node", str(launch_file)]
    # Since Slurm 22.05 srun no longer inherits --cpus-per-task from the batch job: say it again for the step.
    step = (f" --cpus-per-task={cfg.cpus_per_task}" if cfg.cpus_per_task else "") + \
        (f" --gpus-per-node={cfg.gpus_per_node}" if cfg.gpus_per_node else "")
    lines = ["#!/bin/bash", f"# verlflow stage job: {spec.module} on {n} node(s) x {spec.nproc_per_node} proc(s)"]
    lines += [f"#SBATCH {o}" for o in opts]
    lines += ["set -eo pipefail", *cfg.setup,
              'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              # Node names need not resolve: the address Slurm itself uses for the head node.
              "HEAD_ADDR=$(scontrol show node \"$HEAD_NODE\" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p' | head -n 1)",
              f"RDZV_PORT=$(( {cfg.rdzv_port_base} + SLURM_JOB_ID % {cfg.rdzv_port_span} ))",
              'echo "[verlflow-job] job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: rendezvous $HEAD_ADDR:$RDZV_PORT '
              '(head node $HEAD_NODE)"',
              f"srun --label --kill-on-bad-exit=1 --nodes={n} --ntasks={n} --ntasks-per-node=1{step} \\",
              f"    {shlex.join(node_cmd)} --rdzv \"$HEAD_ADDR:$RDZV_PORT\" --head-node \"$HEAD_NODE\"", ""]
    return "\n".join(lines)


def _submit_env(spec: LaunchSpec) -> dict:
    """The submitter's environment (sbatch --export=ALL carries it to the job) without the variables of a Slurm
    job we might be running inside, plus the stage's own variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    env.update(spec.env)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    return env


def _run(cmd: list[str], timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(f"{cmd[0]} not found: backend slurm needs the Slurm client commands on this machine "
                         "(Debian: apt-get install slurm-client; and SLURM_CONF if the config is not in /etc)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{shlex.join(cmd)} did not answer in {timeout:g} s (is slurmctld up?)") from None
    if check and p.returncode != 0:
        raise SlurmError(f"{shlex.join(cmd)} failed ({p.returncode}): {(p.stderr or p.stdout).strip()}")
    return p


def job_info(job_id: str) -> dict[str, str] | None:
    """`scontrol show job -o` as a dict (JobState, ExitCode, NodeList, ...); None once Slurm forgot the job."""
    p = _run(["scontrol", "show", "job", "-o", job_id], check=False)
    if p.returncode != 0:
        if "Invalid job id" in p.stderr:
            return None
        raise SlurmError(f"scontrol show job {job_id}: {p.stderr.strip()}")
    return dict(_FIELD.findall(p.stdout))


def squeue_ids(job_ids: list[str] | None = None) -> list[str]:
    cmd = ["squeue", "-h", "-o", "%i"] + (["-j", ",".join(job_ids)] if job_ids else [])
    p = _run(cmd, check=False)
    return p.stdout.split() if p.returncode == 0 else []


class _Tail:
    """New complete lines of a growing file."""

    def __init__(self, path: Path):
        self.path, self.pos, self.rest = path, 0, b""

    def read(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self.pos += len(data)
        parts = (self.rest + data).split(b"\n")
        self.rest = parts.pop()
        if final and self.rest:
            parts.append(self.rest)
            self.rest = b""
        return [p.decode(errors="replace").rstrip("\r") for p in parts]


class SlurmBackend:
    def __init__(self, cfg, shared_dir: Path, poll_s: float = 0.25):
        self.cfg, self.shared_dir, self.poll_s = cfg, Path(shared_dir), poll_s

    def launch(self, spec: LaunchSpec, on_line: Callable[[str], None] = print,
               cancel: threading.Event | None = None, grace_s: float = 5.0) -> SlurmLaunchResult:
        name = f"verlflow-{spec.module.rsplit('.', 1)[-1].lstrip('_')}"
        job_dir = self.shared_dir / "jobs" / f"{name}-{uuid.uuid4().hex[:10]}"
        (job_dir / "logs").mkdir(parents=True)
        rdzv_id = spec.rdzv_id or uuid.uuid4().hex[:12]
        spec = replace(spec, rdzv_id=rdzv_id)
        job_arg = spec.job_arg  # a stage's job file: each node gets a copy with its own scratch folder
        launch_file = job_dir / "launch.json"
        launch_file.write_text(json.dumps({
            "module": spec.module, "args": spec.args, "nproc_per_node": spec.nproc_per_node, "nnodes": spec.nnodes,
            "rdzv_id": rdzv_id, "job_arg": job_arg, "scratch_base": str(job_dir / "scratch"),
            "log_base": str(job_dir / "logs")}))
        script = job_dir / "job.sbatch"
        script.write_text(render_sbatch(spec, self.cfg, job_dir, launch_file, job_name=name))
        try:
            return self._follow(spec, job_dir, script, rdzv_id, on_line, cancel, grace_s)
        finally:
            if not os.environ.get("VERLFLOW_KEEP_SLURM_JOB_DIR"):
                shutil.rmtree(job_dir, ignore_errors=True)

    def _follow(self, spec, job_dir, script, rdzv_id, on_line, cancel, grace_s) -> SlurmLaunchResult:
        t_submit = time.monotonic()
        p = _run(["sbatch", "--parsable", str(script)], timeout=60)
        job_id = p.stdout.strip().split(";")[0]
        submitted = time.monotonic()
        where = f"Slurm job {job_id}"
        on_line(f"[slurm] submitted {where} ({spec.nnodes} node(s) x {spec.nproc_per_node}) in "
                f"{submitted - t_submit:.2f} s")
        out = JobOutput(on_line)
        tail, own_tail = _Tail(job_dir / f"slurm-{job_id}.out"), []
        state, info, started, stopped, cancelled_at, last_poll, misses = "PENDING", {}, None, None, None, 0.0, 0

        def pump(final=False):
            for line in tail.read(final):
                if m := _LABEL.match(line):
                    out.feed(int(m[1]), m[2])
                else:
                    own_tail.append(line)
                    del own_tail[:-200]
                    on_line(f"[slurm] {line}")

        try:
            while True:
                pump()
                now = time.monotonic()
                if now - last_poll >= self.poll_s:
                    last_poll = now
                    try:
                        info = job_info(job_id) or {"JobState": "COMPLETED" if started else "UNKNOWN",
                                                    "ExitCode": "?"}
                        misses = 0
                    except SlurmError:  # slurmctld restarting or busy: the job goes on; give it a minute
                        misses += 1
                        if misses * self.poll_s > 60:
                            raise
                        continue
                    new = info.get("JobState", "UNKNOWN")
                    if new != state:
                        if new == "RUNNING" and started is None:
                            started = now
                            on_line(f"[slurm] {where} RUNNING on {info.get('NodeList', '?')} "
                                    f"({started - submitted:.2f} s after submit)")
                        state = new
                    if state in TERMINAL or state == "UNKNOWN":
                        break
                if stopped is None and cancel is not None and cancel.is_set():
                    stopped = FailureKind.CANCELLED
                elif (stopped is None and spec.timeout_s is not None and started is not None
                      and now - started > spec.timeout_s):
                    stopped = FailureKind.TIMEOUT
                if stopped is not None and cancelled_at is None:
                    on_line(f"[slurm] scancel {job_id} ({stopped.value})")
                    _run(["scancel", job_id], check=False)
                    cancelled_at = now
                elif cancelled_at is not None and now - cancelled_at > max(grace_s, 5.0) * 6:
                    _run(["scancel", "--signal=KILL", "--full", job_id], check=False)
                    cancelled_at = now
                time.sleep(0.05)
        except BaseException:
            if state not in TERMINAL:  # our own failure (or KeyboardInterrupt): do not leave the job behind
                _run(["scancel", job_id], check=False)
            raise
        ended = time.monotonic()
        if stopped is not None:  # wait until squeue no longer lists it, so the caller sees the nodes free
            wait_until(lambda: job_id not in squeue_ids([job_id]), interval_s=0.2, timeout_s=60)

        def settled() -> bool:  # the output file is written by slurmstepd; give its last lines a moment
            before = tail.pos
            pump()
            return tail.pos == before

        wait_until(settled, interval_s=0.05, timeout_s=1.0)
        pump(final=True)
        run_s = ended - (started or ended)
        queued = (started or ended) - submitted
        on_line(f"[slurm] {where} {state} (exit {info.get('ExitCode', '?')}): queued {queued:.2f} s, "
                f"ran {run_s:.2f} s")
        if stopped is FailureKind.TIMEOUT:
            raise StageFailure(stopped, f"{spec.module} ran past its timeout of {spec.timeout_s:g} s; {where} "
                               "cancelled")
        if stopped is FailureKind.CANCELLED:
            raise StageFailure(stopped, f"{spec.module} was cancelled; {where} cancelled (scancel)")
        code = _exit_code(info.get("ExitCode", ""))
        if state == "COMPLETED" and code == 0:
            return SlurmLaunchResult(0, ended - t_submit, ["sbatch", str(script)], job_id=job_id, queued_s=queued,
                                     run_s=run_s, nodes=info.get("NodeList", ""))
        if state in _STATE_KIND:
            kind = _STATE_KIND[state]
            raise StageFailure(kind, f"{where} ended {state} on {info.get('NodeList', '?')} (reason "
                               f"{info.get('Reason', '?')})", exitcode=code,
                               traceback="job output:\n" + "\n".join(own_tail[-40:]))
        logs = job_dir / "logs"
        raise diagnose_job(spec, out, lambda t: read_error_files(str(logs / f"task{t.index}"), rdzv_id), code, where,
                           own_tail)


def _exit_code(text: str) -> int:
    """Slurm's ExitCode=<code>:<signal>: a shell-like code (128 + signal when killed by one)."""
    try:
        code, sig = (int(x) for x in text.split(":"))
    except ValueError:
        return 1
    return 128 + sig if sig else code
