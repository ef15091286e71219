"""The machine's cache folder for what outlives a run: compiled kernels, remote artifacts read back, tracking files
of s3:// stores, stage logs, the static engine's timed choices. $VERLFLOW_CACHE_DIR, else ~/.cache/verlflow."""

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("VERLFLOW_CACHE_DIR") or Path.home() / ".cache" / "verlflow")


def compile_cache_env(root: str | os.PathLike) -> dict[str, str]:
    """A stage job's cache folders under `root`: ours, torch.compile's and Triton's, so that one folder kept (a
    machine's disk, a shared volume) keeps every compiled kernel and timed choice for the next job."""
    root = os.fspath(root)
    return {"VERLFLOW_CACHE_DIR": root, "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"),
            "TRITON_CACHE_DIR": os.path.join(root, "triton")}
