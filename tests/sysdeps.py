"""Tests that need system software (PostgreSQL, Slurm, Chromium) which `make test` installs from Debian.

On a developer's machine without it they skip, saying what to install. CI sets VERLFLOW_REQUIRE_SYSTEM_TESTS=1
(.ci/run): there a missing dependency fails the run instead of silently skipping the test.
"""

import os

import pytest

REQUIRED = os.environ.get("VERLFLOW_REQUIRE_SYSTEM_TESTS") == "1"


def unavailable(reason: str):
    if REQUIRED:
        pytest.fail(f"{reason} (VERLFLOW_REQUIRE_SYSTEM_TESTS=1: CI must run this test, not skip it)", pytrace=False)
    pytest.skip(reason)
