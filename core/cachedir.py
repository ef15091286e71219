"""The machine's cache folder for what outlives a run: compiled kernels, remote artifacts read back, tracking files
of s3:// stores, stage logs, the static engine's timed choices. $VERLFLOW_CACHE_DIR, else ~/.cache/verlflow."""

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("VERLFLOW_CACHE_DIR") or Path.home() / ".cache" / "verlflow")
