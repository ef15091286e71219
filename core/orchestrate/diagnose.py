"""How a torchrun job failed: its ranks' error records, torchrun's failure summary and the ranks' last lines, turned
into one StageFailure that names the rank to blame, its kind and whether another attempt can help.

Every backend feeds it what it has: the local launcher and Slurm read torchrun's error files from a folder
(`read_error_files`), a Kubernetes pod prints them into its log (`ErrorRecord.from_error_file`, per line). Only the
standard library is imported: the per-node entry (backends/node.py) runs before every stage on every node.

Facts from torch 2.13's source this relies on (torch/distributed/...):
- elastic/multiprocessing/api.py DefaultLogsSpecs: error files are
  <log_dir>/<rdzv_id>_<random>/attempt_<n>/<local_rank>/error.json, written by @record
  ({"message": {"message": "Type: text", "extraInfo": {"py_callstack", "timestamp" (whole seconds)}}}).
- --tee 3 with TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE prints each worker line after a header where ${rank} is the
  global rank (RANK_PREFIX below, parsed back by RANK_LINE).
"""

from __future__ import annotations

import enum
import functools
import glob
import json
import os
import re
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from verlflow.core.errors import VerlflowError

if TYPE_CHECKING:
    from verlflow.core.orchestrate.launcher import LaunchSpec

