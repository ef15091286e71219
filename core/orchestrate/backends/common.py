"""What the Slurm and Kubernetes backends share: per-node output parsing and the per-node failure diagnosis.

A multi-node job's output arrives labelled by task (one task = one node's torchrun): srun --label prefixes
"<task>: ", a pod's log is one task. Within a task the lines are torchrun's own or a worker's "[rankN] " ones,
as under the local launcher, so the diagnosis (verlflow.core.orchestrate.diagnose: the ranks' error records +
torchrun's failure summary) runs per node, and the node whose failure is the root cause is blamed.
"""

from __future__ import annotations

import json
import re
import signal
from collections import defaultdict, deque
from dataclasses import dataclass, field, replace
from typing import Callable

from verlflow.core.orchestrate.backends.node import ERROR_TAG, NODE_TAG
from verlflow.core.orchestrate.diagnose import (COLLATERAL, RANK_LINE, ErrorRecord, FailureKind, StageFailure,
                                                diagnose)
from verlflow.core.orchestrate.launcher import LaunchSpec

_NODE_LINE = re.compile(re.escape(NODE_TAG) + r" task (\d+) on node (\S+)")


@dataclass
class TaskOutput:
    index: int
    node: str | None = None
    own: deque = field(default_factory=lambda: deque(maxlen=3000))  # torchrun's own lines: its failure summary
    errors: list[ErrorRecord] = field(default_factory=list)  # the error files printed by --emit-errors


class JobOutput:
    """Routes each task's lines to on_line ("[rankN] ...", "[torchrun@node] ...") and keeps what diagnosis needs."""

    def __init__(self, on_line):
        self.on_line = on_line
        self.tasks: dict[int, TaskOutput] = {}
        self.rank_tails: dict[int, deque] = defaultdict(lambda: deque(maxlen=20))

    def task(self, index: int) -> TaskOutput:
        return self.tasks.setdefault(index, TaskOutput(index))

    def feed(self, index: int, line: str) -> None:
        t = self.task(index)
        if m := RANK_LINE.match(line):
            text = line[m.end():]
            self.rank_tails[int(m[1])].append(text)
            self.on_line(f"[rank{m[1]}] {text}")
            return
        if line.startswith(ERROR_TAG):
            try:
                local, body = line[len(ERROR_TAG):].strip().split(" ", 1)
                t.errors.append(ErrorRecord.from_error_file(int(local), json.loads(body), order=len(t.errors)))
            except ValueError:
                pass
            return
        if m := _NODE_LINE.match(line):
            t.node = m[2]
            self.on_line(line)
            return
        t.own.append(line)
        self.on_line(f"[torchrun@{t.node or f'task{index}'}] {line}")


def _rank(f: StageFailure) -> float:
    """Lower is a better root cause: a rank's own error, a signal other than the SIGTERM torchrun or the
    scheduler sends to survivors, a collective error (a peer died), then nothing to blame."""
    if f.kind in (FailureKind.USER_ERROR, FailureKind.OOM, FailureKind.NONFINITE) and f.rank is not None:
        return 0 if not COLLATERAL.search(str(f)) else 2
    if f.kind is FailureKind.KILLED:
        return 1 if f.signal != signal.Signals.SIGTERM.name else 3
    if f.kind is FailureKind.COLLECTIVE_TIMEOUT:
        return 2
    return 4


def diagnose_job(spec: LaunchSpec, out: JobOutput, records_of: Callable[[TaskOutput], list[ErrorRecord]],
                 returncode: int, where: str, tail: list[str]) -> StageFailure:
    """The root-cause StageFailure over all nodes; `records_of(task)` is that node's error records, `where` names the
    job ("Slurm job 12")."""
    best = None
    for index in sorted(out.tasks):
        t = out.tasks[index]
        records = records_of(t)
        f = diagnose(replace(spec, node_rank=index), returncode, records, "\n".join(t.own), out.rank_tails)
        if f.kind is FailureKind.UNKNOWN and f.rank is None and not records and not _failed_summary(t):
            continue  # this node saw nothing wrong
        if best is None or _rank(f) < _rank(best[1]):
            best = (t, f)
    if best is None:
        text = "\n".join(tail[-40:])
        return StageFailure(FailureKind.UNKNOWN, f"{where} failed (exit code {returncode}) before any rank "
                            "failed", exitcode=returncode, traceback=f"job output:\n{text}")
    t, f = best
    node = t.node or f"task {t.index}"
    return StageFailure(f.kind, f"{f.summary} on node {node} ({where}, task {t.index})", rank=f.rank,
                        exitcode=f.exitcode, signal=f.signal, traceback=f.traceback)


def _failed_summary(t: TaskOutput) -> bool:
    return any("FAILED" in line or "Error" in line or "error" in line for line in t.own)
