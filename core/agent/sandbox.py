"""Run untrusted Python in a child process with limits: `run_python`.

The child (``python -I -S``: no user site, no site-packages, no PYTHON* variables; an environment of TMPDIR and
HOME only) starts in a fresh working folder under `scratch`, in a session (process group) of its own, its stdout
and stderr going to files outside that folder. Before the code runs it puts up, where this Linux allows, the
layers that verlflow/core/agent/sandbox_child.py describes: namespaces (no network, no capability over the host),
landlock (writes only in its folder, no TCP, no signals out), rlimits (CPU, memory, file size, no new process),
seccomp (no fork/exec/socket/ptrace, no signals but to itself) and a Python audit hook (the same refusals at the
Python level, the fallback where the kernel offers none). The parent kills the whole process group at the wall
clock. `SandboxResult.layers` says which layers were up and `detail` what stopped the code, by which layer.

This module imports nothing heavy (no torch): environments run it on a rank.
"""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Optional

LAYERS = ("namespaces", "landlock", "rlimits", "seccomp", "audit")
_CHILD = Path(__file__).with_name("sandbox_child.py")


@dataclass
class SandboxResult:
    ok: bool  # exited 0 and nothing was refused
    stdout: str
    stderr: str
    reason: Optional[str]  # None, "timeout", "cpu", "memory", "refused" or "error"
    detail: str = ""  # what stopped it and by which layer, for people (and the model's observation)
    layers: dict = field(default_factory=dict)  # layer -> how it was put up (or why not)

    def describe(self, cap: int = 2000) -> str:
        """stdout and stderr, or what stopped the code: what a tool call shows the model."""
        text = self.stdout + (("\n" if self.stdout else "") + self.stderr if self.stderr else "")
        if self.reason not in (None, "error"):
            text = f"{text}\n[{self.detail}]" if text else f"[{self.detail}]"
        return _cap(text.strip() or "(no output)", cap)


def run_python(code: str, *, cpu_s: float, memory_mb: int, wall_s: float, scratch: Path | str,
               output_cap: int = 8000, file_mb: int = 16, layers: Collection[str] = LAYERS) -> SandboxResult:
    """Run `code` in a sandboxed child. `layers`: those to put up (tests leave some out to show the next holds)."""
    unknown = set(layers) - set(LAYERS)
    if unknown:
        raise ValueError(f"run_python: unknown layers {sorted(unknown)}; known: {LAYERS}")
    Path(scratch).mkdir(parents=True, exist_ok=True)
    call = Path(tempfile.mkdtemp(prefix="sandbox-", dir=scratch))
    try:
        work = call / "work"
        work.mkdir(mode=0o700)
        (call / "code.py").write_text(code, encoding="utf-8")
        with open(call / "out", "wb") as out, open(call / "err", "wb") as err, open(call / "report", "wb") as rep:
            cfg = {"code": str(call / "code.py"), "work": str(work), "report_fd": rep.fileno(), "cpu_s": cpu_s,
                   "memory_mb": int(memory_mb), "file_mb": int(file_mb), "layers": sorted(layers)}
            rc, timed_out = _spawn(cfg, work, out, err, rep, wall_s)
        report = _report(call / "report")
        reason, detail = _outcome(rc, timed_out, report, cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb)
        return SandboxResult(ok=reason is None, stdout=_read(call / "out", output_cap),
                             stderr=_read(call / "err", output_cap), reason=reason, detail=detail,
                             layers=report["layers"])
    finally:
        _remove(call)


def _spawn(cfg: dict, work: Path, out, err, rep, wall_s: float) -> tuple[int, bool]:
    argv = [sys.executable, "-I", "-S", "-X", "utf8", str(_CHILD), json.dumps(cfg)]
    proc = subprocess.Popen(argv, cwd=work, env={"TMPDIR": str(work), "HOME": str(work)}, stdin=subprocess.DEVNULL,
                            stdout=out, stderr=err, pass_fds=(rep.fileno(),), start_new_session=True)
    timed_out = False
    try:
        rc = proc.wait(timeout=wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid)
        rc = proc.wait()
    _kill_group(proc.pid)  # whatever it may have left behind
    return rc, timed_out


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _report(path: Path) -> dict:
    """The child's report lines: {"layers": {...}, "refused": [(event, what)], "end": (reason, text) or None}."""
    out: dict = {"layers": {}, "refused": [], "end": None}
    with open(path, "rb") as f:
        lines = f.read(1 << 16).decode("utf-8", "replace").splitlines()
    for line in lines:
        kind, _, rest = line.partition("\t")
        if kind == "layers" and not out["layers"]:
            try:
                out["layers"] = json.loads(rest)
            except ValueError:
                pass
        elif kind == "refused":
            out["refused"].append(tuple(rest.split("\t", 1)))
        elif kind == "end" and out["end"] is None:
            out["end"] = tuple(rest.split("\t", 1))
    return out


def _outcome(rc: int, timed_out: bool, report: dict, *, cpu_s: float, wall_s: float,
             memory_mb: int) -> tuple[Optional[str], str]:
    """(reason, detail) of a finished child."""
    if timed_out:
        return "timeout", f"timed out: the wall clock of {wall_s:g} s passed; the process group was killed"
    if rc in (-signal.SIGXCPU, -signal.SIGKILL) and report["layers"].get("rlimits") is True:
        return "cpu", f"stopped: the CPU time limit of {cpu_s:g} s (RLIMIT_CPU) was reached"
    end = report["end"]
    if end and end[0] == "memory":
        return "memory", f"stopped: out of memory under the limit of {memory_mb} MiB (RLIMIT_AS)"
    if report["refused"]:
        event, what = (report["refused"][0] + ("",))[:2]
        return "refused", f"refused: {what or event} (audit hook)"
    if end and end[0] == "refused":
        return "refused", f"refused: {end[-1]}"
    if rc != 0:
        return "error", f"exited with {'signal ' + str(-rc) if rc < 0 else 'code ' + str(rc)}"
    return None, ""


def _read(path: Path, cap: int) -> str:
    size = path.stat().st_size
    with open(path, "rb") as f:
        data = f.read(cap * 4)  # utf-8: at most 4 bytes a character
    text = data.decode("utf-8", "replace")
    if len(text) <= cap and size <= len(data):
        return text
    return _cap(text, cap) + f" ({size} bytes in all)"


def _cap(text: str, cap: int) -> str:
    return text if len(text) <= cap else text[:cap] + f"\n...[output truncated at {cap} characters]"


def _remove(folder: Path) -> None:
    """Remove the call's folder, whatever modes the code left on the folders it made."""
    for root, dirs, _files in os.walk(folder):
        for d in dirs:  # top-down: each is opened up before the walk enters it
            path = os.path.join(root, d)
            if not os.path.islink(path):
                os.chmod(path, stat.S_IRWXU)
    shutil.rmtree(folder, ignore_errors=True)
