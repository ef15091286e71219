"""Tests that need system software (PostgreSQL, Slurm, Chromium) which `make test` installs from Debian.

On a developer's machine without it they skip, saying what to install. CI sets VERLFLOW_REQUIRE_SYSTEM_TESTS=1
(.ci/run): there a missing dependency fails the run instead of silently skipping the test.
"""

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

REQUIRED = os.environ.get("VERLFLOW_REQUIRE_SYSTEM_TESTS") == "1"


def unavailable(reason: str):
    if REQUIRED:
        pytest.fail(f"{reason} (VERLFLOW_REQUIRE_SYSTEM_TESTS=1: CI must run this test, not skip it)", pytrace=False)
    pytest.skip(reason)


@contextmanager
def small_tmpfs(path: Path, size: str):
    """A real filesystem of `size` (e.g. "1m") mounted at `path` for a test of a full disk; mounting needs root."""
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode:
        unavailable("mounting a tmpfs needs root (a full filesystem is simulated with a small one)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