RANK_PREFIX = "[rank${rank}] "  # torchrun's header for worker lines (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE)
RANK_LINE = re.compile(r"\[rank(\d+)\] (?:\[rank\1\]:? ?)?")  # torch's excepthook adds "[rankN]:" too
COLLATERAL = re.compile(r"Connection (closed|reset) by peer", re.I)  # a peer died first
# One entry of torchrun's ChildFailedError summary (global rank, local rank, exit code).
_SUMMARY = re.compile(r"rank\s*:\s*(\d+) \(local_rank: (\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
_NONFINITE = re.compile(r"\bNonFiniteError\b")  # verlflow.core.errors.NonFiniteError, by its type name
# torch's OutOfMemoryError, or verlflow.core.checks.memplan.DeviceOutOfMemory (stage, peak, card, the setting)
_OOM = re.compile(r"OutOfMemoryError|out of memory", re.I)
# A bare "ProcessGroupGloo" is not enough: "ProcessGroupGloo does not support X" is a user error.
_COLLECTIVE = re.compile(
    r"DistBackendError|DistStoreError|DistNetworkError|Watchdog caught collective operation timeout|"
    r"(gloo|nccl|ProcessGroup\w*).*(Timed out|timeout)|Connection (closed|reset) by peer", re.I)
# verlflow.core.store.artifacts's StoreError once its bounded retries are spent on an endpoint that does not answer.
_STORE_DOWN = re.compile(r"StoreError: .*The S3 endpoint cannot be reached")
# A verlflow error raised in a worker already names the field or file and the fix: its traceback (kept in
# StageFailure.traceback, and already in the job's streamed output) would only bury that message.
_USER_FACING = re.compile(r"\b(VerlflowError|BlueprintError|InputError|StoreError|UnsafeKeyError|ChecksumError|"
                          r"NonFiniteError|DeviceOutOfMemory): ")


class FailureKind(enum.Enum):
    OOM = "oom"
    COLLECTIVE_TIMEOUT = "collective_timeout"  # also other gloo/NCCL backend errors
    USER_ERROR = "user_error"
    NONFINITE = "nonfinite"
    KILLED = "killed"  # a rank died by a signal and left no error file (OOM killer, preemption)
    TIMEOUT = "timeout"  # our own timeout_s
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"  # torchrun failed without a rank to blame (rendezvous, port, crash)
    STORE_UNREACHABLE = "store_unreachable"  # the artifact store's endpoint did not answer (retries spent)


# Worth retrying: the cause may be outside the stage (a flaky link, a killed node, a hang, a crash
# of torchrun). Not worth it: the same inputs and code give the same OOM, exception or NaN; a cancel
# is a decision.
_RETRYABLE = {FailureKind.COLLECTIVE_TIMEOUT, FailureKind.KILLED, FailureKind.TIMEOUT, FailureKind.UNKNOWN,
              FailureKind.STORE_UNREACHABLE}


class StageFailure(VerlflowError):
    """A torchrun job failed; `kind` and `retryable` tell the task whether another attempt can help."""

    def __init__(self, kind: FailureKind, summary: str, *, rank: int | None = None,
                 exitcode: int | None = None, signal: str | None = None, traceback: str = ""):
        self.kind, self.rank, self.exitcode, self.signal, self.traceback = kind, rank, exitcode, signal, traceback
        self.summary = summary
        retry = "retryable" if self.retryable else "not retryable"
        shown = "" if _USER_FACING.search(summary) else traceback
        super().__init__(f"{summary} [{kind.name}, {retry}]" + (f"\n{shown.rstrip()}" if shown else ""))

    def __reduce__(self):  # results and states get pickled (Prefect): rebuild with every field
        kw = dict(rank=self.rank, exitcode=self.exitcode, signal=self.signal, traceback=self.traceback)
        return functools.partial(StageFailure, **kw), (self.kind, self.summary)

    @property
    def retryable(self) -> bool:
        return self.kind in _RETRYABLE


@dataclass(frozen=True)
class ErrorRecord:
    """One rank's error as @record wrote it (torchrun's error file), on one node."""

    local_rank: int
    message: str
    traceback: str = ""
    timestamp: int = 0  # whole seconds (torch's resolution)
    order: int = 0  # ties of the same second: the file's mtime, or the order a pod printed them in

    @classmethod
    def from_error_file(cls, local_rank: int, body: dict, order: int = 0) -> "ErrorRecord":
        """From an error file's JSON body; raises ValueError (KeyError, TypeError included) if it is not one."""
        try:
            msg = body["message"]
            if isinstance(msg, str):  # torch's "new message format": a bare string
                msg = {"message": msg, "extraInfo": {}}
            extra = msg.get("extraInfo", {})
            return cls(int(local_rank), msg["message"], extra.get("py_callstack", ""),
                       int(extra.get("timestamp", 0)), order)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a torchrun error file: {e}") from None


def error_files(log_dir: str, rdzv_id: str) -> list[str]:
    """The error files torchrun's workers of job `rdzv_id` left under its --log-dir (sorted)."""
    return sorted(glob.glob(os.path.join(log_dir, f"{rdzv_id}_*", "attempt_*", "*", "error.json")))


def read_error_files(log_dir: str, rdzv_id: str) -> list[ErrorRecord]:
    records = []
    for path in error_files(log_dir, rdzv_id):
        try:
            with open(path) as f:
                body = json.load(f)
            local = int(os.path.basename(os.path.dirname(path)))
            records.append(ErrorRecord.from_error_file(local, body, os.stat(path).st_mtime_ns))
        except (OSError, ValueError):
            continue
    return records


def classify(message: str) -> FailureKind:
    for pattern, kind in ((_NONFINITE, FailureKind.NONFINITE), (_OOM, FailureKind.OOM),
                          (_COLLECTIVE, FailureKind.COLLECTIVE_TIMEOUT), (_STORE_DOWN, FailureKind.STORE_UNREACHABLE)):
        if pattern.search(message):
            return kind
    return FailureKind.USER_ERROR


def diagnose(spec: LaunchSpec, returncode: int, records: Sequence[ErrorRecord], torchrun_text: str,
             tails: Mapping[int, Sequence[str]]) -> StageFailure:
    """The StageFailure of one node's failed torchrun (`spec` with that node's node_rank): `records` its ranks' error
    records, `torchrun_text` its own output (with its failure summary), `tails` the last lines of each global rank."""
    exits = {int(local): (int(rank), int(code)) for rank, local, code in _SUMMARY.findall(torchrun_text)}
    errors = sorted(records, key=lambda e: (e.timestamp, e.order, e.local_rank))

    def rank_of(local):  # the summary knows global ranks; without it assume equal-sized nodes
        return exits.get(local, (spec.node_rank * spec.nproc_per_node + local, None))[0]

    def from_error(e: ErrorRecord):
        code = exits.get(e.local_rank, (None, None))[1]
        rank, kind = rank_of(e.local_rank), classify(e.message)
        return StageFailure(kind, f"rank {rank} failed (exit code {'?' if code is None else code}): {e.message}",
                            rank=rank, exitcode=code, traceback=e.traceback)

    def from_exit(local):
        rank, code = exits[local]
        tb = "last output:\n" + ("\n".join(tails.get(rank, ())) or "(none)")
        if code >= 0:
            return StageFailure(FailureKind.USER_ERROR, f"rank {rank} exited with code {code} and no error "
                                "file (decorate its main with @record)", rank=rank, exitcode=code, traceback=tb)
        name = {s.value: s.name for s in signal.Signals}.get(-code, f"signal {-code}")
        return StageFailure(FailureKind.KILLED, f"rank {rank} was killed by {name} (exit code {code})",
                            rank=rank, exitcode=code, signal=name, traceback=tb)

    # Blame the first real error; a signal death or a bare exit beats errors that only say a peer died
    # ("Connection closed by peer"); torchrun's own SIGTERM to the survivors comes last.
    with_file = {e.local_rank for e in errors}
    bare = [loc for loc, (_, code) in exits.items() if loc not in with_file]
    real = [e for e in errors if not COLLATERAL.search(e.message)]
    if real:
        return from_error(real[0])
    for local in reversed(bare):  # torchrun prints its root cause (first observed failure) last
        if exits[local][1] != -signal.SIGTERM:
            return from_exit(local)
    if errors:
        return from_error(errors[0])
    if bare:
        return from_exit(bare[0])
    tail = "\n".join(torchrun_text.splitlines()[-40:])
    return StageFailure(FailureKind.UNKNOWN, f"torchrun exited with code {returncode} without a failing rank",
                        exitcode=returncode, traceback=f"torchrun output:\n{tail}")
