"""Run a stage module under torchrun, stream its rank-prefixed output, and explain how it failed.

Facts from torch 2.13's source this relies on (torch/distributed/...):
- elastic/multiprocessing/subprocess_handler: every worker is Popen'ed with start_new_session=True, so
  killpg(torchrun) misses the ranks; we collect the whole tree with psutil (by parent pid) instead.
- --tee 3 makes torchrun tail each worker's stdout/stderr files (every 0.1 s) and print each line after
  a header from TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, where ${rank} is the global rank.
How a failed job is explained (its error files, torchrun's summary) is verlflow.core.orchestrate.diagnose; how a
rank starts and ends (its guard, its exit) is verlflow.core.stages.runtime.entry.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass, field, replace
from typing import Callable

import psutil

from verlflow.core.guard import STACK_SIGNAL, die_with_parent
from verlflow.core.wait import wait_until
from verlflow.core.orchestrate.diagnose import (RANK_LINE, RANK_PREFIX, FailureKind, StageFailure, diagnose,
                                                read_error_files)

__all__ = ["FailureKind", "LaunchResult", "LaunchSpec", "StageFailure", "build_command", "launch"]

_STACK_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*most recent call first")


@dataclass
class LaunchSpec:
    module: str
    args: list[str]
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0  # c10d hands out group ranks in join order: only a hint (and static backends)
    rdzv_endpoint: str | None = None  # None: one node, the c10d store binds a free port itself
    rdzv_id: str | None = None  # None: a fresh id (multi-node jobs must pass the same id everywhere)
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float | None = None
    cwd: str | None = None
    log_dir: str | None = None  # None: a temporary folder, removed after the error files are read
    job_arg: int | None = None  # args[job_arg] is a job file each node of a Slurm/Kubernetes job gets its own copy of


@dataclass
class LaunchResult:
    returncode: int
    duration_s: float
    command: list[str]


def build_command(spec: LaunchSpec) -> list[str]:
    if spec.rdzv_endpoint is None and spec.nnodes > 1:
        raise ValueError("a multi-node launch needs rdzv_endpoint (host:port of the rendezvous node)")
    # Port 0 is what torchrun --standalone uses: the store picks a free port, no bind-then-close race.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(spec.nnodes),
           "--nproc-per-node", str(spec.nproc_per_node), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", spec.rdzv_endpoint or "127.0.0.1:0",
           "--rdzv-id", spec.rdzv_id or uuid.uuid4().hex[:12],
           "--max-restarts", "0",  # retries are the task's decision, made with the classified failure
           "--tee", "3"]  # worker output goes through torchrun's prefixing tailer (see module doc)
    if spec.nnodes > 1:
        cmd += ["--node-rank", str(spec.node_rank)]
    if spec.log_dir:
        cmd += ["--log-dir", spec.log_dir]
    return cmd + ["-m", spec.module, *spec.args]


class _Tree:
    """Every process below torchrun seen so far: remembered while running, because once torchrun dies
    its orphans are no longer found through it."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.known: dict[int, psutil.Process] = {pid: self.root}

    def refresh(self) -> None:
        try:
            self.known.update((p.pid, p) for p in self.root.children(recursive=True))
        except psutil.Error:
            pass

    def alive(self) -> list[psutil.Process]:
        def running(p):
            try:  # psutil.Process checks create time, so a reused pid is not ours
                return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                return False
        return [p for p in self.known.values() if running(p)]

    def kill(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL what is alive after grace_s; grace_s=0: SIGKILL at once."""
        self.refresh()  # collect everything first: signalled parents stop leading us to children
        for sig in (signal.SIGTERM, signal.SIGKILL) if grace_s > 0 else (signal.SIGKILL,):
            procs = self.alive()
            for p in procs:
                try:
                    p.send_signal(sig)
                except psutil.Error:
                    pass
            if wait_until(lambda: not self.alive(), interval_s=0.05, timeout_s=grace_s):
                return


def launch(spec: LaunchSpec, on_line: Callable[[str], None] = print,
           cancel: threading.Event | None = None, grace_s: float = 5.0,
           expire: threading.Event | None = None) -> LaunchResult:
    """Run the job to the end; on_line gets each output line (in this thread) as it arrives.
    Raises StageFailure on a failed job, our timeout or a cancel, after the whole tree is gone. `expire` is a
    caller's own timeout (a warm pool's stage): stopped like spec.timeout_s, as TIMEOUT.

    A job stopped for a timeout first prints every rank's Python stack (STACK_SIGNAL); the StageFailure carries
    them, so a hang says where each rank waited."""
    tmp_log_dir = None if spec.log_dir else tempfile.mkdtemp(prefix="verlflow-torchrun-")
    spec = replace(spec, log_dir=spec.log_dir or tmp_log_dir, rdzv_id=spec.rdzv_id or uuid.uuid4().hex[:12])
    cmd = build_command(spec)
    start = time.monotonic()
    try:
        returncode, stopped, own_lines, rank_tails, stacks = _run(spec, cmd, on_line, cancel, grace_s, expire)
        duration = time.monotonic() - start
        if stopped is FailureKind.TIMEOUT:
            limit = f"its timeout of {spec.timeout_s:g} s" if spec.timeout_s is not None else "its timeout"
            raise StageFailure(stopped, f"{spec.module} ran past {limit}; killed", traceback=stacks)
        if stopped is FailureKind.CANCELLED:
            raise StageFailure(stopped, f"{spec.module} was cancelled after {duration:.1f} s; killed")
        if returncode != 0:
            records = read_error_files(spec.log_dir, spec.rdzv_id)
            raise diagnose(spec, returncode, records, "\n".join(own_lines), rank_tails)
        return LaunchResult(returncode, duration, cmd)
    finally:
        if tmp_log_dir:
            shutil.rmtree(tmp_log_dir, ignore_errors=True)


def _run(spec: LaunchSpec, cmd: list[str], on_line, cancel, grace_s, expire=None):
    env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": RANK_PREFIX}
    env.pop("TORCHELASTIC_ERROR_FILE", None)  # set when we run under torchrun ourselves: not torchrun's
    launcher_pid = os.getpid()

    # PDEATHSIG fires when the forking *thread* ends; launch() blocks that thread until torchrun is gone.
    def die_with_launcher():  # runs in the child before exec; the parent check covers our dying first
        die_with_parent(lambda ppid: ppid == launcher_pid)

    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, cwd=spec.cwd, start_new_session=True, preexec_fn=die_with_launcher)
    tree = _Tree(proc.pid)
    lines: queue.Queue = queue.Queue()

    def pump():  # a thread, so a silent job cannot block the timeout and cancel checks
        for raw in iter(proc.stdout.readline, b""):
            lines.put(raw.decode(errors="replace").rstrip("\r\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    own_lines: deque[str] = deque(maxlen=3000)  # torchrun's own output: holds its failure summary
    rank_tails: dict[int, deque[str]] = defaultdict(lambda: deque(maxlen=20))
    stopped, last_refresh, exited_at = None, 0.0, None
    dump = None  # after a timeout: the ranks' stacks as they arrive, until every rank has printed one
    killing = False
    try:
        while True:
            try:
                line = lines.get(timeout=0.1)
                if line is None:
                    break
                if m := RANK_LINE.match(line):
                    rank_tails[int(m[1])].append(line[m.end():])
                    if not killing:
                        on_line(f"[rank{m[1]}] {line[m.end():]}")
                    if dump is not None:
                        dump.add(int(m[1]), line[m.end():])
                else:
                    own_lines.append(line)
                    if not killing:
                        on_line(f"[torchrun] {line}")
            except queue.Empty:
                pass
            now = time.monotonic()
            if now - last_refresh > 0.5:
                tree.refresh()
                last_refresh = now
            if stopped is None and cancel is not None and cancel.is_set():
                stopped = FailureKind.CANCELLED
            elif stopped is None and (spec.timeout_s is not None and now - start > spec.timeout_s
                                      or expire is not None and expire.is_set()):
                stopped = FailureKind.TIMEOUT
                dump = _StackDump(proc.pid, tree)
            if stopped is not None and proc.poll() is None and (dump is None or dump.complete()):
                # What the processes print as they die (torchrun's SignalException, a rank's half-read file)
                # is our kill, not news: kept for the diagnosis, not shown.
                if not killing:
                    on_line(f"[verlflow] {stopped.value}: stopping the job's processes")
                    killing = True
                # A cancel keeps nothing of the job: SIGKILL at once (torchrun's own SIGTERM shutdown took ~2 s
                # on a loaded machine).
                tree.kill(0 if stopped is FailureKind.CANCELLED else grace_s)
            if proc.poll() is not None:  # an orphan may hold the pipe open: do not wait for EOF forever
                exited_at = exited_at or now
                if now - exited_at > 2.0:
                    break
    except BaseException as e:
        if not isinstance(e, Exception):  # Prefect's SIGTERM on a Cancel, Ctrl-C: the run is being stopped
            tree.kill(0)
        raise
    finally:
        tree.kill(grace_s)  # whatever happened (success included), leave no process of the tree
        proc.wait()
    return proc.returncode, stopped, own_lines, rank_tails, dump.text() if dump else ""


class _StackDump:
    """Asks every worker (torchrun's children) for its threads' stacks and collects them from its output, for
    a few seconds at most: a rank stuck in C code still answers (faulthandler writes from the signal handler)."""

    def __init__(self, torchrun_pid: int, tree: _Tree, wait_s: float = 5.0):
        self.lines: dict[int, list[str]] = defaultdict(list)
        self.deadline = time.monotonic() + wait_s
        self.last_line = time.monotonic()
        self.workers = 0
        tree.refresh()
        for p in tree.alive():  # only the ranks: torchrun itself would die of the signal
            try:
                if p.ppid() == torchrun_pid:
                    p.send_signal(STACK_SIGNAL)
                    self.workers += 1
            except psutil.Error:
                pass

    def add(self, rank: int, text: str) -> None:
        if _STACK_HEADER.match(text) or self.lines[rank]:
            self.lines[rank].append(text)
            self.last_line = time.monotonic()

    def complete(self) -> bool:
        now = time.monotonic()
        answered = len(self.lines) >= self.workers and now - self.last_line > 0.5
        return answered or now > self.deadline

    def text(self) -> str:
        if not self.lines:
            return "no rank printed its stack (stopped before its stack handler was installed, or stuck in the kernel)"
        return "\n".join(f"rank {r} stacks when stopped:\n" + "\n".join(self.lines[r]) for r in sorted(self.lines))
