"""Which GPUs of this host a local stage job gets: one lock file per device, held while the job runs.

Prefect's slot limit counts devices; it cannot say which. Two runs that both fit would otherwise both start at
cuda:0. Locks are fcntl locks, so a killed launcher releases its devices at once.
"""

import fcntl
import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

from verlflow.core.wait import wait_until

LOCK_DIR = Path(os.environ.get("VERLFLOW_DEVICE_LOCKS", Path(tempfile.gettempdir()) / "verlflow-devices"))


def visible_devices() -> list[str]:
    """Device ids this process may use: CUDA_VISIBLE_DEVICES if set, else every GPU nvidia-smi lists."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]
    return []


@contextmanager
def claim(n: int, devices: list[str], *, lock_dir: Path | None = None, poll_s: float = 0.5, timeout_s: float | None = None,
          on_wait=None):
    """Hold `n` of `devices` (waiting while other jobs hold them); yields the claimed ids."""
    if n > len(devices):
        raise RuntimeError(f"this job needs {n} GPUs but only {len(devices)} are visible ({','.join(devices) or 'none'})")
    lock_dir = Path(lock_dir or LOCK_DIR)
    lock_dir.mkdir(parents=True, exist_ok=True)
    waited = False

    def take() -> list[tuple[str, int]]:
        nonlocal waited
        held = _lock_free(n, devices, lock_dir)
        if not held and on_wait and not waited:
            on_wait(f"waiting for {n} free GPU(s) among {','.join(devices)} (held by other stage jobs)")
            waited = True
        return held

    def too_long():
        raise TimeoutError(f"no {n} free GPUs among {','.join(devices)} within {timeout_s} s")

    held = wait_until(take, interval_s=poll_s, timeout_s=timeout_s, on_timeout=too_long)
    try:
        yield [d for d, _ in held]
    finally:
        _release(held)


def _lock_free(n: int, devices: list[str], lock_dir: Path) -> list[tuple[str, int]]:
    """(device, lock descriptor) of `n` devices nobody holds, or none: all or nothing, never sitting on a partial
    set (two jobs could deadlock)."""
    held: list[tuple[str, int]] = []
    try:
        for d in devices:
            if len(held) == n:
                break
            fd = os.open(lock_dir / f"gpu{d}.lock", os.O_CREAT | os.O_RDWR, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append((d, fd))
            except BlockingIOError:
                os.close(fd)
    except BaseException:
        _release(held)
        raise
    if len(held) == n:
        return held
    _release(held)
    return []


def _release(held: list[tuple[str, int]]) -> None:
    for _, fd in held:
        os.close(fd)  # closing the descriptor drops its flock
