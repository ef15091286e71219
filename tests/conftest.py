"""Shared fixtures. verl installs its own top-level `tests` package, so helpers here are plain modules."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

pytest_plugins = ["s3server", "kits", "prefect_server", "reference"]


# -- the order files reach the two xdist workers (`--dist loadfile`) ----------------------------------------------
# Longest first, so the last file to finish is a short one (a long file started last left one core idle for ~10
# minutes); files that wait for the session's reference run (tests/reference.py) alternate with files that do not,
# so the second worker has work while the first builds it. Seconds: one loaded CI run, 2026-12-02.
HEAVY_FIRST = ("test_faults", "test_pool", "test_stages", "test_slurm", "test_flows", "test_multinode",
               "test_algorithms", "test_lora", "test_phases", "test_hangs", "test_tracking", "test_security", "test_benchmarks", "test_schedule",
               "test_retention", "test_dcpio", "test_lease", "test_cli", "test_packaging", "test_postgres",
               "test_exports", "test_promotion", "test_k8s", "test_verify", "test_footprint", "test_preflight")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: tests keep their order in a file
