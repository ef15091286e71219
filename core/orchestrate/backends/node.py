"""The per-node entry of a Slurm task or a Kubernetes pod: `python -m verlflow.core.orchestrate.backends.node launch.json ...`.

It turns the backend's launch file (a LaunchSpec without the node-specific parts) into this node's torchrun
command and runs it:
- node identity: task index from SLURM_PROCID or JOB_COMPLETION_INDEX; node name from SLURMD_NODENAME or
  VERLFLOW_NODE_NAME (a pod gets its Kubernetes node's name there), else the host name;
- the c10d store is hosted by the head node (--head-node NAME or --head-index I): explicit, so several
  "nodes" on one host (or an address that the host-name heuristic does not recognise) cannot race for it;
- torchrun's --log-dir is <log_base>/task<index>, so each node's error files stay apart (the launcher's
  diagnosis maps local ranks per node);
- a stage job file (args[job_arg]) is copied with its "scratch" set to a folder of this node only: ranks of a
  node share input caches and remote-store staging there, other nodes must not write into it;
- --emit-errors (pods: nothing on their disk outlives them) prints torchrun's error files after it exits, one
  line each, `[verlflow-error] <local_rank> <json>`, which the backend parses into diagnosis records.
Only the standard library and verlflow.core.orchestrate's launcher and diagnose are imported: this runs before every
stage on every node.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from verlflow.core.orchestrate.diagnose import RANK_PREFIX, error_files
from verlflow.core.orchestrate.launcher import LaunchSpec, build_command
from verlflow.core.wait import wait_until

ERROR_TAG = "[verlflow-error]"
NODE_TAG = "[verlflow-node]"
KILL_AFTER_S = 10.0  # SIGTERM -> SIGKILL of torchrun under --emit-errors (Kubernetes' default grace is 30 s)


def node_identity() -> tuple[int, str]:
    index = os.environ.get("SLURM_PROCID") or os.environ.get("JOB_COMPLETION_INDEX") or "0"
    name = os.environ.get("SLURMD_NODENAME") or os.environ.get("VERLFLOW_NODE_NAME") or socket.gethostname()
    return int(index), name


def torchrun_command(launch: dict, index: int, rdzv: str, is_host: bool, log_dir: str | None,
                     args: list[str]) -> list[str]:
    spec = LaunchSpec(module=launch["module"], args=args, nproc_per_node=launch["nproc_per_node"],
                      nnodes=launch["nnodes"], node_rank=index, rdzv_endpoint=rdzv, rdzv_id=launch["rdzv_id"],
                      log_dir=log_dir)
    cmd = build_command(spec)
    at = len(cmd) - 2 - len(args)  # before "-m <module> args..."
    return cmd[:at] + ["--rdzv-conf", f"is_host={int(is_host)}"] + cmd[at:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("launch_file")
    p.add_argument("--rdzv", required=True, help="host:port of the c10d store (on the head node)")
    p.add_argument("--head-node", help="name of the node that hosts the store")
    p.add_argument("--head-index", type=int, help="task index of the node that hosts the store")
    p.add_argument("--emit-errors", action="store_true", help="print torchrun's error files after it exits")
    a = p.parse_args(argv)
    launch = json.loads(Path(a.launch_file).read_text())
    index, node = node_identity()
    is_host = (node == a.head_node) if a.head_node is not None else index == (a.head_index or 0)

    args = list(launch["args"])
    if launch.get("job_arg") is not None:
        scratch = Path(launch["scratch_base"]) / f"node{index}"
        scratch.mkdir(parents=True, exist_ok=True)
        job = json.loads(Path(args[launch["job_arg"]]).read_text())
        job["scratch"] = str(scratch)
        (scratch / "job.json").write_text(json.dumps(job))
        args[launch["job_arg"]] = str(scratch / "job.json")
    log_dir = os.path.join(launch["log_base"], f"task{index}") if launch.get("log_base") else None
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    cmd = torchrun_command(launch, index, a.rdzv, is_host, log_dir, args)

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": RANK_PREFIX}
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    print(f"{NODE_TAG} task {index} on node {node} (host {socket.gethostname()}): torchrun "
          f"{launch['nproc_per_node']} proc(s), rendezvous {a.rdzv}{' (store host)' if is_host else ''}", flush=True)
    if not a.emit_errors:
        os.execvpe(cmd[0], cmd, env)  # torchrun becomes the task: the scheduler signals it directly

    proc = subprocess.Popen(cmd, env=env)
    term_at: list[float] = []

    def on_signal(sig, _frame):  # pod deletion: pass it on, then report what failed
        term_at.append(time.monotonic())
        proc.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    def exited() -> bool:
        # torchrun waiting in a C++ call (its exit barrier, a store read) runs no Python signal handler:
        # after a grace, kill it (its workers die with it, PR_SET_PDEATHSIG) well within the pod's grace.
        if proc.poll() is None and term_at and time.monotonic() - term_at[0] > KILL_AFTER_S:
            proc.kill()
        return proc.poll() is not None

    wait_until(exited, interval_s=0.1)
    code = proc.returncode
    if code != 0 and log_dir:
        for path in error_files(log_dir, launch["rdzv_id"]):
            try:
                with open(path) as f:
                    body = json.load(f)
            except (OSError, ValueError):
                continue
            local = os.path.basename(os.path.dirname(path))
            print(f"{ERROR_TAG} {local} {json.dumps(body, separators=(',', ':'))}", flush=True)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
